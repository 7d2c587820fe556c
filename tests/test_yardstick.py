"""The naive rule's yardstick computed row chunk by row chunk (flashcheck/oracle/yardstick.py) equals the
rule's own, computed on the whole problem on the host (rule.naive_terms)."""
import numpy as np
import pytest
import torch

from flashcheck import oracle as orc
from flashcheck.oracle import yardstick
from flashcheck.strategies import AttentionCase as Case

CASES = [Case(hq=3, hkv=1, sq=45, sk=37, d=8, dv=6, causal=c, dtype=t, regime=r, seed=i, precision="naive")
         for i, (c, t, r) in enumerate([(None, "float16", "plain"), ("top_left", "bfloat16", "large"),
                                        ("bottom_right", "float16", "heavy"), ("bottom_right", "float32", "equal")])]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.causal}-{c.dtype}-{c.regime}")
def test_chunked_yardstick_equals_the_rules_on_the_whole_problem(case):
    q, k, v, do = (torch.from_numpy(x[0]).to(getattr(torch, case.dtype)) for x in case.inputs())
    got = yardstick.naive_terms(torch, case, q, k[0], v[0], do, chunk=16)
    want = orc._naive_allowed(case)
    for name in yardstick.NAMES:
        assert np.isclose(got[name], want[name], rtol=1e-6, atol=0), (
            f"{name}: expected the whole problem's naive term {want[name]!r}, the chunked yardstick gave {got[name]!r}")


def test_features_and_batches_are_refused_by_name():
    with pytest.raises(ValueError, match="one batch entry and kv head"):
        yardstick.naive_terms(torch, Case(batch=2, sq=4, sk=4, d=4, dv=4), *[None] * 4)
