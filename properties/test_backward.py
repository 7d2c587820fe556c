"""Gradients match the analytic float64 backward, which itself matches finite differences."""
import numpy as np
import pytest
from hypothesis import assume, example, given, note

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.impls import numpy_ref
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties


@pytest.mark.requires("backward")
@given(case=fs.cases())
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


@given(case=fs.cases(dtypes=("float64",), regimes=("plain", "equal", "ties", "dominant", "heavy")))
@example(case=Case(sq=3, sk=2, causal="bottom_right"))
@example(case=Case(hq=2, hkv=1, sq=2, sk=3, d=2, dv=3, scale=0.7))
def test_analytic_backward_agrees_with_central_differences(case):
    """d/dt f(x + t u) at t = 0, with f = sum(O * dO), against <grad f, u>, in float64."""
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    o, lse = numpy_ref.dense_forward(q, k, v, **kw)
    grads = numpy_ref.dense_backward(q, k, v, o, lse, do, **kw)
    rng = np.random.default_rng(case.seed + 1)
    dirs = [rng.standard_normal(x.shape) for x in (q, k, v)]

    def f(t):
        qq, kk, vv = (x + t * u for x, u in zip((q, k, v), dirs))
        return float((numpy_ref.dense_forward(qq, kk, vv, **kw)[0] * do).sum())

    h = 1e-5 / (1 + orc.truth(case).logit_max)
    numeric = (f(h) - f(-h)) / (2 * h)
    analytic = sum(float((g * u).sum()) for g, u in zip(grads, dirs))
    size = sum(float(np.abs(g * u).sum()) for g, u in zip(grads, dirs))
    note(f"numeric {numeric!r}, analytic {analytic!r}")
    assert abs(numeric - analytic) <= 1e-6 * (1 + size), (
        f"central difference {numeric:.10g} != analytic {analytic:.10g} (|diff| {abs(numeric - analytic):.3e})")
