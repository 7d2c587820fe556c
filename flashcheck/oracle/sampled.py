"""The oracle on sampled query rows: the float64 truth and the rule's bound for O, LSE and dQ at
chosen rows only, for cases too large for the dense truth.

O, LSE and dQ of a query row depend on that row alone (its q, dO, mask and bias rows, against every
key), and so does every term of their bounds (bounds.py: the row's own scores, its P, its LSE, its
D = rowsum(dO O)). So the rule, applied to a problem holding only the sampled rows, gives those rows
exactly the bound it gives them in the whole problem, at O(rows x Sk x D) instead of O(Sq x Sk x D)
(tests/test_sampled.py checks the verdicts against the dense oracle's, entry by entry).

dK and dV sum over every query row, and each term of their bounds needs that row's whole softmax
(its LSE, its D): a key costs O(Sq x Sk x D) whichever keys are sampled. So they are judged only
when the rows hold every query row (a whole head read back from a device, properties/test_scale.py).

What it cannot judge, it refuses by name: the naive rule at a subset of the rows unless given its
whole-problem terms (it needs plain dense attention in t on the whole problem: yardstick.py), dropout
(the keep mask is the kernel's), dK and dV at a subset of the rows, and the sinks' and the bias's
gradients (sums over rows and heads).
"""
from __future__ import annotations

import numpy as np

from flashcheck.oracle import bounds, reference
from flashcheck.oracle import rule
from flashcheck.strategies.case import AttentionCase

NAMES = ("o", "lse", "dq")  # the results that are functions of one query row
KEY_NAMES = ("dk", "dv")  # sums over every query row: judged only when the rows are all of them


def rows_to_check(case: AttentionCase, block: int = 128, random_rows: int = 16, seed: int = 0,
                  boundaries: int | None = None) -> np.ndarray:
    """Query rows worth checking in a large case, sorted: the first and last tile, each side of every
    tile boundary of ``block`` rows (where a kernel's tiling changes hands; ``boundaries`` of them,
    drawn, where given), and ``random_rows`` more."""
    sq, rng = case.sq, np.random.default_rng(seed)
    edges = [np.arange(min(block, sq)), np.arange(max(0, sq - block), sq)]
    starts = np.arange(block, sq, block)
    if boundaries is not None and len(starts) > boundaries:
        starts = rng.choice(starts, boundaries, replace=False)
    edges += [np.array([start - 1, start]) for start in starts]
    chosen = np.concatenate(edges + [rng.integers(0, sq, random_rows)])
    return np.unique(chosen[(chosen >= 0) & (chosen < sq)])


def _refuse(case: AttentionCase, name: str, rows: np.ndarray):
    why = ("dropout's keep mask is the kernel's" if case.dropout_p
           else None if name in NAMES or (name in KEY_NAMES and len(rows) == case.sq)
           else f"{name} sums over every query row, and {len(rows)} of {case.sq} rows were sampled")
    if why:
        raise ValueError(f"the sampled oracle cannot judge {name} of {case!r}: {why}")


def _row_kwargs(case: AttentionCase, rows: np.ndarray) -> dict:
    """The reference's keyword arguments, its mask and bias tensors cut to ``rows``."""
    kw = case.reference_kwargs()
    for name in ("attn_mask", "attn_bias"):
        if kw.get(name) is not None:
            x = np.asarray(kw[name])
            kw[name] = x[:, :, rows] if x.shape[2] == case.sq else x  # a row broadcast (size 1) stays
    return kw | {"rows": (rows, case.sq)}


