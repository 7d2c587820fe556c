"""FlexAttention on CPU: one pinned case per feature and their combination, for CI.

Eager FlexAttention is too slow on CPU for the whole property suite in CI (impls/flex.py tags
it slow there); ``pytest -m properties --impl flex`` runs every property on it.
"""
import pytest

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

flex = pytest.importorskip("flashcheck.impls.flex")
pytestmark = pytest.mark.properties

CASES = [
    Case(hq=4, hkv=2, sq=5, sk=7, d=3, dv=2, causal="bottom_right"),
    Case(sq=6, sk=3, d=2, window=(1, 0), dtype="float32"),  # Sq > Sk: rows that see nothing
    Case(sq=4, sk=6, causal="top_left", window=(2, 3)),
    Case(sq=3, sk=5, softcap=0.05, regime="large", dtype="float32"),
    Case(batch=2, hq=2, sq=4, sk=6, alibi=((0.5, -0.25), (1.0, 0.0))),
    Case(hq=2, sq=4, sk=2, causal="bottom_right", sinks=(0.5, -1e30)),
    Case(hq=2, hkv=1, sq=5, sk=4, d=4, causal="bottom_right", window=(2, -1), softcap=3.0, alibi=(0.25, 0.5),
         sinks=(1.0, -2.0), dtype="float16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "+".join(c.features) or "plain")
def test_flex_on_cpu_matches_dense_float64(case):
    impl = flex.attention.__flashcheck__
    if impl.devices != ("cpu",):
        pytest.skip("flex runs compiled on CUDA here: the gpu lane runs every property on it")
    case = fs.fit(impl, case)
    res = ph.forward(impl, case)
    orc.compare(case, "o", res.o, who="flex")
    orc.compare(case, "lse", res.lse, who="flex")
