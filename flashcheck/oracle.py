"""The oracle: dense float64 truth, and the one rule that says how far a result may be from it.

Every result X of a case in dtype t is held, entry by entry, to

    |X - X_true|  <=  min(worst, Z * sigma)  +  coherent  +  |X_model - X_true|  +  1.5 ulp_t(X_true)

X_true is dense attention in float64 on the same (already t-exact) inputs. X_model is what a
correct fused kernel computes in t (impls/rounding.py): its realized error is always allowed.
The other terms bound the rounding a correct kernel may do differently from the model:

- Each term of the sum behind an entry (p_ij v_j for O, P_ij dO_i for dV, dS_ij k_j for dQ,
  dS_ij q_i for dK) carries an independent relative error: rho_ij for P (P rounded to t, the
  score's float32 dot product, the exp's argument), plus |dS_ij| u_t and dP's own error for dS.
  With a_j the bound on term j, ``worst`` = sum_j a_j and ``sigma`` = sqrt(sum_j a_j^2).
  Hoeffding's inequality gives P(|error| > Z sigma) <= 2 exp(-Z^2 / 2) = 3e-8 at Z = 6, so the
  bound tracks the sqrt(Sk) growth of real rounding instead of the Sk growth of the worst case,
  and never takes more than the worst case.
- Errors shared by a whole row add up coherently, with their sign: the error of D = rowsum(dO*O)
  (O comes back rounded to t) enters dQ_i as dD_i * |(P K)_i|, so cancellation in P K counts; the
  float32 accumulation of each sum is bounded by u_acc (2 + sqrt(n)) times its absolute size.
- Rounding the result to t costs half a unit in the last place; one more ulp is the floor.

A bias check follows (``check_bias``): a correct kernel's rounding is unbiased, so in fp16 and
bf16, a result whose mean signed error (or mean error towards larger magnitude) is both
significant (a self-normalized sign statistic past 5, probability <= 2 exp(-12.5) = 7e-6 for
symmetric independent errors) and larger than 0.75 ulp beyond the model's own bias fails, even
when every entry is inside its bound (bf16 outputs all 1% too large are 1.3-2.6 ulps off).

A kernel that declares precision="naive" (plain dense attention computed in t) is held to the
older, looser rule instead: k times the error of plain dense attention in t, plus a floor.

NaN or inf where the truth is finite always fails; a truth that is infinite in t (the LSE of a
row that sees no key, an fp16 gradient past 65504) must be matched exactly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from flashcheck.impls import numpy_ref
from flashcheck.impls.rounding import HALF, Precision, fused
from flashcheck.strategies.case import EPS, AttentionCase, quantize

RESULTS = ("o", "lse", "dq", "dk", "dv")
# Variance of a rounding error bounded by w: uniform on [-h, h] with h/w spread as the position of
# the value in its binade (log-uniform): E[(h/w)^2] = 3 / (8 ln 2) = 0.541, so Var = 0.541 w^2 / 3.
VAR = 3 / (8 * np.log(2)) / 3
K_MODEL = 0.0  # multiple of the rounding model's own error allowed on top (the bounds cover it: measured)
Z = 6.0  # standard deviations: a Gaussian passes 6 sigma with probability 2e-9
ULP_FLOOR = 0.25  # ulps allowed beyond the half ulp of rounding the result
BIAS_Z, BIAS_ULPS, BIAS_MIN_GROUPS = 5.0, 0.75, 32
K_NAIVE = {"o": 2, "lse": 2, "dq": 3, "dk": 3, "dv": 3, "dsinks": 3}
FLOOR_NAIVE = 8
FTZ = {"float32": 2.0 ** -126, "float64": 2.0 ** -1022}  # below these, GPU float32 flushes to zero
UNIT = {**{t: e / 2 for t, e in EPS.items()}, "tf32": 2.0 ** -11}


@dataclass(frozen=True)
class Truth:
    o: np.ndarray
    lse: np.ndarray
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dsinks: np.ndarray | None  # the sink logits' gradient (Hq,); None without sinks
    logit_max: float

    def __getitem__(self, name):
        return getattr(self, name)


@dataclass(frozen=True)
class _Parts:
    """Dense float64 intermediates in the grouped layout: (B, Hkv, G, Sq, .) against (B, Hkv, 1, Sk, .)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    s: np.ndarray  # scaled logits; only where visible
    p: np.ndarray  # softmax probabilities (0 where masked)
    o: np.ndarray
    lse: np.ndarray
    scale: float
    psink: np.ndarray | None  # the sink's share of each row's softmax, where the case has sinks


