"""The oracle: dense float64 truth and the one tolerance rule every implementation is held to.

Rule (DESIGN.md): for a result X of an implementation run in dtype t,

    max |X - X_true|  <=  k * max |X_dense_t - X_true|  +  floor  (+ half a t-spacing per entry)

where X_true is dense attention in float64 on the same (already dtype-rounded) inputs,
X_dense_t is plain dense attention computed in t, k = 2 for O and LSE and 3 for
gradients, and

    floor = 8 * (eps(acc) * (1 + L) + eps(t)) * M.

M is the size of the sum that forms X taken in absolute values (e.g. max_i sum_j
P_ij |v_j| for O), so eps(t) * M is one rounding of that sum in t (P is rounded to t
before P @ V in fused kernels); L is the largest |logit|, because a logit computed in the
accumulation precision acc (float32, or float64 for float64 inputs) carries an absolute
error of about eps(acc) * L, which exp() turns into a relative one. The floor lets a
correct kernel pass where the dense error happens to be zero (Sk = 1) and bounds float64
tightly; storing X in t rounds each entry by up to half its spacing, allowed per entry.
NaN or inf where the truth is finite always fails; a truth that is infinite in t (the
LSE of a row that sees no key, an fp16 gradient past 65504) must be matched exactly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from flashcheck.impls import numpy_ref
from flashcheck.strategies.case import EPS, AttentionCase, quantize

K = {"o": 2, "lse": 2, "dq": 3, "dk": 3, "dv": 3}
FLOOR = 8


@dataclass(frozen=True)
class Truth:
    o: np.ndarray
    lse: np.ndarray
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    mag: dict  # absolute-value size of each result's defining sum (see module doc)
    logit_max: float

    def __getitem__(self, name):
        return getattr(self, name)


def _group(case, x):
    """(B, Hq, ...) -> (B, Hkv, G, ...), the layout in which kv heads broadcast."""
    return x.reshape((case.batch, case.hkv, case.hq // case.hkv) + x.shape[2:])


@functools.lru_cache(maxsize=64)
def truth(case: AttentionCase) -> Truth:
    """Dense float64 attention and its analytic gradients on the case's inputs."""
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    o, lse = numpy_ref.dense_forward(q, k, v, **kw)
    dq, dk, dv = numpy_ref.dense_backward(q, k, v, o, lse, do, **kw)
    # |P|-weighted sums of absolute values bound the rounding of each result's sum.
    p, _, (qg, kg, vg, sc, _) = numpy_ref.dense_probs(q, k, v, kw["causal"], kw["scale"], "oracle")
    s = sc * (qg @ np.swapaxes(kg, -1, -2))
    dog, og = _group(case, do), _group(case, o)
    abs_ds = p * (np.abs(dog) @ np.abs(np.swapaxes(vg, -1, -2)) + np.abs((dog * og).sum(-1))[..., None])
    sc = abs(sc)
    mag = {
        "o": (p @ np.abs(vg)).max(initial=0),
        "lse": np.abs(lse[np.isfinite(lse)]).max(initial=0) + 1,
        "dv": (np.swapaxes(p, -1, -2) @ np.abs(dog)).sum(2).max(initial=0),
        "dq": sc * (abs_ds @ np.abs(kg)).max(initial=0),
        "dk": sc * (np.swapaxes(abs_ds, -1, -2) @ np.abs(qg)).sum(2).max(initial=0),
    }
    logit_max = float(np.abs(np.where(case.visible(), s, 0)).max(initial=0))
    return Truth(o, lse, dq, dk, dv, mag, logit_max)


