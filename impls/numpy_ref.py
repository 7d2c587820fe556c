"""The NumPy implementations under test: the dense truth as a kernel (numpy-dense), and
FlashAttention's Algorithm 1 with its backward, tile by tile (numpy-tiled).

Arrays are (B, H, S, D), viewed as (B, Hkv, G, S, D) so each key/value head serves its
G = Hq // Hkv query heads by broadcasting. Only tiles are looped over.
"""
from __future__ import annotations

import numpy as np

from flashcheck.contract import implementation
from flashcheck.contract.checks import check_blocks, offset
from flashcheck.oracle.reference import DTYPES, dense_backward, dense_forward, prepare
from flashcheck.strategies.case import visible

__all__ = ["dense_backward", "dense_forward", "tiled_backward", "tiled_forward"]


def _tiles(n: int, block: int):
    return [(start, min(start + block, n)) for start in range(0, n, block)]


def _tile_hidden(q0, q1, k0, align, off) -> bool:
    """True when no query in [q0, q1) sees key k0 or later, so the whole tile can be skipped."""
    return align is not None and k0 > (q1 - 1) + off


def tiled_forward(q, k, v, *, causal=False, scale=None, block_q=16, block_k=16):
    """FlashAttention Algorithm 1: outer loop over key/value tiles, inner over query tiles.

    Per query row it keeps the running max m, the running sum l of exp(s - m) and the
    unnormalized output acc; each new tile rescales them by exp(m_old - m_new).
    """
    check_blocks(block_q, block_k, who="numpy-tiled")
    qg, kg, vg, align, scale, (b, hq, sq, sk, dv) = prepare(q, k, v, causal, scale, "numpy-tiled")
    dt = q.dtype
    off = offset(sq, sk, align)
    m = np.full(qg.shape[:-1], -np.inf, dtype=dt)
    l = np.zeros(qg.shape[:-1], dtype=dt)
    acc = np.zeros(qg.shape[:-1] + (dv,), dtype=dt)
    for k0, k1 in _tiles(sk, block_k):
        kt, vt = kg[..., k0:k1, :], vg[..., k0:k1, :]
        for q0, q1 in _tiles(sq, block_q):
            if _tile_hidden(q0, q1, k0, align, off):
                continue
            s = dt.type(scale) * (qg[..., q0:q1, :] @ np.swapaxes(kt, -1, -2))
            mask = visible(sq, sk, align, np.arange(q0, q1), np.arange(k0, k1))
            s = np.where(mask, s, -np.inf)
            m_old = m[..., q0:q1]
            m_new = np.maximum(m_old, s.max(axis=-1))
            # Rows that have seen no key yet keep m = -inf; shift them by 0 so exp gives 0, not NaN.
            shift = np.where(np.isfinite(m_new), m_new, 0).astype(dt)
            p = np.exp(s - shift[..., None])
            alpha = np.exp(m_old - shift)  # rescales what earlier tiles summed to the new max
            l[..., q0:q1] = alpha * l[..., q0:q1] + p.sum(axis=-1)
            acc[..., q0:q1, :] = alpha[..., None] * acc[..., q0:q1, :] + p @ vt
            m[..., q0:q1] = m_new
    seen = l > 0
    o = np.divide(acc, l[..., None], out=np.zeros_like(acc), where=seen[..., None])
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf).astype(dt)
    return o.reshape(b, hq, sq, dv), lse.reshape(b, hq, sq)


def tiled_backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_q=16, block_k=16):
    """FlashAttention backward: P is recomputed tile by tile from the saved LSE.

    D = rowsum(dO * O) replaces the softmax Jacobian's row term, so no Sq x Sk matrix
    is ever held.
    """
    check_blocks(block_q, block_k, who="numpy-tiled")
    qg, kg, vg, align, scale, (b, hq, sq, sk, dv) = prepare(q, k, v, causal, scale, "numpy-tiled")
    dt = q.dtype
    off = offset(sq, sk, align)
    dog = do.reshape(qg.shape[:-1] + (dv,)).astype(dt)
    lseg = lse.reshape(qg.shape[:-1]).astype(dt)
    delta = (dog * o.reshape(dog.shape).astype(dt)).sum(axis=-1)
    dq = np.zeros(qg.shape, dtype=dt)
    dk = np.zeros(k.shape, dtype=dt)
    dvv = np.zeros(v.shape, dtype=dt)
    for k0, k1 in _tiles(sk, block_k):
        kt, vt = kg[..., k0:k1, :], vg[..., k0:k1, :]
        for q0, q1 in _tiles(sq, block_q):
            if _tile_hidden(q0, q1, k0, align, off):
                continue
            rows = slice(q0, q1)
            s = dt.type(scale) * (qg[..., rows, :] @ np.swapaxes(kt, -1, -2))
            mask = visible(sq, sk, align, np.arange(q0, q1), np.arange(k0, k1))
            # Rows with LSE = -inf saw no key: shift them by 0 so their P is exp(-inf) = 0, not NaN.
            row_lse = lseg[..., rows, None]
            p = np.exp(np.where(mask, s, -np.inf) - np.where(np.isfinite(row_lse), row_lse, 0)).astype(dt)
            dvv[..., k0:k1, :] += (np.swapaxes(p, -1, -2) @ dog[..., rows, :]).sum(axis=2)
            dp = dog[..., rows, :] @ np.swapaxes(vt, -1, -2)
            ds = p * (dp - delta[..., rows, None])
            dq[..., rows, :] += dt.type(scale) * (ds @ kt)
            dk[..., k0:k1, :] += dt.type(scale) * (np.swapaxes(ds, -1, -2) @ qg[..., rows, :]).sum(axis=2)
    return dq.reshape(q.shape), dk, dvv


implementation(name="numpy-dense", causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cpu",),
               backward=dense_backward, gqa=True, lse=True, framework="numpy",
               window=True, softcap=True, alibi=True, sinks=True, mask=True, bias=True)(dense_forward)
implementation(name="numpy-tiled", causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cpu",),
               backward=tiled_backward, gqa=True, lse=True, framework="numpy", blocks="any",
               deterministic=True)(tiled_forward)