def _group(case, x):
    """(B, Hq, ...) -> (B, Hkv, G, ...), the layout in which kv heads broadcast."""
    return x.reshape((case.batch, case.hkv, case.hq // case.hkv) + x.shape[2:])


@functools.lru_cache(maxsize=32)
def _parts(case: AttentionCase) -> _Parts:
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    p, lse, (qg, kg, vg, sc, _), extra = numpy_ref.dense_probs(q, k, v, who="oracle", **kw)
    s = np.where(case.visible(), extra["s"], 0.0)  # softcapped, ALiBi-biased logits where visible
    return _Parts(qg, kg, vg, _group(case, do), s, p, p @ vg, lse, sc, extra["psink"])


@functools.lru_cache(maxsize=32)
def _dscores(case: AttentionCase):
    """(dP, dP - D, dS = P (dP - D)) in float64, grouped as _parts: the bounds and the bias check share them."""
    pt = _parts(case)
    dp = pt.do @ _swap(pt.v)
    dp_minus_d = dp - (pt.do * pt.o).sum(-1, keepdims=True)
    return dp, dp_minus_d, pt.p * dp_minus_d


@functools.lru_cache(maxsize=32)
def truth(case: AttentionCase) -> Truth:
    """Dense float64 attention and its analytic gradients on the case's inputs."""
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    o, lse = numpy_ref.dense_forward(q, k, v, **kw)
    dq, dk, dv, *dsinks = numpy_ref.dense_backward(q, k, v, o, lse, do, **kw)
    logit_max = float(np.abs(_parts(case).s).max(initial=0))
    return Truth(o, lse, dq, dk, dv, dsinks[0] if dsinks else None, logit_max)


@functools.lru_cache(maxsize=32)
def model(case: AttentionCase) -> dict:
    """What a correct fused kernel of the case's dtype and precision returns (impls/rounding.py)."""
    q, k, v, do = case.inputs()
    return fused(q, k, v, do, case.visible(), _parts(case).scale, Precision.of(case.dtype, case.precision))


def _dense_torch(case: AttentionCase, dtype: str) -> dict:
    """Plain dense attention and its autograd gradients, computed in ``dtype`` by PyTorch on CPU."""
    import torch

    dt = getattr(torch, dtype)
    q, k, v, do = (torch.from_numpy(x).to(dt).requires_grad_() for x in case.inputs())
    g = case.hq // case.hkv
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ kk.transpose(-1, -2)) * case.effective_scale
    if case.softcap:
        s = case.softcap * torch.tanh(s / case.softcap)
    if case.alibi is not None:
        slopes = torch.from_numpy(case.alibi_slopes()).to(dt)
        dist = (torch.arange(case.sq)[:, None] + case.sk - case.sq - torch.arange(case.sk)[None, :]).abs().to(dt)
        s = s - slopes.reshape(-1 if slopes.ndim == 2 else 1, case.hq, 1, 1) * dist
    s = s.masked_fill(~torch.from_numpy(case.visible()), float("-inf"))
    sink = None
    if case.sinks is not None:  # the sink: one more logit per head in every row, with no value
        sink = torch.from_numpy(case.sink_logits()).to(dt).requires_grad_()
        s = torch.cat([s, sink.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key: softmax of all -inf
    o = p[..., :case.sk] @ vv
    lse = torch.logsumexp(s, dim=-1)
    o.backward(do.detach())
    grads = (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)) + ((("dsinks", sink.grad),) if sink is not None else ())
    return {n: t.detach().to(torch.float64).numpy() for n, t in (("o", o), ("lse", lse)) + grads}


def result_dtype(dtype: str, name: str) -> str:
    """O and the gradients come back in the input dtype; LSE in float32 at least, as in
    FlashAttention and SDPA, because an LSE overflows float16 long before the logits do."""
    return "float32" if name == "lse" and dtype in HALF else dtype


def half_spacing(x: np.ndarray, dtype: str) -> np.ndarray:
    """Half the gap between neighbouring ``dtype`` values at |x| (subnormals included)."""
    x = np.abs(np.where(np.isfinite(quantize(x, dtype)), x, 0))  # nothing to add where t overflows
    if dtype == "bfloat16":  # bfloat16 keeps float32's exponent range with 8 bits of mantissa
        return 0.5 * np.spacing(x.astype(np.float32)).astype(np.float64) * 2.0 ** 16
    return 0.5 * np.spacing(x.astype(dtype)).astype(np.float64)


def _swap(x):
    return np.swapaxes(x, -1, -2)


def _bound(worst, var, coherent):
    # Squares of terms below 1e-154 underflow float64; for such tiny entries the worst case is kept.
    return np.where(worst > 1e-140, np.minimum(worst, Z * np.sqrt(var)), worst) + coherent


@functools.lru_cache(maxsize=32)
def _rounding_bounds(case: AttentionCase) -> dict:
    """The rounding terms of the rule (module doc), per entry, for every result."""
    pt = _parts(case)
    pr = Precision.of(case.dtype, case.precision)
    u_acc = UNIT[pr.acc]
    u_p = UNIT[pr.p_fmt] if pr.p_fmt != pr.acc else 0.0
    u_in = UNIT[pr.operand_fmt] if pr.operand_fmt != pr.acc else 0.0
    # P and dS lose their subnormals absolutely: fp16 keeps them at a spacing of 2^-24; float32
    # arithmetic on a GPU flushes values below 2^-126 to zero.
    sub = 2.0 ** -25 if pr.p_fmt == "float16" else FTZ[pr.acc]
    vis = case.visible()
    q, k, v, do, p, o, sc = pt.q, pt.k, pt.v, pt.do, pt.p, pt.o, abs(pt.scale)
    aq, ak, av, ado, ao = (np.abs(x) for x in (q, k, v, do, o))
    d, dv, sk, rows = q.shape[-1], v.shape[-1], case.sk, case.sq * q.shape[2]
    lse = np.where(np.isfinite(pt.lse), pt.lse, 0.0)[..., None]
    abs_s = sc * (aq @ _swap(ak))  # |q| . |k|: the size of each score's dot product
    sq_s = sc * sc * ((q * q) @ _swap(k * k))  # sum_d (q_d k_d)^2
    m = np.where(vis, pt.s, -np.inf).max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    acc = lambda n: u_acc * (2 + np.sqrt(n))  # noqa: E731  (float32 accumulation of n terms)
    # A score's error, relative in P: its dot product (D roundings, each at most u |partial sum|: in
    # variance about u^2/3 (D/2 sum_d (q_d k_d)^2 + D/3 s^2), whether the terms' signs are random or
    # alike), the scale and log2(e) products, the max or LSE subtracted before exp, exp itself, and
    # for TF32 the rounding of q and k.
    local = u_acc * (4 + 2 * np.abs(pt.s - m))
    score_worst = np.where(vis, u_in * 2 * abs_s + u_acc * d * abs_s + local, 0.0)
    score_var = np.where(vis, u_acc ** 2 / 3 * (d / 2 * sq_s + d / 3 * pt.s ** 2)
                         + VAR * (local ** 2 + (u_in * 2 * abs_s) ** 2), 0.0)
    # The LSE's own error shifts every P of its row in the backward (P = exp(s - LSE)).
    lse_own = acc(sk) + 2 * u_acc * np.abs(lse)
    lse_worst = (p * score_worst).sum(-1, keepdims=True) + lse_own
    lse_var = (p * p * score_var).sum(-1, keepdims=True) + VAR * lse_own ** 2
    rho = np.where(vis, u_p + u_in + score_worst + lse_worst, 0.0)  # bound on P_ij's relative error
    rho_var = np.where(vis, VAR * (u_p ** 2 + u_in ** 2) + score_var + lse_var, 0.0)  # and its variance
    sub = np.where(vis, sub, 0.0)
    w = p * rho + sub  # bound on the error of p_ij
    w2 = p * p * rho_var + sub * sub / 3  # its variance (subnormals: a fixed spacing, so uniform)
    out = {}
    # O: sum_j p_ij (1 + e_ij) v_j normalized by the exact sum (error sum_j p_ij e_ij v_j), or by
    # the sum of the rounded terms (error sum_j p_ij e_ij (v_j - O_i)); a kernel may do either.
    o_worst = w @ av + ao * w.sum(-1, keepdims=True)
    o_var = np.maximum(w2 @ (v * v), w2 @ (v * v) - 2 * o * (w2 @ v) + o * o * w2.sum(-1, keepdims=True))
    out["o"] = _bound(o_worst, o_var, acc(sk) * (p @ av + ao))
    # LSE = m + log(sum_j exp(s_j - m)) from float32 P: only the scores' errors and the sums.
    # Equal scores (identical keys) carry equal errors: the LSE's are taken as fully aligned.
    out["lse"] = _bound((p * score_worst).sum(-1), (p * np.sqrt(score_var)).sum(-1) ** 2,
                        acc(sk) + u_acc * np.abs(lse[..., 0]))
    # dV_j = sum_i P_ij dO_i over the rows of every head of the group.
    out["dv"] = _bound((_swap(w) @ ado).sum(2), (_swap(w2) @ (ado * ado)).sum(2),
                       acc(rows) * (_swap(p) @ ado).sum(2))
    # dS = P (dP - D): P's error, dP's float32 dot product, dS rounded to t (independent per entry),
    # and D's error, shared by every key of a row: D = rowsum(dO * O) reads O rounded to t.
    dp, dp_minus_d, ds = _dscores(case)
    a_ds = np.abs(ds)
    o_round = half_spacing(o, pr.out_fmt)
    # A kernel may also compute D as rowsum(P * dP) (autograd's softmax backward): its error is then
    # that sum's, u sum_j P_ij |dP_ij|. Autograd through an online softmax also leaves the running
    # max a gradient that is zero only up to that much, and hands it to one key (the argmax).
    e_row = acc(sk) * (p * np.abs(dp)).sum(-1, keepdims=True)
    d_worst = ((ado * (o_worst + o_round)).sum(-1, keepdims=True) + acc(dv) * (ado * ao).sum(-1, keepdims=True)
               + e_row)
    at_max = e_row * np.where(vis, 1.0, 0.0)  # the max's residue, on whichever visible key is the argmax
    d_var = (ado * ado * (o_var + o_round * o_round * VAR)).sum(-1, keepdims=True)
    dp_err = p * acc(dv) * (ado @ _swap(av))
    sub_ds = sub * (1 + np.abs(dp_minus_d))  # P's and dS's own subnormals
    # A softcap multiplies dS by 1 - tanh^2(s / c): the raw logit's error, divided by c, moves it
    # by up to twice that relative to itself (a small c magnifies float rounding a thousandfold).
    if case.softcap:
        raw = (2 * u_in + (d + 2) * u_acc) * abs_s
        g = 1 - np.tanh(pt.scale * (q @ _swap(k)) / case.softcap) ** 2  # dS's factor; its error scales with it
        rel_g = np.where(vis, 2 * g * raw / case.softcap + 4 * u_acc, 0.0)
    else:
        rel_g = 0.0
    eta = a_ds * (rho + u_p + rel_g) + dp_err + sub_ds
    eta2 = ds * ds * (rho_var + VAR * (u_p ** 2 + rel_g * rel_g)) + VAR * dp_err ** 2 + sub_ds * sub_ds / 3
    pk = np.abs(p @ k)  # D's error enters dQ_i as dD_i (P K)_i: cancellation in P K counts
    # A kernel may round dS, or q, already multiplied by the scale: their subnormals then cost
    # 2^-25 of the gradient itself, not of dS or q (cuDNN, FlashAttention-2 and FlexAttention on
    # an H200 at scale 1e-6, whose gradients are fp16 subnormals).
    sub_sc = sub / sc if sc > 0 else sub
    ones = np.ones_like(aq)
    q_sub = (_swap(a_ds * sub_sc) @ ones).sum(2), (_swap(ds * ds * sub_sc * sub_sc / 3) @ ones).sum(2)
    out["dq"] = sc * _bound(eta @ ak + d_worst * pk + sub_sc @ ak,
                            eta2 @ (ak * ak) + d_var * pk * pk + sub_sc * sub_sc / 3 @ (ak * ak),
                            acc(sk) * (a_ds @ ak) + e_row * ak.max(-2, keepdims=True, initial=0))
    pd, pd2 = p * d_worst, p * p * d_var
    out["dk"] = sc * _bound((_swap(eta + pd + sub_sc) @ aq).sum(2) + q_sub[0],
                            (_swap(eta2 + pd2 + sub_sc * sub_sc / 3) @ (aq * aq)).sum(2) + q_sub[1],
                            acc(rows) * (_swap(a_ds) @ aq).sum(2) + (_swap(at_max) @ aq).sum(2))
    if q.shape[2] > 1:  # GQA: FlashAttention-2 rounds each query head's dK and dV to t, then sums the group
        out["dk"] = out["dk"] + u_p * sc * np.abs(_swap(ds) @ q).sum(2)
        out["dv"] = out["dv"] + u_p * np.abs(_swap(p) @ do).sum(2)
    shape = {"o": (case.batch, case.hq, case.sq, case.dv), "lse": (case.batch, case.hq, case.sq),
             "dq": (case.batch, case.hq, case.sq, case.d)}
    return {n: b.reshape(shape[n]) + FTZ[pr.acc] if n in shape else b + FTZ[pr.acc] for n, b in out.items()}


@functools.lru_cache(maxsize=32)
def _naive_allowed(case: AttentionCase) -> dict:
    """The rule for precision="naive": k x the error of plain dense attention in t, plus a floor of
    8 (eps(acc)(1 + L) + eps(t)) M, where M is the size of the sum in absolute values."""
    t, pt = truth(case), _parts(case)
    plain = _dense_torch(case, case.dtype)
    broken = [n for n in plain if (np.isfinite(t[n]) & ~np.isfinite(plain[n])).any()]
    if broken:  # plain dense overflows in t: float32 rounded to t stands in as the yardstick
        wide = _dense_torch(case, "float32")
        plain.update({n: quantize(wide[n], result_dtype(case.dtype, n)) for n in broken})
    p, ado, sc = pt.p, np.abs(pt.do), abs(pt.scale)
    abs_ds = p * (ado @ _swap(np.abs(pt.v)) + np.abs((pt.do * pt.o).sum(-1))[..., None])
    mag = {"o": (p @ np.abs(pt.v)).max(initial=0), "lse": np.abs(t.lse[np.isfinite(t.lse)]).max(initial=0) + 1,
           "dv": (_swap(p) @ ado).sum(2).max(initial=0), "dq": sc * (abs_ds @ np.abs(pt.k)).max(initial=0),
           "dk": sc * (_swap(abs_ds) @ np.abs(pt.q)).sum(2).max(initial=0)}
    if pt.psink is not None:  # dsinks_h = -sum over batch and rows of P_sink * rowsum(dO * O)
        mag["dsinks"] = (pt.psink * (ado * np.abs(pt.o)).sum(-1)).sum(axis=(0, 3)).max(initial=0)
    acc = EPS["float64" if case.dtype == "float64" else "float32"]
    out = {}
    for n in mag:
        dense_err = 0.0 if case.dtype == "float64" else max_error(plain[n], t[n], result_dtype(case.dtype, n))
        out[n] = K_NAIVE[n] * dense_err + FLOOR_NAIVE * (acc * (1 + t.logit_max) + EPS[case.dtype]) * mag[n]
    return out


def allowed(case: AttentionCase, name: str) -> tuple[np.ndarray, float]:
    """(allowed error per entry, the rounding model's largest error) for result ``name``."""
    t = truth(case)
    out_t = result_dtype(case.dtype, name)
    floor = half_spacing(t[name], out_t) * (1 + 2 * ULP_FLOOR)  # half an ulp to round, plus the floor
    if name not in RESULTS:  # the sinks' gradient: the naive rule
        return _naive_allowed(case)[name] + floor, 0.0
    if case.precision == "naive":  # a naive kernel has the fused one's roundings too (subnormals included)
        return _naive_allowed(case)[name] + _rounding_bounds(case)[name] + floor, 0.0
    if case.features:  # the rounding model emulates plain attention: its bounds stand alone
        # dropout scales the kept probabilities, and their rounding, by 1 / (1 - p)
        return _rounding_bounds(case)[name] / (1 - case.dropout_p) + floor, 0.0
    model_err = np.nan_to_num(np.abs(model(case)[name] - t[name]), nan=0.0, posinf=0.0)
    return _rounding_bounds(case)[name] + K_MODEL * model_err + floor, float(model_err.max(initial=0.0))


def max_error(got, want, dtype):
    """Largest error over the entries whose truth the dtype can hold (others must overflow)."""
    held = np.isfinite(quantize(want, dtype)) & np.isfinite(got)
    with np.errstate(invalid="ignore"):
        err = np.where(held, np.abs(got - want), 0.0)
    return float(err.max(initial=0.0))


def compare(case: AttentionCase, name: str, got: np.ndarray, want: np.ndarray | None = None,
            budget=None, who: str = "") -> None:
    """Assert ``got`` matches the truth (or ``want``) for result ``name`` under the rule.

    ``budget`` (a number or an array of the result's shape) replaces the allowed error, for
    comparisons between two runs of one kernel.
    """
    against_truth = want is None
    source = "the float64 reference itself" if want is None else "the implementation's own result it is compared with"
    want = truth(case)[name] if want is None else want
    tol, model_err = allowed(case, name)
    tol = tol if budget is None else budget
    label = f"{who} {name}".strip()
    if got.shape != want.shape:
        raise AssertionError(f"{label}: expected shape {want.shape}, got {got.shape}\n  case: {case!r}")
    if np.isnan(want).any():
        raise AssertionError(f"{label}: {source} holds NaN at "
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
    limit = np.broadcast_to(tol, err.shape)
    if not (err <= limit).all():
        idx = tuple(int(i) for i in np.unravel_index(np.argmax(err / np.maximum(limit, 1e-300)), err.shape))
        over = int((err > limit).sum())
        raise AssertionError(
            f"{label}: {over} of {err.size} entries off by more than allowed; worst at {idx}: expected "
            f"{want[idx]!r}, got {got[idx]!r}, error {err[idx]:.3e} > allowed {limit[idx]:.3e} "
            f"({err[idx] / max(limit[idx], 1e-300):.3g}x)\n"
            f"  rule: {case.precision} {case.dtype} rounding model (its own largest error {model_err:.3e})\n"
            f"  case: {case!r}")
    if against_truth and budget is None:
        check_bias(case, name, got, want, label)


def bias(case: AttentionCase, name: str, got: np.ndarray, want: np.ndarray):
    """(statistic, size in ulps) of the mean signed error and of the mean error towards larger
    magnitude; None where the result has too few groups (rows of O and dQ, keys of dK and dV)."""
    t = result_dtype(case.dtype, name)
    ok = np.isfinite(got) & np.isfinite(quantize(want, t)) & (want != 0)
    ulps = (2 * half_spacing(want, t) * ok).sum()
    with np.errstate(invalid="ignore"):
        err = np.where(ok, got - want, 0.0)
    out = {}
    for kind, sign in (("signed", 1.0), ("magnitude", np.sign(want))):
        r = (err * sign).reshape(-1, want.shape[-1]).sum(-1)  # one independent sum per group
        # Groups whose truths round to the same values (uniform attention: every key's dV alike)
        # repeat one computation and its rounding: they count once.
        _, first = np.unique(quantize(want, t).reshape(-1, want.shape[-1]), axis=0, return_index=True)
        keep = np.zeros(r.size, bool)
        keep[first] = True
        r = r[keep & ok.reshape(-1, want.shape[-1]).any(-1)]
        if r.size < BIAS_MIN_GROUPS or ulps == 0:
            return None
        spread = np.sqrt((r * r).sum())
        out[kind] = (r.sum() / spread if spread > 0 else 0.0, r.sum() / ulps)
    return out


def _scaled_ds_subnormal(case) -> bool:
    """Does scale * dS mostly sit among float16's subnormals? A kernel that rounds dS after the
    scale then rounds most of it towards zero: a bias a correct kernel has (H200, scale 1e-6)."""
    if case.dtype != "float16":
        return False
    pt = _parts(case)
    ds = np.abs(pt.scale * _dscores(case)[2])[pt.p > 0]  # p is 0 where masked
    return ds.size > 0 and float(np.median(ds)) < 2.0 ** -14


def check_bias(case, name, got, want, label=""):
    if case.dtype not in HALF or name not in ("o", "dq", "dk", "dv") or case.precision == "naive" or case.features:
        return
    if name in ("dq", "dk") and _scaled_ds_subnormal(case):
        return
    seen = bias(case, name, got, want)
    if seen is None:
        return
    own = bias(case, name, model(case)[name], want)
    for kind, (stat, ulps) in seen.items():
        limit = BIAS_ULPS + abs(own[kind][1])
        if abs(stat) > BIAS_Z and abs(ulps) > limit:
            raise AssertionError(
                f"{label}: biased rounding: the {kind} error averages {ulps:+.2f} ulp per entry "
                f"(significance {stat:+.1f}; a correct kernel stays within {limit:.2f} ulp, its sign "
                f"statistic within {BIAS_Z:g})\n  case: {case!r}")


def dense64(case: AttentionCase, q, k, v) -> np.ndarray:
    """Dense float64 output for the case's settings on other inputs (e.g. transformed ones)."""
    return numpy_ref.dense_forward(q, k, v, **case.reference_kwargs())[0]
