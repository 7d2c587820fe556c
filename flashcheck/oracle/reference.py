"""The dense float64 truth: softmax attention with its analytic backward, in NumPy.

Arrays are (B, H, S, D). The work is vectorized over batch and heads by viewing q as
(B, Hkv, G, Sq, D) against k, v as (B, Hkv, 1, Sk, D): each key/value head serves its
G = Hq // Hkv query heads by broadcasting, and gradients sum over G for free.
"""
from __future__ import annotations

import math

import numpy as np

from flashcheck.contract.checks import alignment, check_features, check_inputs
from flashcheck.strategies.case import visible

DTYPES = ("float32", "float64")


def _logits(q, k, causal, scale, window, softcap, alibi_slopes, attn_mask=None, attn_bias=None, rows=None):
    """(s, visible, dcap, added): s (B, Hq, Sq, Sk) in q's dtype with -inf where hidden,
    dcap = d(softcapped logit)/d(scaled logit) (None without a softcap), and ``added`` the sum of the
    magnitudes of what the features add to the scaled logit (the softcap's change, ALiBi's term, the
    bias; None without them). A kernel rounds each partial sum at its own magnitude, which a bias that
    cancels ALiBi's term leaves far above the final logit's.

    ``rows`` = (indices, Sq): q, attn_mask and attn_bias hold only those query rows of a problem of
    Sq queries (the sampled oracle, oracle/sampled.py); the masks and distances are theirs."""
    dt = q.dtype
    b, hq, _, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    index, sq = (np.arange(q.shape[2]), q.shape[2]) if rows is None else rows
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qg = q.reshape(b, hkv, hq // hkv, len(index), d)
    s = (dt.type(scale) * (qg @ np.swapaxes(k.astype(dt)[:, :, None], -1, -2))).reshape(b, hq, len(index), sk)
    dcap = added = None
    if softcap:
        c = dt.type(softcap)
        t = np.tanh(s / c)
        added = np.abs(c * t - s)
        s, dcap = c * t, 1 - t * t  # d/dx c tanh(x / c) = 1 - tanh^2
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes).astype(dt)
        slopes = slopes.reshape((1,) * (2 - slopes.ndim) + slopes.shape + (1, 1))  # (B or 1, Hq, 1, 1)
        dist = np.abs(index[:, None] + sk - sq - np.arange(sk)[None, :]).astype(dt)
        s = s - slopes * dist
        added = np.abs(slopes * dist) + (0 if added is None else added)
    if attn_bias is not None:  # after the softcap and ALiBi; its -inf entries hide their keys
        bias = np.asarray(attn_bias, dt)
        bias = np.where(bias > -np.inf, bias, 0)
        s = s + bias
        added = np.abs(bias) + (0 if added is None else added)
    vis = visible(sq, sk, alignment(causal), rows=index, window=window)
    if attn_bias is not None:
        vis = vis & (np.asarray(attn_bias) > -np.inf)
    if attn_mask is not None:
        vis = vis & np.asarray(attn_mask, bool)  # broadcast from (B or 1, Hq or 1, Sq, Sk)
    if added is not None:
        added = np.broadcast_to(added, s.shape)
    return np.where(vis, s, dt.type(-np.inf)), vis, dcap, added


def prepare(q, k, v, causal, scale, who):
    b, hq, hkv, sq, sk, d, dv = check_inputs(q, k, v, dtypes=DTYPES, who=who)
    align = alignment(causal)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    g = hq // hkv
    return (q.reshape(b, hkv, g, sq, d), k[:, :, None], v[:, :, None],
            align, scale, (b, hq, sq, sk, dv))


def _check_features(q, window, softcap, alibi_slopes, sinks, dropout_p, dropout_mask, who, attn_mask=None,
                    attn_bias=None, sk=None):
    check_features(q, who=who, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                   dropout_p=dropout_p, tables=("float32", "float64"), attn_mask=attn_mask, attn_bias=attn_bias,
                   sk=sk)
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError(f"{who}: dense attention with dropout needs the keep mask (dropout_mask=)")


