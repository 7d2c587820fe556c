"""Deliberately broken feature kernels in NumPy: one bug per switch in window, softcap, ALiBi,
sinks and dropout.

The kernel is FlashAttention-2 shaped (query tiles outside, key tiles inside, online softmax,
a backward that recomputes P from the LSE) and implements every feature of the matrix with
the counter-based dropout RNG of impls/counter_rng.py. ``bug=None`` is the correct kernel;
it runs through the same harness and must pass. Each mutant is a plug-in,
``mutants/features.py:<name>``, exactly as a user's kernel would be.
"""
from __future__ import annotations

import math

import numpy as np

from flashcheck.contract import implementation
from flashcheck.impls import counter_rng
from flashcheck.contract.checks import alignment, check_blocks, check_features, check_inputs, offset

BUGS = {
    "window_left_off_by_one": "window's left edge off by one (one key too few)",
    "window_right_off_by_one": "window's right edge off by one (one key too many)",
    "softcap_before_scale": "softcap applied before the scale",
    "softcap_no_tanh_grad": "backward misses the softcap's tanh derivative",
    "alibi_sign": "ALiBi bias added with the wrong sign",
    "alibi_top_left": "ALiBi distance abs(i - j) where abs(i + Sk - Sq - j) is meant (Sq != Sk)",
    "sink_in_value_sum": "the sink counted in the value sum (as a key with the first value)",
    "sink_grad_sign": "sink gradient with the wrong sign",
    "dropout_no_rescale": "dropout without the 1 / (1 - p) rescale",
    "dropout_bwd_mask_differs": "backward draws a different dropout mask than the forward",
}


def _logits(q, kk, rows, cols, cfg, bug):
    """One tile's logits (B, Hq, rows, cols), -inf where hidden, and the softcap's derivative."""
    sq, sk, scale = cfg["sq"], cfg["sk"], cfg["scale"]
    raw = q[:, :, rows] @ np.swapaxes(kk[:, :, cols], -1, -2)
    dcap = np.ones_like(raw)
    c = cfg["softcap"]
    if c and bug == "softcap_before_scale":
        s = scale * c * np.tanh(raw / c)
    elif c:
        t = np.tanh(scale * raw / c)
        s, dcap = c * t, 1 - t * t
    else:
        s = scale * raw
    diag = rows[:, None] + (0 if bug == "alibi_top_left" else sk - sq)
    if cfg["slopes"] is not None:
        sign = -1 if bug == "alibi_sign" else 1
        s = s - sign * cfg["slopes"] * np.abs(diag - cols[None, :])
    dist = cols[None, :] - (rows[:, None] + sk - sq)
    vis = np.ones(dist.shape, bool)
    if cfg["align"] is not None:
        vis &= cols[None, :] <= rows[:, None] + offset(sq, sk, cfg["align"])
    left, right = cfg["window"]
    if left >= 0:
        vis &= dist > -left if bug == "window_left_off_by_one" else dist >= -left
    if right >= 0:
        vis &= dist <= right + (1 if bug == "window_right_off_by_one" else 0)
    return np.where(vis, s, -np.inf), dcap


def _weights(cfg, rows, cols, shape, seed_shift=0):
    """keep / (1 - p) for the tile (or keep alone for the no-rescale bug); None without dropout."""
    p = cfg["dropout_p"]
    if not p:
        return None
    b, hq = shape[:2]
    counter = (((np.arange(b)[:, None, None, None] * hq + np.arange(hq)[None, :, None, None]) * cfg["sq"]
                + rows[None, None, :, None]) * cfg["sk"] + cols[None, None, None, :])
    kept = counter_rng.keep(cfg["seed"] + seed_shift, p, counter).astype(np.float64)
    return kept if cfg["bug"] == "dropout_no_rescale" else kept / (1 - p)


def _setup(q, k, v, causal, scale, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, bug):
    b, hq, hkv, sq, sk, d, dv = check_inputs(q, k, v, dtypes=("float32", "float64"), who="feature mutant")
    window = check_features(q, who="feature mutant", window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                            sinks=sinks, dropout_p=dropout_p)
    heads = np.arange(hq) // (hq // hkv)
    slopes = None if alibi_slopes is None else np.broadcast_to(np.asarray(alibi_slopes, np.float64),
                                                              (b, hq))[:, :, None, None]
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None]
    cfg = dict(sq=sq, sk=sk, scale=1.0 / math.sqrt(d) if scale is None else float(scale), align=alignment(causal),
               window=tuple(window) if window is not None else (-1, -1), softcap=float(softcap), slopes=slopes,
               dropout_p=float(dropout_p), seed=int(dropout_seed), bug=bug)
    f64 = np.float64
    return heads, cfg, sink, q.astype(f64), k[:, heads].astype(f64), v[:, heads].astype(f64)


