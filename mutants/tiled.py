"""Deliberately broken FlashAttention-2 kernels in NumPy: one public bug class per mutant.

The kernel is row-block-major (outer loop over query tiles, inner over key tiles, as in
FlashAttention-2), a different loop order from the reference's Algorithm 1, and every
bug is one switch in it. ``bug=None`` is the correct kernel: it runs through the same
harness and must pass every property, which is how the mutant test shows it raises no
false alarm. Each mutant is a plug-in, ``mutants/tiled.py:<name>``, exactly as a user's
kernel would be.
"""
from __future__ import annotations

import math

import numpy as np

from flashcheck import implementation
from flashcheck.contract.checks import alignment, check_blocks, check_inputs, offset

BUGS = {
    "rescale_skipped": "online-softmax rescale skipped",
    "rescale_wrong_term": "rescale applied to the output but not the running sum",
    "partial_tile_dropped": "last partial key tile dropped",
    "padded_keys_counted": "padded keys of the last tile counted",
    "causal_top_left": "causal mask aligned top-left where bottom-right is meant",
    "causal_off_by_one": "causal mask off by one at the diagonal",
    "causal_per_tile": "causal mask applied per tile instead of per element",
    "bwd_mask_differs": "backward uses a different mask than the forward",
    "bwd_no_delta": "backward drops the rowsum(dO * O) term",
    "dq_no_scale": "scale factor missing in dQ",
    "dk_no_scale": "scale factor missing in dK",
    "gqa_wrong_map": "GQA query head mapped to the wrong kv head",
    "gqa_no_group_sum": "dK/dV not summed over the GQA group",
    "gqa_group_past_4": "a GQA group wider than 4 query heads is mapped as if it held 4 (no template for it)",
    "lse_base2": "LSE returned in base 2",
    "no_max_subtraction": "overflow from large logits (no max subtraction)",
    "masked_row_nan": "NaN for a fully masked row",
    "scale_ignored": "custom scale ignored",
    "scale_padded_dim": "default scale computed from a padded head dim",
}


def _setup(q, k, v, causal, scale, bug):
    b, hq, hkv, sq, sk, d, dv = check_inputs(q, k, v, dtypes=("float32", "float64"), who="mutant")
    if bug == "scale_padded_dim" and scale is None:
        scale = 1.0 / math.sqrt(max(16, 1 << (d - 1).bit_length()))
    elif scale is None or bug == "scale_ignored":
        scale = 1.0 / math.sqrt(d)
    group = hq // hkv
    heads = np.arange(hq) % hkv if bug == "gqa_wrong_map" else np.arange(hq) // group
    if bug == "gqa_group_past_4":
        heads = np.arange(hq) // min(group, 4) % hkv
    return heads, alignment(causal), q.dtype.type(scale), (b, hq, hkv, sq, sk)


def _key_tiles(sk, block, bug):
    stop = sk - sk % block if bug == "partial_tile_dropped" and sk > block else sk
    return [(k0, min(k0 + block, stop)) for k0 in range(0, stop, block)]


def _mask(rows, cols, align, off, bug):
    """Which (row, col) pairs of one tile are visible, with the mask bugs switched in."""
    if align is None:
        return np.ones((len(rows), len(cols)), bool)
    if bug == "causal_top_left":
        off = 0
    i, j = rows[:, None], cols[None, :]
    if bug == "causal_per_tile":  # the whole tile counts once any of it is visible
        return np.full((len(rows), len(cols)), bool(cols[0] <= rows[-1] + off))
    return j < i + off if bug == "causal_off_by_one" else j <= i + off