def dense_probs(q, k, v, causal=False, scale=None, who="numpy-dense", *, window=None, softcap=0.0,
                alibi_slopes=None, sinks=None, attn_mask=None, attn_bias=None, rows=None):
    """Softmax probabilities in float64, in the grouped layout (B, Hkv, G, Sq, Sk).

    Returns (p, lse, (qg, kg, vg, scale, shape), extra) with extra = {"psink": the sink's
    share of each row's softmax (B, Hkv, G, Sq) or None, "dcap": the softcap's derivative
    or None, "s": the logits, "added": what the features add, in magnitude (_logits), or None}.
    A sink joins every row's denominator and is part of the LSE.
    """
    qg, kg, vg, align, scale, (b, hq, sq, sk, dv) = prepare(q, k, v, causal, scale, who)
    f64 = np.float64
    s, _, dcap, added = _logits(q.astype(f64), k.astype(f64), causal, scale, window, softcap, alibi_slopes,
                                attn_mask, attn_bias, rows)
    grouped = (b, kg.shape[1], hq // kg.shape[1], sq)
    s = s.reshape(grouped + (sk,))
    m = s.max(axis=-1, keepdims=True)
    sink = None if sinks is None else np.asarray(sinks, f64).reshape(grouped[1:3] + (1, 1))
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)  # a row that sees nothing keeps exp(-inf) = 0
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    esink = None if sink is None else np.exp(sink - m)
    if esink is not None:
        total = total + esink
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    psink = None if esink is None else np.divide(esink, total, out=np.zeros_like(total), where=total > 0)[..., 0]
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]
    extra = {"psink": psink, "dcap": None if dcap is None else dcap.reshape(s.shape), "s": s,
             "added": None if added is None else added.reshape(s.shape)}
    return p, lse, (qg, kg, vg, scale, (b, hq, sq, sk, dv)), extra


def _keep_weights(p, dropout_p, dropout_mask, shape):
    """P times the dropout keep mask over (1 - p): what multiplies V."""
    if not dropout_p:
        return p
    keep = np.asarray(dropout_mask, bool).reshape(shape)
    return p * keep / (1.0 - dropout_p)


def dense_forward(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None,
                  dropout_p=0.0, dropout_mask=None, attn_mask=None, attn_bias=None, probs=None):
    """Dense attention computed in float64; returns (O, LSE) in the input dtype.

    With dropout, ``dropout_mask`` (bool, (B, Hq, Sq, Sk), True = kept) says which
    probabilities survive; they are scaled by 1 / (1 - dropout_p). The LSE ignores dropout.
    ``probs``: dense_probs' result on the same inputs, where the caller has it (the oracle).
    """
    _check_features(q, window, softcap, alibi_slopes, sinks, dropout_p, dropout_mask, "numpy-dense", attn_mask, attn_bias,
                    np.shape(k)[2])
    p, lse, (_, _, vg, _, (b, hq, sq, _, dv)), _ = probs or dense_probs(
        q, k, v, causal, scale, "numpy-dense", window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, attn_mask=attn_mask, attn_bias=attn_bias)
    o = _keep_weights(p, dropout_p, dropout_mask, p.shape) @ vg.astype(np.float64)
    return o.reshape(b, hq, sq, dv).astype(q.dtype), lse.reshape(b, hq, sq).astype(q.dtype)


def dense_backward(q, k, v, o, lse, do, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None,
                   sinks=None, dropout_p=0.0, dropout_mask=None, attn_mask=None, attn_bias=None, probs=None):
    """Analytic gradients of sum(O * dO) in float64: dS = P * (dP - rowsum(dO * O)).

    The softcap multiplies dS by 1 - tanh^2 before the scale; dropout multiplies dP by
    the keep mask over (1 - p). With sinks it returns (dq, dk, dv, dsinks), where
    dsinks_h = -sum over batch and rows of P_sink * rowsum(dO * O): the sink only
    takes probability away from the keys.
    """
    _check_features(q, window, softcap, alibi_slopes, sinks, dropout_p, dropout_mask, "numpy-dense", attn_mask, attn_bias,
                    np.shape(k)[2])
    p, _, (qg, kg, vg, scale, (b, hq, sq, sk, dv)), extra = probs or dense_probs(
        q, k, v, causal, scale, "numpy-dense", window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, attn_mask=attn_mask, attn_bias=attn_bias)
    f64 = np.float64
    w = _keep_weights(np.ones_like(p), dropout_p, dropout_mask, p.shape)  # keep / (1 - p), or 1
    dog = do.astype(f64).reshape(qg.shape[:-1] + (dv,))
    og = (p * w) @ vg.astype(f64)
    dvg = (np.swapaxes(p * w, -1, -2) @ dog).sum(axis=2)
    dp = (dog @ np.swapaxes(vg.astype(f64), -1, -2)) * w
    delta = (dog * og).sum(axis=-1)
    ds = p * (dp - delta[..., None])
    ds_bias = ds
    if extra["dcap"] is not None:
        ds = ds * extra["dcap"]
    dq = scale * (ds @ kg.astype(f64))
    dk = scale * (np.swapaxes(ds, -1, -2) @ qg.astype(f64)).sum(axis=2)
    grads = (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dvg.astype(v.dtype))
    if sinks is not None:
        dsinks = -(extra["psink"] * delta).sum(axis=(0, 3)).reshape(hq)
        grads = grads + (dsinks.astype(np.asarray(sinks).dtype),)
    if attn_bias is not None:  # the bias is added after the softcap: dS before its derivative
        grads = grads + (_sum_to(ds_bias.reshape(b, hq, sq, sk), np.shape(attn_bias)).astype(np.asarray(attn_bias).dtype),)
    return grads


def _sum_to(x, shape):
    """x summed over the dimensions a tensor of ``shape`` was broadcast along."""
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x