def forward(q, k, v, *, causal=False, scale=None, block_q=16, block_k=16, window=(-1, -1), softcap=0.0,
            alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=0, bug=None):
    check_blocks(block_q, block_k, who="feature mutant")
    heads, cfg, sink, qq, kk, vv = _setup(q, k, v, causal, scale, window, softcap, alibi_slopes, sinks,
                                          dropout_p, dropout_seed, bug)
    sq, sk = cfg["sq"], cfg["sk"]
    o = np.zeros(q.shape[:-1] + v.shape[-1:])
    lse = np.zeros(q.shape[:-1])
    for q0 in range(0, sq, block_q):
        rows = np.arange(q0, min(q0 + block_q, sq))
        m = np.full(q.shape[:2] + (len(rows),), -np.inf)
        l = np.zeros_like(m)
        acc = np.zeros(q.shape[:2] + (len(rows), v.shape[-1]))
        for k0 in range(0, sk, block_k):
            cols = np.arange(k0, min(k0 + block_k, sk))
            s, _ = _logits(qq, kk, rows, cols, cfg, bug)
            m_new = np.maximum(m, s.max(axis=-1))
            shift = np.where(np.isfinite(m_new), m_new, 0)
            p = np.exp(s - shift[..., None])
            alpha = np.exp(m - shift)
            w = _weights(cfg, rows, cols, p.shape)
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + (p if w is None else p * w) @ vv[:, :, cols]
            m = m_new
        if sink is not None:
            m_new = np.maximum(m, sink)
            shift = np.where(np.isfinite(m_new), m_new, 0)
            alpha, esink = np.exp(m - shift), np.exp(sink - shift)
            l = alpha * l + esink
            acc = alpha[..., None] * acc
            if bug == "sink_in_value_sum":
                acc = acc + esink[..., None] * vv[:, :, :1]
            m = m_new
        with np.errstate(divide="ignore"):
            o[:, :, rows] = np.where(l[..., None] > 0, acc / np.where(l > 0, l, 1)[..., None], 0)
            lse[:, :, rows] = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf)
    return o.astype(q.dtype), lse.astype(q.dtype)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_q=16, block_k=16, window=(-1, -1),
             softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=0, bug=None):
    heads, cfg, sink, qq, kk, vv = _setup(q, k, v, causal, scale, window, softcap, alibi_slopes, sinks,
                                          dropout_p, dropout_seed, bug)
    sq, sk, scale = cfg["sq"], cfg["sk"], cfg["scale"]
    do, o = do.astype(np.float64), o.astype(np.float64)
    delta = (do * o).sum(axis=-1)
    base = np.where(np.isfinite(lse), lse, np.inf).astype(np.float64)[..., None]  # P = 0 on rows that saw nothing
    dq, dkk, dvv = np.zeros_like(qq), np.zeros_like(kk), np.zeros_like(vv)
    for q0 in range(0, sq, block_q):
        rows = np.arange(q0, min(q0 + block_q, sq))
        for k0 in range(0, sk, block_k):
            cols = np.arange(k0, min(k0 + block_k, sk))
            s, dcap = _logits(qq, kk, rows, cols, cfg, bug)
            p = np.exp(s - base[:, :, rows])
            w = _weights(cfg, rows, cols, p.shape, seed_shift=1 if bug == "dropout_bwd_mask_differs" else 0)
            pw = p if w is None else p * w
            dvv[:, :, cols] += np.swapaxes(pw, -1, -2) @ do[:, :, rows]
            dp = do[:, :, rows] @ np.swapaxes(vv[:, :, cols], -1, -2)
            ds = p * ((dp if w is None else dp * w) - delta[:, :, rows, None])
            if bug != "softcap_no_tanh_grad":
                ds = ds * dcap
            dq[:, :, rows] += scale * (ds @ kk[:, :, cols])
            dkk[:, :, cols] += scale * (np.swapaxes(ds, -1, -2) @ qq[:, :, rows])
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    np.add.at(dk, (slice(None), heads), dkk)
    np.add.at(dv, (slice(None), heads), dvv)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    if sink is None:
        return grads
    psink = np.exp(sink - base[..., 0])
    dsinks = (1 if bug == "sink_grad_sign" else -1) * (psink * delta).sum(axis=(0, 2))
    return grads + (dsinks.astype(np.float32),)


def dropout_mask(q, k, v, p, seed):
    """The keep mask this kernel draws (the correct one, whatever the bug)."""
    return counter_rng.keep_mask(q.shape[0], q.shape[1], q.shape[2], k.shape[2], p, seed).numpy()


def make(bug: str | None):
    """The kernel with one bug switched on, declared as a plug-in with every feature."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; known: {sorted(BUGS)}")

    def bwd(*args, **kw):
        return backward(*args, bug=bug, **kw)

    def attention(q, k, v, **kw):
        return forward(q, k, v, bug=bug, **kw)

    name = f"mutant-{bug}" if bug else "features-numpy"
    return implementation(name=name, causal=("bottom_right", "top_left"), dtypes=("float32", "float64"),
                          backward=bwd, gqa=True, lse=True, framework="numpy", blocks="any", register=False,
                          window=True, softcap=True, alibi=True, sinks=True, dropout=True,
                          dropout_mask=dropout_mask)(attention)


correct = make(None)
globals().update({bug: make(bug) for bug in BUGS})
