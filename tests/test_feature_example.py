"""The flash_attn_func-style example plug-in loads as a user loads it, declares all five features, and
passes a pinned case with every feature on (the full suite runs it with --impl)."""
import numpy as np
import pytest

from flashcheck import oracle as orc
from flashcheck import load
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties


def test_flash_attn_style_example_declares_every_feature_and_matches_dense():
    impl = load("examples/flash_attn_style.py:attention")
    assert (impl.window, impl.softcap, impl.alibi, impl.sinks, impl.dropout) == (True,) * 5
    case = Case(hq=2, hkv=1, sq=5, sk=7, d=3, dv=2, causal="bottom_right", window=(3, 0), softcap=2.0,
                alibi=(0.5, -0.25), sinks=(0.3, -1.0))
    res = ph.backward(impl, case)
    for name in ("o", "dq", "dk", "dv", "dsinks"):
        orc.compare(case, name, getattr(res, name), who=impl.name)
    dropped = case.replace(dropout_p=0.5, dropout_seed=11)
    first, again = ph.forward(impl, dropped).o, ph.forward(impl, dropped).o
    assert np.array_equal(first, again) and not np.allclose(first, res.o), (
        "expected dropout with one seed to be reproducible and to change the output")
