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


def central_differences(case, forward, grads, sinks=None):
    """For q, k and v (and the sink logits, when given) each, along its own random direction u:
    (name, numeric, analytic, allowed).

    f(t) = sum(O(x + t u) * dO). The step balances the truncation error, at most
    (4/3) h^2 kappa^3 G (kappa: how fast the logits move along u; G: sum_i |dO_i| max_j |v_j|),
    against the rounding of f, about c eps (1 + L) G / h (L: the largest |q|.|k| logit). f is
    linear in v, so v's derivative has only the rounding term. A softcap c bends the logits on
    the scale of c: their derivatives along u grow by up to (1 + 1/c) each. A kept fraction
    1 - p of dropout scales G by 1 / (1 - p). The bound is 4x the optimum.
    """
    q, k, v, do = case.inputs()
    rng = np.random.default_rng(case.seed + 1)
    vis = case.visible()
    sc, eps = abs(case.effective_scale), np.finfo(np.float64).eps
    kk, vv = ph.kv_heads(case, k), ph.kv_heads(case, v)
    big_l = float((sc * np.abs(q) @ np.abs(np.swapaxes(kk, -1, -2))).max(initial=0))
    g_size = float((np.abs(do) * np.abs(vv).max(axis=2, keepdims=True)).sum()) / (1 - case.dropout_p)
    bend = 1 + 1 / case.softcap if case.softcap else 1.0
    xs = (q, k, v) if sinks is None else (q, k, v, sinks)
    out = []
    for i, (name, x, grad) in enumerate(zip(("q", "k", "v", "sinks"), xs, grads)):
        u = rng.standard_normal(x.shape)
        moved = list(xs)
        ds = (sc * u @ np.swapaxes(kk, -1, -2) if name == "q" else
              sc * q @ np.swapaxes(ph.kv_heads(case, u), -1, -2) if name == "k" else np.zeros(1))
        kappa = (float(np.abs(u).max()) if name == "sinks" else
                 bend * float(np.abs(np.where(vis, ds, 0)).max(initial=0)) if name != "v" else 0.0)
        size = g_size + (float((np.abs(do) * np.abs(ph.kv_heads(case, u)).max(axis=2, keepdims=True)).sum())
                         / (1 - case.dropout_p) if name == "v" else 0.0)
        a, b = 4 / 3 * kappa ** 3 * size, 64 * eps * (1 + big_l) * size
        h = (b / (2 * a)) ** (1 / 3) if a > 0 else 1.0
        h = min(h, 1.0)
        bound = 4 * (a * h * h + b / h)

        def f(t):
            moved[i] = x + t * u
            return float((forward(*moved) * do).sum())

        numeric = (f(h) - f(-h)) / (2 * h)
        out.append((name, numeric, float((grad * u).sum()), bound))
    return out


def _assert_agree(who, case, checks, slack=(0.0, 0.0, 0.0)):
    for (name, numeric, analytic, bound), extra in zip(checks, slack):
        note(f"d{name}: central difference {float(numeric)!r}, analytic {float(analytic)!r}, "
             f"allowed {bound + extra:.3e}")
        assert abs(numeric - analytic) <= bound + extra, (
            f"{who}: d{name} along a random direction: central difference {numeric:.12g}, from the gradient "
            f"{analytic:.12g}, |diff| {abs(numeric - analytic):.3e} > allowed {bound + extra:.3e}\n  case: {case!r}")


@given(case=fs.cases(dtypes=("float64",)))
@example(case=Case(sq=3, sk=2, causal="bottom_right"))
@example(case=Case(hq=2, hkv=1, sq=2, sk=3, d=2, dv=3, scale=0.7))
@example(case=Case(hq=3, hkv=1, sk=1, d=32, dv=32, scale=30.0, regime="heavy", seed=482))  # once cancelled badly
def test_analytic_backward_agrees_with_central_differences(case):
    """The reference's analytic gradients against central differences of its own forward, in float64."""
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    o, lse = numpy_ref.dense_forward(q, k, v, **kw)
    grads = numpy_ref.dense_backward(q, k, v, o, lse, do, **kw)
    checks = central_differences(case, lambda q, k, v: numpy_ref.dense_forward(q, k, v, **kw)[0], grads)
    _assert_agree("numpy-dense", case, checks)


@pytest.mark.requires("backward")
@pytest.mark.requires("float64")
@given(case=fs.cases(dtypes=("float64",)))
@example(case=Case(hq=2, hkv=1, sq=3, sk=4, d=3, causal="bottom_right"))
@example(case=Case(hq=3, hkv=1, sk=1, d=32, dv=32, scale=30.0, regime="heavy", seed=482))
def test_gradients_agree_with_central_differences_of_the_forward(impl, case):
    """Every implementation that runs float64: its gradients against central differences of its own forward."""
    case = fs.fit(impl, case)
    res = ph.backward(impl, case)
    checks = central_differences(case, lambda q, k, v: ph.forward(impl, case, q, k, v).o, (res.dq, res.dk, res.dv))
    # The gradient itself may carry the rounding the oracle allows; along u that adds up to sum |u| * allowed.
    rng = np.random.default_rng(case.seed + 1)
    dirs = [rng.standard_normal(s) for s in (res.dq.shape, res.dk.shape, res.dv.shape)]
    slack = [float((np.abs(u) * orc.allowed(case, n)[0]).sum()) for u, n in zip(dirs, ("dq", "dk", "dv"))]
    _assert_agree(impl.name, case, checks, slack)
