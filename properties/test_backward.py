"""Gradients match the analytic float64 backward, which itself matches finite differences."""
import numpy as np
import pytest
from hypothesis import assume, example, given, note

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties


@pytest.mark.requires("backward", "independent")
@given(case=fs.cases())
@ph.every_dtype_and_regime(long=True)
@example(case=Case())
@example(case=Case(sk=2, block_k=1, dtype="float32"))  # gradients across two key tiles
@example(case=Case(sq=4, sk=2, causal="bottom_right", block_q=2))  # rows that see nothing
@example(case=Case(sq=3, sk=5, causal="top_left", block_k=2))  # keys nobody sees
@example(case=Case(hq=6, hkv=2, sq=2, sk=3, d=3))  # dK, dV summed over the group
@example(case=Case(sq=3, sk=3, d=2, scale=3.0))  # a custom scale enters dQ and dK
@example(case=Case(sq=3, sk=4, d=5, dtype="float32", regime="large"))
def test_gradients_match_analytic_float64(impl, case):
    case = fs.fit(impl, case)
    res = ph.backward(impl, case)
    for name in ("dq", "dk", "dv"):
        orc.compare(case, name, getattr(res, name), who=impl.name)


@pytest.mark.requires("backward")
@pytest.mark.requires("masked")
@given(case=fs.cases(masked_rows=True) | fs.cases(masked_keys=True))
@example(case=Case(sq=3, sk=5, causal="top_left"))
def test_masked_positions_get_exactly_zero_gradient(impl, case):
    case = fs.fit(impl, case)
    rows, keys = ph.masked_rows(case), ph.masked_keys(case)
    assume(rows.size or keys.size)
    note(f"rows that see nothing: {rows.tolist()}; keys nobody sees: {keys.tolist()}")
    res = ph.backward(impl, case)
    for name, grad, idx in (("dq", res.dq, rows), ("dk", res.dk, keys), ("dv", res.dv, keys)):
        part = grad[:, :, idx]
        assert np.all(part == 0), (f"{impl.name}: expected {name} = 0 at masked positions {idx.tolist()}, "
                                   f"got {part[part != 0][:5]}\n  case: {case!r}")


@pytest.mark.requires("backward")
@pytest.mark.requires("float64")
@given(case=fs.cases(dtypes=("float64",)))
@example(case=Case(hq=2, hkv=1, sq=3, sk=4, d=3, causal="bottom_right"))
@example(case=Case(hq=3, hkv=1, sk=1, d=32, dv=32, scale=30.0, regime="heavy", seed=482))
def test_gradients_agree_with_central_differences_of_the_forward(impl, case):
    """Every implementation that runs float64: its gradients against central differences of its own forward."""
    case = fs.fit(impl, case)
    res = ph.backward(impl, case)
    checks = ph.central_differences(case, lambda q, k, v: ph.forward(impl, case, q, k, v).o, (res.dq, res.dk, res.dv))
    # The gradient itself may carry the rounding the oracle allows; along u that adds up to sum |u| * allowed.
    rng = np.random.default_rng(case.seed + 1)
    dirs = [rng.standard_normal(s) for s in (res.dq.shape, res.dk.shape, res.dv.shape)]
    slack = [float((np.abs(u) * orc.allowed(case, n)).sum()) for u, n in zip(dirs, ("dq", "dk", "dv"))]
    ph.assert_agree(impl.name, case, checks, slack)
