"""The oracle rejects what it must and nothing else (a smaller run of tests/oracle_power.py)."""
import functools

import numpy as np
import pytest

from flashcheck import oracle as orc
from tests import oracle_power as op
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties
GROSS = ("zero", "negated", "one row", "one key", "all scaled")


@functools.lru_cache(maxsize=1)
def _scores():
    return op.score(orc, dtypes=("float16", "bfloat16", "float32"), n=4, correct=op.torch_tiled)


def _rate(dtype, name, labels):
    hit = total = 0
    for (t, _, n, label), (h, c) in _scores()[0].items():
        if t == dtype and n == name and label in labels:
            hit, total = hit + h, total + c
    return hit, total


def test_correct_kernels_are_never_rejected():
    alarms = _scores()[1]
    assert not alarms, "correct results rejected: " + "; ".join(f"{who} {n} on {c!r}" for c, n, who in alarms[:5])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["o", "dq", "dk", "dv"])
def test_gross_errors_in_half_precision_are_rejected(dtype, name):
    """Zeroed, negated, a whole row or key off, or all scaled, by 4x a correct kernel's error and 2 ulps."""
    hit, total = _rate(dtype, name, GROSS)
    assert total and hit >= 0.9 * total, f"{dtype} {name}: expected >= 90% of gross perturbations rejected, got {hit}/{total}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_an_lse_with_bfloat16_sized_error_is_rejected(dtype):
    hit, total = _rate(dtype, "lse", ("bf16 LSE", "1% too large"))
    assert hit == total > 0, f"{dtype}: expected every LSE off by bf16 rounding or 1% rejected, got {hit}/{total}"


def test_bfloat16_output_one_percent_too_large_fails_by_bias_alone():
    case = Case(hq=2, hkv=1, sq=256, sk=256, d=16, dv=16, dtype="bfloat16", causal="bottom_right", seed=3)
    good = orc.model(case)["o"]
    want = orc.truth(case).o
    big = orc.quantize(np.where(np.isfinite(want), good * 1.01, good), "bfloat16")
    ulps = np.abs(big - good) / (2 * orc.half_spacing(want, "bfloat16") + 1e-300)
    assert np.median(ulps[want != 0]) <= 2.5, "the perturbation should stay within a few ulps per entry"
    orc.compare(case, "o", good)  # the correct rounding passes, bias check included
    with pytest.raises(AssertionError, match="biased rounding"):
        orc.check_bias(case, "o", big, want, "o")  # the per-entry bounds aside


def test_rounding_model_matches_plain_float64_for_float64_inputs():
    case = Case(hq=2, hkv=1, sq=9, sk=13, d=5, dv=3, causal="bottom_right")
    for name in orc.RESULTS:
        got, want = orc.model(case)[name], orc.truth(case)[name]
        fin = np.isfinite(want)
        assert np.array_equal(fin, np.isfinite(got)), f"{name}: infinities differ"
        assert np.allclose(got[fin], want[fin], rtol=1e-12, atol=1e-14), f"{name}: model differs from float64"
