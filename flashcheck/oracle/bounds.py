"""The rounding terms of the oracle's rule, per entry of every result (flashcheck/oracle/rule.py's doc).

``rounding_bounds`` reads the dense float64 intermediates of a case (the oracle's ``_Parts``) and
returns, for O, LSE, dQ, dK and dV, how far a correct kernel of the declared precision may land
from the truth through rounding. Every place where correct kernels round (flashcheck/oracle/rounding.py's
catalogue) has its term here; the comments name the site.

Two records are shared: ``Scores``, the error of every score and of P (which every result reads),
and ``DScores``, the error of dS (which dQ and dK read). Each result then has one small function
with its own terms: ``_o``, ``_lse``, ``_dv``, ``_dq``, ``_dk``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from flashcheck.oracle.rounding import HALF, Precision
from flashcheck.strategies.case import EPS

# Variance of a rounding error bounded by w: uniform on [-h, h] with h/w spread as the position of
# the value in its binade (log-uniform): E[(h/w)^2] = 3 / (8 ln 2) = 0.541, so Var = 0.541 w^2 / 3.
VAR = 3 / (8 * np.log(2)) / 3
Z = 6.0  # standard deviations: Hoeffding gives P(|error| > 6 sigma) <= 2 exp(-18) = 3e-8
FTZ = {"float32": 2.0 ** -126, "float64": 2.0 ** -1022}  # below these, GPU float32 flushes to zero
UNIT = {**{t: e / 2 for t, e in EPS.items()}, "tf32": 2.0 ** -11}
# Truncating a value x to TF32 loses ulp(x)/2 on average, between 2^-12 and 2^-11 of |x|: a mean
# of 0.75 * 2^-11 |x| shared by every term, give or take 0.25 * 2^-11 |x| per term.
TRUNC_MEAN, TRUNC_SPREAD = 0.75, 0.25


def _swap(x):
    return np.swapaxes(x, -1, -2)


def _bound(worst, var, coherent):
    # Squares of terms below 1e-154 underflow float64; for such tiny entries the worst case is kept.
    return np.where(worst > 1e-140, np.minimum(worst, Z * np.sqrt(var)), worst) + coherent


def ties(x: np.ndarray, axes: tuple) -> tuple[np.ndarray, np.ndarray]:
    """For each entry: how many entries of its slice over ``axes`` hold exactly its value, and
    whether it belongs to the slice's largest such group (of two or more; the largest value wins a tie).

    Equal values may round alike, and then their rounding errors are one error: a repeated term
    counts as often as it repeats (Cauchy-Schwarz: the square of a sum of n equal errors is at most
    n times the sum of their squares), or, for the largest group of a row, its terms are summed
    with their signs before squaring (uniform attention: one group holds the whole row).
    """
    moved = np.moveaxis(x, axes, tuple(range(-len(axes), 0)))
    flat = moved.reshape(-1, int(np.prod([x.shape[a] for a in axes])))
    order = np.argsort(flat, axis=-1, kind="stable")
    srt = np.take_along_axis(flat, order, -1)
    start = np.ones(srt.shape, bool)
    start[:, 1:] = srt[:, 1:] != srt[:, :-1]
    run = np.cumsum(start, axis=-1) - 1 + (np.arange(flat.shape[0]) * flat.shape[1])[:, None]
    size = np.bincount(run.ravel(), minlength=flat.size)[run]
    n = np.empty_like(size)
    np.put_along_axis(n, order, size, -1)
    top = n.max(-1, keepdims=True)
    val = np.where(n == top, flat, -np.inf).max(-1, keepdims=True)
    big = (n == top) & (flat == val) & (top > 1)
    back = lambda y: np.moveaxis(y.reshape(moved.shape), tuple(range(-len(axes), 0)), axes)  # noqa: E731
    return back(n.astype(np.float64)), back(big)


def _p_expm1(p, logp, x):
    """P expm1(x): how far an error x in its exponent moves P. Where P underflows, or e^x passes
    float64's range, through log P (P e^x, at most 1: a probability is never off by more), so that
    the bound stays a number and no infinity meets a zero."""
    with np.errstate(over="ignore", invalid="ignore"):
        direct = p * np.expm1(x)
        far = np.minimum(np.exp(logp + x), 1.0)
    return np.where(np.isfinite(direct) & (p > 0), direct, far)


def _trunc_mean(a_times_b, abs_a_times_abs_b, u_tr):
    """The coherent mean error of a product whose two operands are truncated to TF32."""
    return u_tr * 2 * (TRUNC_MEAN * np.abs(a_times_b) + TRUNC_SPREAD * abs_a_times_abs_b)


@dataclass(frozen=True)
class Units:
    """The unit roundoffs of the places a kernel of the declared precision rounds (0: it does not)."""

    acc: float  # the accumulator's (float32, or float64)
    p: float  # P rounded to its format for the P.V product
    inp: float  # operands rounded for the dot products (TF32)
    tr: float  # a truncated TF32 operand errs by up to a whole ulp
    t: float  # the output type's, for half types
    dp: float  # "dense": dP rounded to t
    pre: float  # "prescaled": q*scale or k*scale*log2 e rounded to t
    d: float  # "delta": D's products and D itself rounded to t
    sub: float  # P and dS lose their subnormals absolutely

    @classmethod
    def of(cls, pr: Precision) -> "Units":
        u_acc, u_t = UNIT[pr.acc], UNIT[pr.out_fmt] if pr.out_fmt in HALF else 0.0
        # fp16 keeps subnormals at a spacing of 2^-24; float32 arithmetic on a GPU flushes values
        # below 2^-126 to zero.
        return cls(acc=u_acc, p=UNIT[pr.p_fmt] if pr.p_fmt != pr.acc else 0.0,
                   inp=UNIT[pr.operand_fmt] if pr.operand_fmt != pr.acc else 0.0,
                   tr=UNIT["tf32"] if pr.truncate else 0.0, t=u_t, dp=u_t if pr.p_normalized else 0.0,
                   pre=(u_t or u_acc) if pr.prescaled else 0.0, d=u_t if pr.delta else 0.0,
                   sub=2.0 ** -25 if pr.p_fmt == "float16" else FTZ[pr.acc])

    def sum_of(self, n):
        """The float32 accumulation of n terms, relative to the sum of their magnitudes."""
        return self.acc * (2 + np.sqrt(n))


@dataclass(frozen=True)
class Scores:
    """The inputs, and the error of every score and every P_ij, which all results read."""

    vis: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    p: np.ndarray
    o: np.ndarray
    scale: float
    sc: float  # |scale|
    aq: np.ndarray  # |q|, |k|, |v|, |dO|, |O|
    ak: np.ndarray
    av: np.ndarray
    ado: np.ndarray
    ao: np.ndarray
    abs_s: np.ndarray  # |q| . |k| scale: the size of each score's dot product
    worst: np.ndarray  # a score's error, relative in P: worst case
    var: np.ndarray  # and its variance
    pre: np.ndarray  # the coherent share of pre-scaled or truncated operands
    rho: np.ndarray  # bound on P_ij's relative error (infinite where the exponent's error passes exp's range)
    p_rho: np.ndarray  # P rho: P_ij's absolute error, always a number
    rho_var: np.ndarray
    w: np.ndarray  # bound on the error of p_ij
    w2_p: np.ndarray  # the variance of P's own rounding
    w2_rest: np.ndarray  # the rest of its variance (the scores' errors, subnormals)
    n_row: np.ndarray  # ties along a row / a key's column ("dense": equal P round alike)
    n_col: np.ndarray
    big_row: np.ndarray  # the largest group of equal P in a row
    wp: np.ndarray | float  # the shared operand errors' share of w (0.0 when none)
    sub: np.ndarray | float  # subnormal spacing on the visible entries
    lse: np.ndarray  # the LSE (finite rows; 0 elsewhere), keepdims
    sink: np.ndarray | float  # the sink's share of the LSE's error (0.0 without sinks), keepdims


def _scores(case, pt, pr: Precision, u: Units) -> Scores:
    vis = case.visible_grouped()
    q, k, p, sc = pt.q, pt.k, pt.p, abs(pt.scale)
    aq, ak = np.abs(q), np.abs(k)
    d, sk = q.shape[-1], case.sk
    lse = np.where(np.isfinite(pt.lse), pt.lse, 0.0)[..., None]
    abs_s = sc * (aq @ _swap(ak))
    sq_s = sc * sc * ((q * q) @ _swap(k * k))  # sum_d (q_d k_d)^2
    m = np.where(vis, pt.s, -np.inf).max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    # A score's error, relative in P: its dot product (D roundings, each at most u |partial sum|: in
    # variance about u^2/3 (D/2 sum_d (q_d k_d)^2 + D/3 s^2), whether the terms' signs are random or
    # alike), the scale and log2(e) products, the max or LSE subtracted before exp, exp itself, and
    # for TF32 the rounding of q and k. What a feature adds to the score (ALiBi's distance term,
    # the softcap's change, a bias) rounds at its own magnitude, twice: when added and in the log2(e)
    # product of an exp2 kernel; a large ALiBi term or bias can dwarf the dot product. Each term
    # counts at its own magnitude, not at the net change: a bias that cancels ALiBi's term leaves a
    # small logit from a partial sum that rounded at the term's size (torch-tiled, fp16 on an H200:
    # LSE at 1.11x the bound when the net change was counted, a bias of 46 against ALiBi's -46.5).
    # Where P is 0 (exp underflows in float64, so in any kernel: a finfo.min bias beside finite
    # ones) no error of the score reaches a result, and none is counted (its magnitude would make
    # inf * 0 = NaN).
    added = 0.0 if pt.added is None else np.where(vis, pt.added, 0.0)
    live = vis & (p > 0)
    s_live = np.where(live, pt.s, 0.0)
    local = np.where(live, u.acc * (4 + 2 * np.abs(s_live - m) + 2 * added), 0.0)
    worst = np.where(live, u.inp * 2 * abs_s + u.acc * d * abs_s + local, 0.0)
    var = np.where(live, u.acc ** 2 / 3 * (d / 2 * sq_s + d / 3 * s_live ** 2)
                   + VAR * (local ** 2 + (u.inp * 2 * abs_s) ** 2), 0.0)
    # A pre-scaled operand's rounding is shared by a whole row (q_i) or key (k_j): it moves every
    # score it touches by up to u_t |q_i| . |k_j| scale, coherently, so it counts only worst-case.
    # So does truncation to TF32, which shrinks every product of a dot product alike.
    pre = np.where(vis, (u.pre + 2 * u.tr) * abs_s, 0.0)
    # The LSE's own error shifts every P of its row in the backward (P = exp(s - LSE)).
    # A sink is one more term of the row's sum, with a logit but no dot product: its rounding (times
    # log2 e in an exp2 kernel, then against the max) reaches the LSE in proportion to its share. Seen
    # on CPU: flex's float64 LSE at 1.08x the bound where a sink of 30 held the whole row.
    sink = _sink_error(case, pt, m, u)
    lse_own = u.sum_of(sk) + 2 * u.acc * np.abs(lse) + sink
    lse_worst = (p * (worst + pre)).sum(-1, keepdims=True) + lse_own
    lse_var = (p * p * var).sum(-1, keepdims=True) + VAR * lse_own ** 2
    # Bound on P_ij's relative error, and its variance: P and V rounded (a truncated TF32 operand
    # errs by up to an ulp), the score, the LSE. P computed from exp(s - m) or already normalized
    # rounds the same relative amount.
    # An error x in the exponent moves P by expm1(x) relative: past x ~ 0.1 no longer x (large
    # logits in bfloat16 with pre-scaled operands reach x > 1).
    x = worst + pre + lse_worst
    bent = np.expm1(x, out=x.copy(), where=x > 1e-2)  # expm1 only where it differs from x
    base = u.p + u.inp + 2 * u.tr
    rho = np.where(vis, base + bent, 0.0)
    logp = pt.s - lse  # log P where visible: finite where P itself underflows
    far = vis & (x > 1e-2)  # where expm1(x) is not x: few entries, and exp over all of them costs
    p_rho = np.where(p > 0, p * np.where(far, 0.0, rho), 0.0)  # rho is infinite only where x > 1e-2
    if far.any():
        p_rho[far] = p[far] * base + _p_expm1(p[far], logp[far], x[far])
    rho_var = np.where(vis, VAR * (u.p ** 2 + u.inp ** 2) + var + lse_var, 0.0)
    sub = np.where(vis, u.sub, 0.0)
    w = p_rho + sub
    w2 = p * p * rho_var + sub * sub / 3  # its variance (subnormals: a fixed spacing, so uniform)
    # "dense": P normalized before it is rounded. Equal probabilities (equal keys, scale 0) then carry
    # one rounding error: along a row for O, along a key's column (every row of every head of the
    # group) for dV.
    # A row's P shares one max and one sum, so equal scores give equal values; a key's column does
    # not (each row has its own LSE), so there equal truths count by Cauchy-Schwarz alone. A group
    # whose values straddle a rounding boundary rounds half up, half down: the largest group of a
    # row also keeps its terms' independent share.
    if pr.p_normalized:
        p32 = np.where(vis, p, np.nan).astype(np.float32)  # masked entries (NaN) tie with nothing
        (n_row, big_row), (n_col, _) = ties(p32, (-1,)), ties(p32, (2, 3))
    else:  # exp(s - m) of equal scores is exactly 1 at the max; below it, ties are rare and short
        n_row = n_col = np.ones_like(p)
        big_row = np.zeros(p.shape, bool)
    # Only the rounding of P's value is a function of the value; the scores' errors depend on the
    # order of each dot product's sum and stay independent.
    w2_p = p * p * VAR * u.p ** 2
    shared = bool(pre.any())  # pre-scaled or truncated operands: their coherent terms (else all zero)
    wp = np.where(vis, _p_expm1(p, logp, pre + (p * pre).sum(-1, keepdims=True)), 0.0) if shared else 0.0
    return Scores(vis=vis, q=q, k=k, v=pt.v, do=pt.do, p=p, o=pt.o, scale=pt.scale, sc=sc, aq=aq, ak=ak,
                  av=np.abs(pt.v), ado=np.abs(pt.do), ao=np.abs(pt.o), abs_s=abs_s, worst=worst, var=var,
                  pre=pre, rho=rho, p_rho=p_rho, rho_var=rho_var, w=w, w2_p=w2_p, w2_rest=w2 - w2_p, n_row=n_row, n_col=n_col,
                  big_row=big_row, wp=wp, sub=sub, lse=lse, sink=sink)


def _sink_error(case, pt, m, u: Units):
    """The sink's logit rounded at its own size and against the row's max, weighted by its share of the
    row's softmax (B, Hkv, G, Sq, 1); 0.0 without sinks."""
    if pt.psink is None or case.sinks is None:
        return 0.0
    sink = np.asarray(case.sink_logits(), np.float64).reshape(1, case.hkv, case.hq // case.hkv, 1, 1)
    with np.errstate(invalid="ignore"):  # a sink of -inf: no share, no error
        err = np.where(np.isfinite(sink), 4 + 2 * np.abs(sink) + 2 * np.abs(sink - np.maximum(m, sink)), 0.0)
    return pt.psink[..., None] * u.acc * err


def _o_terms(s: Scores, u: Units):
    """O's (worst, variance, coherent) terms; D = rowsum(dO * O) reads them too.

    O is sum_j p_ij (1 + e_ij) v_j normalized by the exact sum (error sum_j p_ij e_ij v_j), or by
    the sum of the rounded terms (error sum_j p_ij e_ij (v_j - O_i)); a kernel may do either."""
    p, v, o, av, ao, sk = s.p, s.v, s.o, s.av, s.ao, s.p.shape[-1]
    worst = s.w @ av + ao * s.w.sum(-1, keepdims=True)
    w2r = s.w2_rest + s.w2_p * np.where(s.big_row, 1, s.n_row)
    var = np.maximum(w2r @ (v * v), w2r @ (v * v) - 2 * o * (w2r @ v) + o * o * w2r.sum(-1, keepdims=True))
    if s.big_row.any():
        sd_row = np.sqrt(s.w2_p) * s.big_row  # the largest group's shared error
        sdv = sd_row @ v
        var = np.maximum(w2r @ (v * v) + sdv ** 2, var + (sdv - o * sd_row.sum(-1, keepdims=True)) ** 2)
    coh = u.sum_of(sk) * (p @ av + ao)
    if s.pre.any():
        coh = coh + s.wp @ av + ao * s.wp.sum(-1, keepdims=True)
    if u.tr:
        coh = coh + _trunc_mean(o, p @ av, u.tr)
    return worst, var, coh


def _lse(s: Scores, u: Units):
    """LSE = m + log(sum_j exp(s_j - m)) from float32 P: only the scores' errors and the sums.
    Equal scores (identical keys) carry equal errors: the LSE's are taken as fully aligned. Two
    roundings at the LSE's own size: m + log(sum), and in an exp2 kernel the product by ln 2 that
    brings it back from log2 units (seen on CPU: flex's float32 LSE of -212 at 1.03x the bound of one)."""
    p = s.p
    sink = s.sink[..., 0] if isinstance(s.sink, np.ndarray) else s.sink
    return _bound((p * s.worst).sum(-1), (p * np.sqrt(s.var)).sum(-1) ** 2,
                  u.sum_of(p.shape[-1]) + 2 * u.acc * np.abs(s.lse[..., 0]) + (p * s.pre).sum(-1) + sink)


def _dv_sums(s: Scores, u: Units) -> dict:
    """dV's terms as sums over query rows, per query head (B, Hkv, G, Sk, Dv): a chunk of rows adds its own."""
    p, ado = s.p, s.ado
    out = {"pdo": _swap(p) @ ado, "w": _swap(s.w) @ ado, "var": _swap(s.w2_rest + s.w2_p * s.n_col) @ (ado * ado)}
    if s.pre.any():
        out["wp"] = _swap(s.wp) @ ado
    if u.tr or s.q.shape[2] > 1:
        out["pdo_signed"] = _swap(p) @ s.do
    return out


def _dv(t: dict, rows: int, u: Units):
    """dV_j = sum_i P_ij dO_i over the rows of every head of the group, from _dv_sums' sums over ``rows`` rows."""
    pdo = t["pdo"].sum(2)
    coh = u.sum_of(rows) * pdo + (t["wp"].sum(2) if "wp" in t else 0.0)
    if u.tr:
        coh = coh + _trunc_mean(t["pdo_signed"].sum(2), pdo, u.tr)
    dv = _bound(t["w"].sum(2), t["var"].sum(2), coh)
    if t["pdo"].shape[2] > 1:  # GQA: FlashAttention-2 rounds each query head's dV to t, then sums the group;
        # each head's dV that lies among fp16's subnormals errs by up to half their spacing, not u |dV|
        # (SDPA flash on an H200: a key seen by one row per head, P ~ 1e-6, four heads)
        heads = (t["pdo"] > 0).sum(2)
        dv = dv + u.p * np.abs(t["pdo_signed"]).sum(2) + u.sub * heads
    return dv


@dataclass(frozen=True)
class DScores:
    """The error of dS = P (dP - D), which dQ and dK read."""

    ds: np.ndarray
    a_ds: np.ndarray
    eta: np.ndarray  # bound on dS_ij's error
    eta2: np.ndarray  # its variance
    d_worst: np.ndarray  # D's error (per row), worst case and variance
    d_var: np.ndarray
    e_row: np.ndarray  # D computed as rowsum(P * dP): that sum's error
    p_hi: np.ndarray  # the kernel's P is at most p (1 + rho)
    pk: np.ndarray  # |P K|: D's error enters dQ_i as dD_i (P K)_i
    prk: np.ndarray  # (p rho) |K|: how far the kernel's P K is from P K
    sub_sc: np.ndarray | float  # subnormals of dS or q already multiplied by the scale
    ds_pre: np.ndarray | float  # dS's share of the shared operand errors (0.0 when none)
    d_pre: np.ndarray | float  # O's coherent error, reaching D coherently


def _dscores(case, s: Scores, u: Units, dscores, o_terms, half_spacing, out_fmt) -> DScores:
    # dS = P (dP - D): P's error, dP's float32 dot product (and its rounding to t, "dense"), dS
    # rounded to t (before or after the scale: independent per entry), and D's error, shared by
    # every key of a row: D = rowsum(dO * O) reads O rounded to t.
    dp, dp_minus_d, ds = dscores
    p, ado, ao, sk, dv = s.p, s.ado, s.ao, case.sk, s.v.shape[-1]
    o_worst, o_var, _ = o_terms
    a_ds = np.abs(ds)
    # O's rounding to t, at the largest O a kernel may hold before it rounds (rule.with_output_rounding)
    o_round = half_spacing(np.abs(s.o) + o_worst, out_fmt)
    # A kernel may also compute D as rowsum(P * dP) (autograd's softmax backward): its error is then
    # that sum's, u sum_j P_ij |dP_ij|. Autograd through an online softmax also leaves the running
    # max a gradient that is zero only up to that much, and hands it to one key (the argmax).
    e_row = (u.sum_of(sk) + u.dp) * (p * np.abs(dp)).sum(-1, keepdims=True)
    d_worst = ((ado * (o_worst + o_round)).sum(-1, keepdims=True)
               + u.sum_of(dv) * (ado * ao).sum(-1, keepdims=True) + e_row)
    d_var = (ado * ado * (o_var + o_round * o_round * VAR)).sum(-1, keepdims=True)
    if u.d:  # "delta": each product dO O rounded to t, then D itself (|D| <= sum |dO| |O|)
        d_abs = (ado * ao).sum(-1, keepdims=True)
        d_worst = d_worst + 2 * u.d * d_abs
        d_var = d_var + VAR * u.d * u.d * (((ado * ao) ** 2).sum(-1, keepdims=True)
                                           + (s.do * s.o).sum(-1, keepdims=True) ** 2)
    dp_mag = ado @ _swap(s.av)
    # Where rho is large (pre-scaled operands at large logits) the errors that P multiplies grow with it.
    p_hi = p + np.where(s.rho > 1e-2, s.p_rho, 0.0)  # (below 1%: second order, left out as before)
    dp_err = p_hi * (u.sum_of(dv) * dp_mag + u.dp * np.abs(dp))
    if u.tr:
        dp_err = dp_err + p_hi * _trunc_mean(dp, dp_mag, u.tr)
    sub_ds = s.sub * (1 + np.abs(dp_minus_d))  # P's and dS's own subnormals
    # A softcap multiplies dS by 1 - tanh^2(s / c): the raw logit's error, divided by c, moves it
    # by up to twice that relative to itself (a small c magnifies float rounding a thousandfold).
    if case.softcap:
        raw = (2 * u.inp + (s.q.shape[-1] + 2) * u.acc) * s.abs_s
        g = 1 - np.tanh(s.scale * (s.q @ _swap(s.k)) / case.softcap) ** 2  # dS's factor; its error scales with it
        rel_g = np.where(s.vis, 2 * g * raw / case.softcap + 4 * u.acc, 0.0)
    else:
        rel_g = 0.0
    eta = np.abs(dp_minus_d) * s.p_rho + p_hi * np.abs(dp_minus_d) * (u.p + u.tr + rel_g) + dp_err + sub_ds
    eta2 = ds * ds * (VAR * (u.p ** 2 + rel_g * rel_g)) + VAR * dp_err ** 2 + sub_ds * sub_ds / 3
    eta2 = eta2 + ds * ds * s.rho_var  # the backward's P is float32: no rounding of P's value here
    # A kernel may round dS, or q, already multiplied by the scale: their subnormals then cost
    # 2^-25 of the gradient itself, not of dS or q (cuDNN, FlashAttention-2 and FlexAttention on
    # an H200 at scale 1e-6, whose gradients are fp16 subnormals).
    sub_sc = s.sub / s.sc if s.sc > 0 else s.sub
    if s.pre.any():
        # dS's share of the shared operand errors; and O's coherent error reaches D coherently.
        ds_pre = np.abs(dp_minus_d) * (s.wp + u.pre * p_hi)  # |dP - D| P expm1(the shared error), and dS's own
        d_pre = (ado * (s.wp @ s.av + ao * s.wp.sum(-1, keepdims=True))).sum(-1, keepdims=True)
    else:
        ds_pre = d_pre = 0.0
    return DScores(ds=ds, a_ds=a_ds, eta=eta, eta2=eta2, d_worst=d_worst, d_var=d_var, e_row=e_row,
                   p_hi=p_hi, pk=np.abs(p @ s.k), prk=s.p_rho @ s.ak, sub_sc=sub_sc, ds_pre=ds_pre,
                   d_pre=d_pre)


def _dq(s: Scores, g: DScores, u: Units):
    """dQ_i = scale sum_j dS_ij k_j, and D's error through the kernel's P K."""
    ak, sk = s.ak, s.p.shape[-1]
    coh = u.sum_of(sk) * (g.a_ds @ ak) + g.e_row * ak.max(-2, keepdims=True, initial=0) + g.d_worst * g.prk
    if s.pre.any():  # the pre-scaled operand is also a factor of dQ (K'): its rounding counts once more
        coh = coh + g.ds_pre @ ak + g.d_pre * (g.pk + g.prk)
    if u.tr:
        coh = coh + _trunc_mean(g.ds @ s.k, g.a_ds @ ak, u.tr)
    return s.sc * _bound(g.eta @ ak + g.d_worst * g.pk + g.sub_sc @ ak,
                         g.eta2 @ (ak * ak) + g.d_var * g.pk * g.pk + g.sub_sc * g.sub_sc / 3 @ (ak * ak), coh)


def _dk_sums(s: Scores, g: DScores, u: Units) -> dict:
    """dK's terms as sums over query rows, per query head (B, Hkv, G, Sk, D): a chunk of rows adds its own."""
    aq = s.aq
    ones = np.ones_like(aq)
    out = {"ads": _swap(g.a_ds) @ aq,
           "at_max": _swap(g.e_row * np.where(s.vis, 1.0, 0.0)) @ aq,  # the max's residue, on whichever visible key is the argmax
           "w": _swap(g.eta + g.p_hi * g.d_worst + g.sub_sc) @ aq + _swap(g.a_ds * g.sub_sc) @ ones,
           "var": (_swap(g.eta2 + s.p * s.p * g.d_var + g.sub_sc * g.sub_sc / 3) @ (aq * aq)
                   + _swap(g.ds * g.ds * g.sub_sc * g.sub_sc / 3) @ ones)}
    if s.pre.any():  # the pre-scaled operand is also a factor of dK (Q'): its rounding counts once more
        out["pre"] = _swap(g.ds_pre + g.p_hi * g.d_pre) @ aq
    if u.tr or s.q.shape[2] > 1:
        out["dsq"] = _swap(g.ds) @ s.q
    return out


def _dk(t: dict, rows: int, sc: float, u: Units):
    """dK_j = scale sum_i dS_ij q_i over the rows of every head of the group, from _dk_sums' sums."""
    ads = t["ads"].sum(2)
    coh = u.sum_of(rows) * ads + t["at_max"].sum(2) + (t["pre"].sum(2) if "pre" in t else 0.0)
    if u.tr:
        coh = coh + _trunc_mean(t["dsq"].sum(2), ads, u.tr)
    dk = sc * _bound(t["w"].sum(2), t["var"].sum(2), coh)
    if t["ads"].shape[2] > 1:  # GQA: FlashAttention-2 rounds each query head's dK to t, then sums the group
        heads = (t["ads"] > 0).sum(2)  # (as in _dv: fp16 subnormals err absolutely)
        dk = dk + u.p * sc * np.abs(t["dsq"]).sum(2) + u.sub * heads
    return dk


class Terms(Mapping):
    """The rounding terms by result name. O's and LSE's are computed at once; the gradients' (dS and
    its error, the larger share of the work) on the first asking, so a forward property pays for none
    of them. The scores' errors they start from (about fourteen arrays of B x H x Sq x Sk) are kept
    for the latest Terms alone, the case a property is judging now; an earlier one recomputes them."""

    _latest = None

    def __init__(self, forward: dict, backward, scores):
        self._terms, self._backward, self._scores = dict(forward), backward, scores
        if Terms._latest is not None:
            Terms._latest._scores = None
        Terms._latest = self

    def __getitem__(self, name):
        if name not in self._terms and self._backward is not None:
            self._terms.update(self._backward(self._scores))
            self._backward = self._scores = None
        return self._terms[name]

    def __iter__(self):
        return iter(("o", "lse", "dv", "dq", "dk"))

    def __len__(self):
        return 5


# Entries of B x Hq x rows x Sk per chunk of query rows (each of the dozens of arrays a chunk's terms
# make is then 2 MB). On 2048 x 2048 logits, the whole problem at once made each a 64 MB temporary,
# page-faulted in and streamed through memory: 2.3x the time of chunks of 2^20 on a 2-core machine.
# Smaller chunks stay in cache: 420 cases captured from a gpu-profile run (the terms of O to dV, from
# the cached float64 parts) took 19.5, 16.5, 17.6 and 20.8 s at 2^20, 2^18, 2^17 and 2^16 entries on
# one thread, 16.3, 11.2, 12.1 and 15.5 s on two (_map), the terms equal to 5e-15 relative.
CHUNK = 2 ** 18


class RowView:
    """The case as the terms read it, holding only some of its query rows (``vis``: their visibility)."""

    def __init__(self, case, vis: np.ndarray):
        self._case, self._vis, self.sq = case, vis, vis.shape[-2]

    def __getattr__(self, name):
        return getattr(self._case, name)

    def visible_grouped(self):
        return self._vis


SPLIT = 2 ** 18  # entries from which a problem is cut in two at least, so that two threads share it
_POOL: list = []  # the thread pool and the BLAS controller, made on the first threaded call


def threads() -> int:
    """Threads for the terms: the BLAS thread count given to this process (the plugin sets it per
    xdist worker, devices.share_cores), else its cores."""
    for env in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        n = os.environ.get(env, "")
        if n.isdigit() and int(n) > 0:
            return int(n)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def quiet():
    """numpy's error state for the terms: overflow is honest here (squares of heavy-tailed float32 terms
    make an infinite variance), and an infinite term then meets BLAS, whose floating-point flags do
    not say what came out: OpenBLAS's AVX-512 kernels raise the invalid flag for an infinite operand
    where no NaN results (an H100 host, `eta2 @ (ak * ak)` at D = 5: one infinite entry, no zero in
    ak, the product NaN-free; reproduced on CPU with OPENBLAS_CORETYPE=SkylakeX: tests/test_oracle_flags.py).
    So the terms ignore the flags and check their values (rounding_bounds: a NaN bound is the suite's
    bug, raised as one)."""
    return np.errstate(over="ignore", invalid="ignore")


def _map(fn, items):
    """[fn(x) for x in items], in threads where there are several chunks and cores. numpy's
    element-wise work and BLAS release the GIL, and a chunk's terms never read another's; BLAS runs
    one thread per chunk meanwhile (OpenBLAS called from two threads, each with threads of its own,
    ran the terms 1.1x slower than one thread did; with one BLAS thread each, 1.44x faster on two
    cores: 251 cases captured from a gpu-profile run, docs/gpu-lane.md). Sums over chunks are added
    by the caller in order, so the terms do not depend on the thread count."""
    items = list(items)
    if len(items) < 2 or threads() < 2:
        return [fn(x) for x in items]
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # an optional speed-up: without it, one chunk at a time
        return [fn(x) for x in items]
    if not _POOL:
        _POOL.extend((ThreadPoolExecutor(threads(), thread_name_prefix="flashcheck-terms"), ThreadpoolController()))
    pool, blas = _POOL
    err = np.geterr()  # numpy's error state is per thread: the caller's (what it ignores) holds in each

    def run(x):
        with np.errstate(**err):
            return fn(x)

    with blas.limit(limits=1, user_api="blas"):
        return list(pool.map(run, items))


def _row_chunks(case, pt, pr: Precision):
    """Slices of query rows to evaluate one at a time: every term but dV's and dK's is a function of
    one row (its scores, its P, its LSE, its D; sampled.py relies on the same), and theirs are sums
    over rows, which add up chunk by chunk. With P normalized first, equal P along a key's column round
    alike (``ties`` over every row), so that precision takes the whole problem at once."""
    b, hkv, g, sq, sk = pt.p.shape
    rows = max(1, CHUNK // max(1, b * hkv * g * sk))
    if b * hkv * g * sq * sk >= SPLIT:  # at least two chunks, for the threads (_map)
        rows = min(rows, -(-sq // 2))
    if pr.p_normalized or rows >= sq:
        return [slice(0, sq)]
    return [slice(r, min(sq, r + rows)) for r in range(0, sq, rows)]


def _rows_of(case, pt, dscores, cut: slice, vis: np.ndarray):
    """(case, parts, dscores) cut to the query rows ``cut`` (parts in the grouped layout (B, Hkv, G, Sq, .));
    ``vis``: the whole case's visible_grouped(), computed once for all its chunks."""
    if cut == slice(0, pt.p.shape[-2]):
        return case, pt, dscores
    row = (Ellipsis, cut, slice(None))
    part = replace(pt, q=pt.q[row], do=pt.do[row], s=pt.s[row], p=pt.p[row], o=pt.o[row], lse=pt.lse[..., cut],
                   psink=None if pt.psink is None else pt.psink[..., cut],
                   added=None if pt.added is None else pt.added[row])
    return RowView(case, vis[row]), part, tuple(x[row] for x in dscores)


def rounding_bounds(case, pt, dscores, half_spacing) -> Terms:
    """The rounding terms of the rule, per entry, for every result (shapes as the results');
    ``dscores``: (dP, dP - D, dS), or a function giving them (asked only for the gradients' terms).
    Large problems are evaluated in chunks of query rows (_row_chunks); the terms are the same."""
    pr = Precision.of(case.dtype, case.precision)
    u = Units.of(pr)
    shape = {"o": (case.batch, case.hq, case.sq, case.dv), "lse": (case.batch, case.hq, case.sq),
             "dq": (case.batch, case.hq, case.sq, case.d)}
    chunks = _row_chunks(case, pt, pr)
    vis = case.visible_grouped() if len(chunks) > 1 else None
    rows = pt.p.shape[2] * pt.p.shape[3]  # every query row of a key/value head's group

    def done(out):
        for n, b in out.items():
            if np.isnan(b).any():  # never a verdict on the kernel: an entry under a NaN bound always fails
                raise FloatingPointError(f"flashcheck's rounding bound of {n} is NaN at "
                                         f"{tuple(int(i) for i in np.argwhere(np.isnan(b))[0])} for {case!r}: "
                                         "a bug in the suite")
        return {n: b.reshape(shape[n]) + FTZ[pr.acc] if n in shape else b + FTZ[pr.acc] for n, b in out.items()}

    def forward(c, part):
        s = _scores(c, part, pr, u)
        return s, _o_terms(s, u)

    def backward(kept):
        with quiet():  # as around the forward terms
            ds_all = dscores() if callable(dscores) else dscores

            def backward_chunk(i):
                c, part, ds = _rows_of(case, pt, ds_all, chunks[i], vis)
                s, o_terms = kept[i] if kept else forward(c, part)
                g = _dscores(c, s, u, ds, o_terms, half_spacing, pr.out_fmt)
                return _dq(s, g, u), _dv_sums(s, u), _dk_sums(s, g, u)

            dq, dv_sums, dk_sums = [], {}, {}
            for dq_i, dv_i, dk_i in _map(backward_chunk, range(len(chunks))):  # summed in chunk order
                dq.append(dq_i)
                for total, new in ((dv_sums, dv_i), (dk_sums, dk_i)):
                    for name, x in new.items():
                        total[name] = total[name] + x if name in total else x
            return done({"dv": _dv(dv_sums, rows, u), "dq": np.concatenate(dq, axis=-2),
                         "dk": _dk(dk_sums, rows, abs(pt.scale), u)})

    def forward_chunk(cut):
        c, part, _ = _rows_of(case, pt, (), cut, vis)
        s, o_terms = forward(c, part)
        return _bound(*o_terms), _lse(s, u), (s, o_terms)

    with quiet():
        o, lse, kept = zip(*_map(forward_chunk, chunks))  # kept: the gradients' terms start from these
    return Terms(done({"o": np.concatenate(o, axis=-2), "lse": np.concatenate(lse, axis=-1)}), backward, kept)