def parts(case: AttentionCase, rows: np.ndarray, inputs=None, naive: dict | None = None):
    """(truth, bounds): the float64 O, LSE and dQ at ``rows`` (B, Hq, R, .), dK and dV where ``rows`` are
    every row, and the rule's rounding terms; ``inputs``: (q, k, v, dO) as float64 arrays, where not the
    case's own (a head read off a device). Under the naive rule at a subset of the rows, ``naive`` gives its
    whole-problem terms for O, LSE and dQ (yardstick.naive_terms, computed where the inputs lie)."""
    if case.precision == "naive" and len(rows) < case.sq and naive is None:
        raise ValueError(f"the sampled oracle cannot judge {case!r} at {len(rows)} of its {case.sq} rows: the naive "
                         "rule needs plain dense attention in t on the whole problem (yardstick.naive_terms)")
    q, k, v, do = case.inputs() if inputs is None else inputs
    q, do = q[:, :, rows], do[:, :, rows]
    kw = _row_kwargs(case, rows)
    probs = reference.dense_probs(q, k, v, who="sampled oracle", **kw)
    kw.pop("rows")
    o, lse = reference.dense_forward(q, k, v, probs=probs, **kw)
    dq, dk, dv, *rest = reference.dense_backward(q, k, v, o, lse, do, probs=probs, **kw)
    p, lse_g, (qg, kg, vg, sc, _), extra = probs
    vis = case.visible_grouped(rows)
    s = np.where(vis, extra["s"], 0.0)
    dog = do.reshape(qg.shape[:-1] + (do.shape[-1],))
    pt = rule._Parts(qg, kg, vg, dog, s, p, p @ vg, lse_g, sc, extra["psink"], extra["added"])
    dp = dog @ np.swapaxes(vg, -1, -2)
    dp_minus_d = dp - (dog * pt.o).sum(-1, keepdims=True)
    terms = bounds.rounding_bounds(bounds.RowView(case, vis), pt, (dp, dp_minus_d, p * dp_minus_d),
                                   rule.half_spacing)  # in its own error state (bounds.quiet)
    truth = {"o": o, "lse": lse, "dq": dq}
    if len(rows) < case.sq:
        return truth, terms if case.precision != "naive" else {n: terms[n] + naive[n] for n in NAMES}
    if case.precision == "naive":  # a naive kernel has the fused one's roundings too (rule.allowed)
        t = rule.Truth(o, lse, float(np.abs(s).max(initial=0)), rule.gradients(case, dq, dk, dv, *rest))
        naive = rule.naive_terms(case, t, pt, (q, k, v, do))
        terms = {n: terms[n] + naive[n] for n in terms}
    return truth | {"dk": dk, "dv": dv}, terms


def allowed(case: AttentionCase, name: str, rows: np.ndarray, truth=None, terms=None, inputs=None) -> np.ndarray:
    """The rule's allowed error at ``rows`` of result ``name`` (rule.allowed, cut to those rows)."""
    _refuse(case, name, rows)
    if truth is None or terms is None:
        truth, terms = parts(case, rows, inputs)
    return rule.with_output_rounding(case, name, truth[name], terms[name])


def entries(case: AttentionCase, name: str, got: np.ndarray, rows: np.ndarray, inputs=None, parts_=None) -> rule.Entries:
    """``got``, result ``name`` at ``rows`` only (B, Hq, R, .), entry by entry under the rule; ``parts_``:
    parts()'s answer for these rows, where already computed."""
    _refuse(case, name, rows)
    truth, terms = parts_ or parts(case, rows, inputs)
    return rule.entries(case, name, got, want=truth[name], budget=allowed(case, name, rows, truth, terms))


def compare(case: AttentionCase, name: str, got: np.ndarray, rows: np.ndarray, who: str = "", inputs=None,
            parts_=None) -> None:
    """Assert ``got`` (result ``name`` at ``rows``) lies within the rule; the message names the row."""
    e = entries(case, name, got, rows, inputs, parts_)
    if not e.wrong.any():
        return
    label = f"{who} {name} (sampled rows)".strip()
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.where(e.nonfinite, np.inf, e.err / np.maximum(e.limit, 1e-300))
    idx = np.unravel_index(int(np.argmax(np.where(e.wrong, ratio, -1.0))), ratio.shape)
    at = idx if name in KEY_NAMES else idx[:2] + (int(rows[idx[2]]),) + idx[3:]  # a key's index is its own
    raise AssertionError(
        f"{label}: {int(e.wrong.sum())} of {e.err.size} sampled entries off by more than allowed; worst at "
        f"{tuple(int(i) for i in at)}: expected {float(e.want[idx])!r}, got {float(got[idx])!r}, error "
        f"{float(e.err[idx]):.3e} > allowed {float(e.limit[idx]):.3e}\n  rows checked: {len(rows)} of {case.sq}"
        f"\n  case: {case!r}")
