"""Short helpers the property tests share. Import as ``from flashcheck.properties import helpers as ph``."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, note

from flashcheck.contract import call
from flashcheck.oracle.rounding import HALF, RESULTS  # noqa: F401  (the properties read ph.RESULTS)
from flashcheck.strategies import REGIMES, AttentionCase as Case
from flashcheck.strategies import draw as fs_draw
from flashcheck.strategies.draw import DEFAULT_DTYPES as DTYPES




def forward(impl, case, q=None, k=None, v=None) -> call.Result:
    """Run ``impl`` forward on the case's inputs (or on the given float64 arrays)."""
    cq, ck, cv, _ = case.inputs()
    return call.run(impl, case, cq if q is None else q, ck if k is None else k, cv if v is None else v)


def backward(impl, case) -> call.Result:
    """Forward, then backward through the case's dO."""
    return call.run(impl, case, *case.inputs())


def _seen(case) -> np.ndarray:
    """(Sq, Sk): whether any batch entry and head sees key j from row i (a mask tensor varies by both)."""
    vis = case.visible()
    return vis if vis.ndim == 2 else vis.any(axis=(0, 1))


def masked_rows(case) -> np.ndarray:
    """Indices of query rows that see no key, in every batch entry and head."""
    return np.flatnonzero(~_seen(case).any(axis=1))


def masked_keys(case) -> np.ndarray:
    """Indices of keys that no query sees, in every batch entry and head."""
    return np.flatnonzero(~_seen(case).any(axis=0))


def kv_heads(case, x):
    """Repeat a (B, Hkv, ...) array so query head h finds its kv head at index h."""
    return np.repeat(x, case.hq // case.hkv, axis=1)


# Pins that make every (dtype, regime) pair reach a property in every run, CI's derandomized one
# included: a generated sample of 25 cases reaches about 16 of the 28 pairs. The shapes rotate so
# that the pins also cover GQA, Sq != Sk in both directions, both causal alignments and odd head dims.
COVER_SHAPES = (
    dict(hq=2, hkv=1, sq=17, sk=33, d=8, dv=8),
    dict(hq=4, hkv=2, sq=33, sk=17, d=16, dv=16, causal="bottom_right"),
    dict(hq=3, hkv=3, sq=23, sk=40, d=5, dv=7, causal="top_left", block_q=8, block_k=4),
    dict(batch=2, hq=2, hkv=2, sq=40, sk=40, d=32, dv=32, causal="bottom_right", scale=2.0),
)
# One long case per half type: accumulation bugs need length (drawn too, in the long region).
LONG_PINS = tuple(Case(hq=2, hkv=1, sq=2048, sk=2048, d=8, dv=8, dtype=t, causal="bottom_right",
                       block_q=64, block_k=64, seed=7) for t in HALF)


def cover_cases(regimes=None, long=False, causal=True):
    pairs = [(t, r) for t in DTYPES for r in (regimes or REGIMES)]
    pins = [Case(dtype=t, regime=r, seed=i, **COVER_SHAPES[i % len(COVER_SHAPES)]) for i, (t, r) in enumerate(pairs)]
    pins += list(LONG_PINS if long else ())
    return pins if causal else [c.replace(causal=None) for c in pins]


_ALL_PINS = frozenset(c for regimes in (None, ("equal",)) for causal in (True, False)
                      for c in cover_cases(regimes, True, causal))


def slow_pin(impl, case) -> bool:
    """A coverage pin on an implementation in the CPU interpreter lane, whose every call costs
    seconds: that lane runs the pins on the value properties only (forward and gradients)."""
    return "interpreter" in impl.tags and case in _ALL_PINS


def every_dtype_and_regime(regimes=None, long=False, causal=True, **other):
    """@example pins: one mid-sized case per (dtype, regime) pair (and the long pins if asked);
    ``causal=False`` for properties of unmasked attention; ``other`` fills the test's other arguments."""
    def pin(test):
        cases = cover_cases(regimes, long, causal)
        for case in reversed(cases):
            test = example(case=case, **other)(test)
        # the plugin tells the strategies these are coverage pins: refitting them is their job
        test.flashcheck_coverage = getattr(test, "flashcheck_coverage", frozenset()) | frozenset(cases)
        return test

    return pin




# The strategies' self-tests assert the CPU profiles' limits and dtypes (the gpu profile draws
# longer sequences and no float64): they skip in the gpu lane.
CPU_PROFILES_ONLY = pytest.mark.skipif(fs_draw.limits() is fs_draw.LIMITS["gpu"], reason="self-tests of the "
                                       "strategies run in the CPU lanes, under the limits they assert")


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
    kk, vv = kv_heads(case, k), kv_heads(case, v)
    big_l = float((sc * np.abs(q) @ np.abs(np.swapaxes(kk, -1, -2))).max(initial=0))
    g_size = float((np.abs(do) * np.abs(vv).max(axis=2, keepdims=True)).sum()) / (1 - case.dropout_p)
    bend = 1 + 1 / case.softcap if case.softcap else 1.0
    xs = (q, k, v) if sinks is None else (q, k, v, sinks)
    out = []
    for i, (name, x, grad) in enumerate(zip(("q", "k", "v", "sinks"), xs, grads)):
        u = rng.standard_normal(x.shape)
        moved = list(xs)
        ds = (sc * u @ np.swapaxes(kk, -1, -2) if name == "q" else
              sc * q @ np.swapaxes(kv_heads(case, u), -1, -2) if name == "k" else np.zeros(1))
        kappa = (float(np.abs(u).max()) if name == "sinks" else
                 bend * float(np.abs(np.where(vis, ds, 0)).max(initial=0)) if name != "v" else 0.0)
        size = g_size + (float((np.abs(do) * np.abs(kv_heads(case, u)).max(axis=2, keepdims=True)).sum())
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


def assert_agree(who, case, checks, slack=(0.0, 0.0, 0.0)):
    for (name, numeric, analytic, bound), extra in zip(checks, slack):
        note(f"d{name}: central difference {float(numeric)!r}, analytic {float(analytic)!r}, "
             f"allowed {bound + extra:.3e}")
        assert abs(numeric - analytic) <= bound + extra, (
            f"{who}: d{name} along a random direction: central difference {numeric:.12g}, from the gradient "
            f"{analytic:.12g}, |diff| {abs(numeric - analytic):.3e} > allowed {bound + extra:.3e}\n  case: {case!r}")


def assert_one_change_is_refused(impl, args, kw, change, word: str, own=()):
    """The valid call runs; then ``change(kw)`` (exactly one malformed input) must raise, and our own
    built-ins (``own``) must name ``word`` in the error."""
    import pytest

    impl.fn(*args, **kw)  # the valid call runs, so a refusal below is about the one change
    change(kw)
    with pytest.raises(Exception) as info:
        impl.fn(*args, **kw)
    if impl.name in own:
        assert word in str(info.value), f"{impl.name}: expected the error to name {word!r}, got: {info.value}"