def _scores(qt, kt, scale, rows, cols, align, off, bug, sk):
    s = scale * (qt @ np.swapaxes(kt, -1, -2))
    if bug == "padded_keys_counted" and len(cols) and cols[-1] == sk - 1:
        pad = -(-len(cols) // 8) * 8 - len(cols)  # zero keys up to a multiple of 8 score 0
        s = np.concatenate([s, np.zeros(s.shape[:-1] + (pad,), s.dtype)], axis=-1)
        cols = np.concatenate([cols, np.arange(sk, sk + pad)])
    vis = _mask(rows, cols, align, off, bug)
    return np.where(vis, s, -np.inf), cols


def forward(q, k, v, *, causal=False, scale=None, block_q=16, block_k=16, bug=None):
    check_blocks(block_q, block_k, who="mutant")
    heads, align, scale, (b, hq, hkv, sq, sk) = _setup(q, k, v, causal, scale, bug)
    kk, vv = k[:, heads], v[:, heads]
    off = offset(sq, sk, align)
    o = np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
    lse = np.zeros(q.shape[:-1], q.dtype)
    for q0 in range(0, sq, block_q):
        rows = np.arange(q0, min(q0 + block_q, sq))
        m = np.full(q.shape[:2] + (len(rows),), -np.inf, q.dtype)
        l = np.zeros_like(m)
        acc = np.zeros(q.shape[:2] + (len(rows), v.shape[-1]), q.dtype)
        for k0, k1 in _key_tiles(sk, block_k, bug):
            s, cols = _scores(q[:, :, rows], kk[:, :, k0:k1], scale, rows, np.arange(k0, k1), align, off, bug, sk)
            vt = vv[:, :, k0:k1]
            if s.shape[-1] > vt.shape[-2]:  # padded keys carry zero values
                vt = np.concatenate([vt, np.zeros(vt.shape[:2] + (s.shape[-1] - vt.shape[-2],) + vt.shape[3:],
                                                  vt.dtype)], axis=2)
            m_new = np.maximum(m, s.max(axis=-1))
            # a row that has seen nothing keeps m = -inf; shifting it by 0 keeps exp() at 0
            shift = np.zeros_like(m_new) if bug == "no_max_subtraction" else np.where(np.isfinite(m_new), m_new, 0)
            p = np.exp(s - shift[..., None])
            alpha = np.ones_like(m) if bug in ("rescale_skipped", "no_max_subtraction") else np.exp(m - shift)
            l = (l if bug == "rescale_wrong_term" else alpha * l) + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ vt
            m = m_new
        with np.errstate(invalid="ignore", divide="ignore"):
            if bug == "masked_row_nan":
                o[:, :, rows] = acc / l[..., None]
            else:
                o[:, :, rows] = np.where(l[..., None] > 0, acc / np.where(l > 0, l, 1)[..., None], 0)
            top = m if bug != "no_max_subtraction" else np.zeros_like(m)
            row_lse = np.where(l > 0, top + np.log(np.where(l > 0, l, 1)), -np.inf)
        lse[:, :, rows] = row_lse / np.log(2) if bug == "lse_base2" else row_lse
    return o, lse


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_q=16, block_k=16, bug=None):
    heads, align, scale, (b, hq, hkv, sq, sk) = _setup(q, k, v, causal, scale, bug)
    kk, vv = k[:, heads], v[:, heads]
    off = offset(sq, sk, align)
    bwd_align = None if bug == "bwd_mask_differs" else align
    delta = np.zeros(lse.shape, q.dtype) if bug == "bwd_no_delta" else (do * o).sum(axis=-1)
    finite = np.isfinite(lse)
    base = np.where(finite, lse, 0)[..., None]
    dq, dkk, dvv = np.zeros_like(q), np.zeros_like(kk), np.zeros_like(vv)
    for q0 in range(0, sq, block_q):
        rows = np.arange(q0, min(q0 + block_q, sq))
        for k0, k1 in _key_tiles(sk, block_k, None):
            cols = np.arange(k0, k1)
            s = scale * (q[:, :, rows] @ np.swapaxes(kk[:, :, k0:k1], -1, -2))
            vis = _mask(rows, cols, bwd_align, off, None)
            p = np.where(vis & finite[:, :, rows, None], np.exp(np.where(vis, s, 0) - base[:, :, rows]), 0)
            dvv[:, :, k0:k1] += np.swapaxes(p, -1, -2) @ do[:, :, rows]
            ds = p * (do[:, :, rows] @ np.swapaxes(vv[:, :, k0:k1], -1, -2) - delta[:, :, rows, None])
            dq[:, :, rows] += (1 if bug == "dq_no_scale" else scale) * (ds @ kk[:, :, k0:k1])
            dkk[:, :, k0:k1] += (1 if bug == "dk_no_scale" else scale) * (np.swapaxes(ds, -1, -2) @ q[:, :, rows])
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    if bug == "gqa_no_group_sum":  # each kv head keeps only its group's first query head
        first = np.searchsorted(heads, np.arange(hkv))
        dk[:], dv[:] = dkk[:, first], dvv[:, first]
    else:
        np.add.at(dk, (slice(None), heads), dkk)
        np.add.at(dv, (slice(None), heads), dvv)
    return dq, dk, dv


def make(bug: str | None):
    """The kernel with one bug switched on, declared as a plug-in."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; known: {sorted(BUGS)}")

    def bwd(*args, **kw):
        return backward(*args, bug=bug, **kw)

    def attention(q, k, v, *, causal=False, scale=None, block_q=16, block_k=16):
        return forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k, bug=bug)

    name = f"mutant-{bug}" if bug else "fa2-numpy"
    return implementation(name=name, causal=("bottom_right", "top_left"), dtypes=("float32", "float64"),
                          backward=bwd, gqa=True, lse=True, framework="numpy", blocks="any",
                          register=False)(attention)


correct = make(None)
globals().update({bug: make(bug) for bug in BUGS})