def _dense_torch(case: AttentionCase, dtype: str) -> dict:
    """Plain dense attention and its autograd gradients, computed in ``dtype`` by PyTorch on CPU."""
    import torch

    dt = getattr(torch, dtype)
    q, k, v, do = (torch.from_numpy(x).to(dt).requires_grad_() for x in case.inputs())
    g = case.hq // case.hkv
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ kk.transpose(-1, -2)) * case.effective_scale
    vis = torch.from_numpy(case.visible())
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key: softmax of all -inf
    o = p @ vv
    lse = torch.logsumexp(s.masked_fill(~vis, float("-inf")), dim=-1)
    o.backward(do.detach())
    return {n: t.detach().to(torch.float64).numpy()
            for n, t in (("o", o), ("lse", lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


@functools.lru_cache(maxsize=64)
def dense_in_dtype(case: AttentionCase) -> dict:
    """Plain dense attention in case.dtype, the yardstick of the tolerance rule.

    Where plain dense attention itself overflows in that dtype (an fp16 q @ k^T past 65504
    before a tiny scale, an LSE past the fp16 range), it gives no yardstick for that
    result; dense attention computed in float32 and rounded to the result's dtype stands
    in for it, so the bound stays finite and meaningful.
    """
    plain = _dense_torch(case, case.dtype)
    t = truth(case)
    broken = [n for n in plain if (np.isfinite(t[n]) & ~np.isfinite(plain[n])).any()]
    if broken:
        wide = _dense_torch(case, "float32")
        plain.update({n: quantize(wide[n], result_dtype(case.dtype, n)) for n in broken})
    return plain


def result_dtype(dtype: str, name: str) -> str:
    """O and the gradients come back in the input dtype; LSE in float32 at least, as in
    FlashAttention and SDPA, because an LSE overflows float16 long before the logits do."""
    return "float32" if name == "lse" and dtype in ("float16", "bfloat16") else dtype


def max_error(got, want, dtype):
    """Largest error over the entries whose truth the dtype can hold (others must overflow)."""
    held = np.isfinite(quantize(want, dtype)) & np.isfinite(got)
    with np.errstate(invalid="ignore"):
        err = np.where(held, np.abs(got - want), 0.0)
    return float(err.max(initial=0.0))


def allowed(case: AttentionCase, name: str) -> tuple[float, float]:
    """(allowed max error, dense same-dtype error) for result ``name`` of this case.

    The result must also be stored in the dtype, which rounds each entry by up to half
    its spacing; ``compare`` adds that per entry (``half_spacing``).
    """
    t = truth(case)
    dense_err = (0.0 if case.dtype == "float64"
                 else max_error(dense_in_dtype(case)[name], t[name], result_dtype(case.dtype, name)))
    acc = EPS["float64" if case.dtype == "float64" else "float32"]
    floor = FLOOR * (acc * (1 + t.logit_max) + EPS[case.dtype]) * t.mag[name]
    return K[name] * dense_err + floor, dense_err


def half_spacing(x: np.ndarray, dtype: str) -> np.ndarray:
    """Half the gap between neighbouring ``dtype`` values at |x| (subnormals included)."""
    x = np.abs(np.where(np.isfinite(quantize(x, dtype)), x, 0))  # nothing to add where t overflows
    if dtype == "bfloat16":  # bfloat16 keeps float32's exponent range with 8 bits of mantissa
        return 0.5 * np.spacing(x.astype(np.float32)).astype(np.float64) * 2.0 ** 16
    return 0.5 * np.spacing(x.astype(dtype)).astype(np.float64)


def compare(case: AttentionCase, name: str, got: np.ndarray, want: np.ndarray | None = None,
            budget: float | None = None, who: str = "") -> None:
    """Assert ``got`` matches the truth (or ``want``) for result ``name`` under the tolerance rule."""
    want = truth(case)[name] if want is None else want
    tol, dense_err = allowed(case, name)
    tol = tol if budget is None else budget
    label = f"{who} {name}".strip()
    if got.shape != want.shape:
        raise AssertionError(f"{label}: expected shape {want.shape}, got {got.shape}\n  case: {case!r}")
    if np.isnan(want).any():
        raise AssertionError(f"{label}: the reference itself holds NaN at "
                             f"{tuple(int(i) for i in np.argwhere(np.isnan(want))[0])}\n  case: {case!r}")
    # A truth beyond the dtype's range must come back as the infinity it rounds to (an LSE
    # of -inf for a row that sees no key, an fp16 gradient past 65504); the rest finite.
    stored = quantize(want, result_dtype(case.dtype, name))
    bad_nonfinite = np.isfinite(stored) & ~np.isfinite(got)
    inf_mismatch = np.isinf(stored) & (got != stored)
    if bad_nonfinite.any() or inf_mismatch.any():
        idx = tuple(int(i) for i in np.argwhere(bad_nonfinite | inf_mismatch)[0])
        raise AssertionError(f"{label}: non-finite mismatch at {idx}: expected {stored[idx]!r}, got {got[idx]!r} "
                             f"({int((bad_nonfinite | inf_mismatch).sum())} such entries)\n  case: {case!r}")
    with np.errstate(invalid="ignore"):
        err = np.where(np.isinf(stored), 0.0, np.abs(got - want))
    limit = tol + half_spacing(want, result_dtype(case.dtype, name))
    if not (err <= limit).all():
        idx = tuple(int(i) for i in np.unravel_index(np.argmax(err - limit), err.shape))
        raise AssertionError(
            f"{label}: max error {float(err.max()):.3e}; at index {idx} the error {err[idx]:.3e} exceeds "
            f"allowed {limit[idx]:.3e} "
            f"(expected {want[idx]!r}, got {got[idx]!r})\n"
            f"  allowed = {K[name]} x dense {case.dtype} error {dense_err:.3e} + floor; "
            f"logit max {truth(case).logit_max:.3g}\n  case: {case!r}")


def dense64(case: AttentionCase, q, k, v) -> np.ndarray:
    """Dense float64 output for the case's settings on other inputs (e.g. transformed ones)."""
    return numpy_ref.dense_forward(q, k, v, **case.reference_kwargs())[0]
