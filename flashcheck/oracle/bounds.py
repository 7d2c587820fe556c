"""The rounding terms of the oracle's rule, per entry of every result (flashcheck/oracle/rule.py's doc).

``rounding_bounds`` reads the dense float64 intermediates of a case (the oracle's ``_Parts``) and
returns, for O, LSE, dQ, dK and dV, how far a correct kernel of the declared precision may land
from the truth through rounding. Every place where correct kernels round (flashcheck/oracle/rounding.py's
catalogue) has its term here; the comments name the site.
"""
from __future__ import annotations

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


def _trunc_mean(a_times_b, abs_a_times_abs_b, u_tr):
    """The coherent mean error of a product whose two operands are truncated to TF32."""
    return u_tr * 2 * (TRUNC_MEAN * np.abs(a_times_b) + TRUNC_SPREAD * abs_a_times_abs_b)


def rounding_bounds(case, pt, dscores, half_spacing) -> dict:
    """The rounding terms of the rule, per entry, for every result (shapes as the results')."""
    pr = Precision.of(case.dtype, case.precision)
    u_acc = UNIT[pr.acc]
    u_p = UNIT[pr.p_fmt] if pr.p_fmt != pr.acc else 0.0
    u_in = UNIT[pr.operand_fmt] if pr.operand_fmt != pr.acc else 0.0
    u_tr = UNIT["tf32"] if pr.truncate else 0.0  # a truncated TF32 operand errs by up to a whole ulp
    u_t = UNIT[pr.out_fmt] if pr.out_fmt in HALF else 0.0
    u_dp = u_t if pr.p_normalized else 0.0  # "dense": dP rounded to t
    u_pre = (u_t or u_acc) if pr.prescaled else 0.0  # "prescaled": q*scale or k*scale*log2 e rounded to t
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
    # A pre-scaled operand's rounding is shared by a whole row (q_i) or key (k_j): it moves every
    # score it touches by up to u_t |q_i| . |k_j| scale, coherently, so it counts only worst-case.
    # So does truncation to TF32, which shrinks every product of a dot product alike.
    pre = np.where(vis, (u_pre + 2 * u_tr) * abs_s, 0.0)
    # The LSE's own error shifts every P of its row in the backward (P = exp(s - LSE)).
    lse_own = acc(sk) + 2 * u_acc * np.abs(lse)
    lse_worst = (p * (score_worst + pre)).sum(-1, keepdims=True) + lse_own
    lse_var = (p * p * score_var).sum(-1, keepdims=True) + VAR * lse_own ** 2
    # Bound on P_ij's relative error, and its variance: P and V rounded (a truncated TF32 operand
    # errs by up to an ulp), the score, the LSE. P computed from exp(s - m) or already normalized
    # rounds the same relative amount.
    # An error x in the exponent moves P by expm1(x) relative: past x ~ 0.1 no longer x (large
    # logits in bfloat16 with pre-scaled operands reach x > 1).
    x = score_worst + pre + lse_worst
    rho = np.where(vis, u_p + u_in + 2 * u_tr + np.where(x > 1e-2, np.expm1(x), x), 0.0)
    rho_var = np.where(vis, VAR * (u_p ** 2 + u_in ** 2) + score_var + lse_var, 0.0)
    sub = np.where(vis, sub, 0.0)
    w = p * rho + sub  # bound on the error of p_ij
    w2 = p * p * rho_var + sub * sub / 3  # its variance (subnormals: a fixed spacing, so uniform)
    # "dense": P normalized before it is rounded. Equal probabilities (equal keys, scale 0) then carry
    # one rounding error: along a row for O, along a key's column (every row of every head of the
    # group) for dV.
    p32 = np.where(vis, p, np.nan).astype(np.float32)  # masked entries (NaN) tie with nothing
    # A row's P shares one max and one sum, so equal scores give equal values; a key's column does
    # not (each row has its own LSE), so there equal truths count by Cauchy-Schwarz alone. A group
    # whose values straddle a rounding boundary rounds half up, half down: the largest group of a
    # row also keeps its terms' independent share.
    if pr.p_normalized:
        (n_row, big_row), (n_col, _) = ties(p32, (-1,)), ties(p32, (2, 3))
    else:  # exp(s - m) of equal scores is exactly 1 at the max; below it, ties are rare and short
        n_row = n_col = np.ones_like(p)
        big_row = np.zeros(p.shape, bool)
    # Only the rounding of P's value is a function of the value; the scores' errors depend on the
    # order of each dot product's sum and stay independent.
    w2_p = p * p * VAR * u_p ** 2
    w2_rest = w2 - w2_p
    sd_row = np.sqrt(w2_p) * big_row  # the largest group's shared error
    shared = bool(pre.any())  # pre-scaled or truncated operands: their coherent terms (else all zero)
    wp = p * np.expm1(pre + (p * pre).sum(-1, keepdims=True)) if shared else 0.0  # their share of w
    out = {}
    # O: sum_j p_ij (1 + e_ij) v_j normalized by the exact sum (error sum_j p_ij e_ij v_j), or by
    # the sum of the rounded terms (error sum_j p_ij e_ij (v_j - O_i)); a kernel may do either.
    o_worst = w @ av + ao * w.sum(-1, keepdims=True)
    w2r = w2_rest + w2_p * np.where(big_row, 1, n_row)
    o_var = np.maximum(w2r @ (v * v), w2r @ (v * v) - 2 * o * (w2r @ v) + o * o * w2r.sum(-1, keepdims=True))
    if big_row.any():
        sdv = sd_row @ v
        o_var = np.maximum(w2r @ (v * v) + sdv ** 2, o_var + (sdv - o * sd_row.sum(-1, keepdims=True)) ** 2)
    o_coh = acc(sk) * (p @ av + ao)
    if shared:
        o_coh = o_coh + wp @ av + ao * wp.sum(-1, keepdims=True)
    if u_tr:
        o_coh = o_coh + _trunc_mean(o, p @ av, u_tr)
    out["o"] = _bound(o_worst, o_var, o_coh)
    # LSE = m + log(sum_j exp(s_j - m)) from float32 P: only the scores' errors and the sums.
    # Equal scores (identical keys) carry equal errors: the LSE's are taken as fully aligned.
    out["lse"] = _bound((p * score_worst).sum(-1), (p * np.sqrt(score_var)).sum(-1) ** 2,
                        acc(sk) + u_acc * np.abs(lse[..., 0]) + (p * pre).sum(-1))
    # dV_j = sum_i P_ij dO_i over the rows of every head of the group.
    pdo = _swap(p) @ ado
    dv_coh = acc(rows) * pdo.sum(2) + ((_swap(wp) @ ado).sum(2) if shared else 0.0)
    if u_tr:
        dv_coh = dv_coh + _trunc_mean((_swap(p) @ do).sum(2), pdo.sum(2), u_tr)
    out["dv"] = _bound((_swap(w) @ ado).sum(2), (_swap(w2_rest + w2_p * n_col) @ (ado * ado)).sum(2), dv_coh)
    # dS = P (dP - D): P's error, dP's float32 dot product (and its rounding to t, "dense"), dS
    # rounded to t (before or after the scale: independent per entry), and D's error, shared by
    # every key of a row: D = rowsum(dO * O) reads O rounded to t.
    dp, dp_minus_d, ds = dscores
    a_ds = np.abs(ds)
    o_round = half_spacing(o, pr.out_fmt)
    # A kernel may also compute D as rowsum(P * dP) (autograd's softmax backward): its error is then
    # that sum's, u sum_j P_ij |dP_ij|. Autograd through an online softmax also leaves the running
    # max a gradient that is zero only up to that much, and hands it to one key (the argmax).
    e_row = (acc(sk) + u_dp) * (p * np.abs(dp)).sum(-1, keepdims=True)
    d_worst = ((ado * (o_worst + o_round)).sum(-1, keepdims=True) + acc(dv) * (ado * ao).sum(-1, keepdims=True)
               + e_row)
    at_max = e_row * np.where(vis, 1.0, 0.0)  # the max's residue, on whichever visible key is the argmax
    d_var = (ado * ado * (o_var + o_round * o_round * VAR)).sum(-1, keepdims=True)
    dp_mag = ado @ _swap(av)
    # The kernel's P is at most p (1 + rho): where rho is large (pre-scaled operands at large logits)
    # the errors that P multiplies grow with it.
    p_hi = p * (1 + np.where(rho > 1e-2, rho, 0.0))  # (below 1%: second order, left out as before)
    dp_err = p_hi * (acc(dv) * dp_mag + u_dp * np.abs(dp))
    if u_tr:
        dp_err = dp_err + p_hi * _trunc_mean(dp, dp_mag, u_tr)
    sub_ds = sub * (1 + np.abs(dp_minus_d))  # P's and dS's own subnormals
    # A softcap multiplies dS by 1 - tanh^2(s / c): the raw logit's error, divided by c, moves it
    # by up to twice that relative to itself (a small c magnifies float rounding a thousandfold).
    if case.softcap:
        raw = (2 * u_in + (d + 2) * u_acc) * abs_s
        g = 1 - np.tanh(pt.scale * (q @ _swap(k)) / case.softcap) ** 2  # dS's factor; its error scales with it
        rel_g = np.where(vis, 2 * g * raw / case.softcap + 4 * u_acc, 0.0)
    else:
        rel_g = 0.0
    eta = a_ds * rho + p_hi * np.abs(dp_minus_d) * (u_p + u_tr + rel_g) + dp_err + sub_ds
    eta2 = ds * ds * (VAR * (u_p ** 2 + rel_g * rel_g)) + VAR * dp_err ** 2 + sub_ds * sub_ds / 3
    eta2 = eta2 + ds * ds * rho_var  # the backward's P is float32: no rounding of P's value here
    pk = np.abs(p @ k)  # D's error enters dQ_i as dD_i (P K)_i: cancellation in P K counts
    # A kernel may round dS, or q, already multiplied by the scale: their subnormals then cost
    # 2^-25 of the gradient itself, not of dS or q (cuDNN, FlashAttention-2 and FlexAttention on
    # an H200 at scale 1e-6, whose gradients are fp16 subnormals).
    sub_sc = sub / sc if sc > 0 else sub
    ones = np.ones_like(aq)
    q_sub = (_swap(a_ds * sub_sc) @ ones).sum(2), (_swap(ds * ds * sub_sc * sub_sc / 3) @ ones).sum(2)
    # D's error enters dQ through the kernel's P K, which differs from P K by up to (p rho) |K|.
    prk = (p * rho) @ ak
    dq_coh = acc(sk) * (a_ds @ ak) + e_row * ak.max(-2, keepdims=True, initial=0) + d_worst * prk
    dk_coh = acc(rows) * (_swap(a_ds) @ aq).sum(2) + (_swap(at_max) @ aq).sum(2)
    if shared:
        # dS's share of the shared operand errors; the pre-scaled operand is also a factor of dQ (K')
        # or dK (Q'), so its rounding counts once more; and O's coherent error reaches D coherently.
        ds_pre = a_ds * np.expm1(pre + (p * pre).sum(-1, keepdims=True)) + u_pre * p_hi * np.abs(dp_minus_d)
        d_pre = (ado * (wp @ av + ao * wp.sum(-1, keepdims=True))).sum(-1, keepdims=True)
        dq_coh = dq_coh + ds_pre @ ak + d_pre * (pk + prk)
        dk_coh = dk_coh + (_swap(ds_pre + p_hi * d_pre) @ aq).sum(2)
    if u_tr:
        dq_coh = dq_coh + _trunc_mean(ds @ k, a_ds @ ak, u_tr)
        dk_coh = dk_coh + _trunc_mean((_swap(ds) @ q).sum(2), (_swap(a_ds) @ aq).sum(2), u_tr)
    out["dq"] = sc * _bound(eta @ ak + d_worst * pk + sub_sc @ ak,
                            eta2 @ (ak * ak) + d_var * pk * pk + sub_sc * sub_sc / 3 @ (ak * ak), dq_coh)
    pd, pd2 = p_hi * d_worst, p * p * d_var
    out["dk"] = sc * _bound((_swap(eta + pd + sub_sc) @ aq).sum(2) + q_sub[0],
                            (_swap(eta2 + pd2 + sub_sc * sub_sc / 3) @ (aq * aq)).sum(2) + q_sub[1], dk_coh)
    if q.shape[2] > 1:  # GQA: FlashAttention-2 rounds each query head's dK and dV to t, then sums the group
        out["dk"] = out["dk"] + u_p * sc * np.abs(_swap(ds) @ q).sum(2)
        out["dv"] = out["dv"] + u_p * np.abs(_swap(p) @ do).sum(2)
    shape = {"o": (case.batch, case.hq, case.sq, case.dv), "lse": (case.batch, case.hq, case.sq),
             "dq": (case.batch, case.hq, case.sq, case.d)}
    return {n: b.reshape(shape[n]) + FTZ[pr.acc] if n in shape else b + FTZ[pr.acc] for n, b in out.items()}
