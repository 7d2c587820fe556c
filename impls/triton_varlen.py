"""Packed variable-length batches on the fused Triton kernels: the built-in "triton-fused-varlen".

``varlen_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
scale=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None, block_q=None, block_k=None,
precision="ieee")`` -> (o (Tq, Hq, Dv), lse (Hq, Tq) float32), as ``flash_attn_varlen_func`` lays a batch
out (flashcheck/contract/packed.py): q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), cu_seqlens_* int32
(B + 1,) on q's device. Sequence b is triton-fused's attention over its own keys: causal (bottom-right,
or top-left), the window, ALiBi's distances and the sinks per sequence; alibi_slopes (Hq,) or (B, Hq).
A sequence may have no queries or no keys; a query row of a sequence without keys gets O = 0 and
LSE = -inf (with sinks too). Gradients dq, dk, dv (and the sinks') come back through autograd.

The same three kernels as triton-fused (impls/triton_kernels.py) with IS_VARLEN set: one launch per
kernel for the whole batch, each program reading its sequence's offsets; the query/key tile axis of the
grid covers the longest sequence, and a program whose tile starts past its own sequence returns at
once. Tile sizes and launch settings are triton-fused's (its docstring); its general build for small
calls is not used here.
"""
from __future__ import annotations

import math
import numbers

import torch
import triton

from flashcheck.contract import implementation
from flashcheck.contract.checks import alignment, check_varlen, dtype_name
from flashcheck.impls import triton_fused as tf
from flashcheck.impls import triton_kernels as K

WHO = "triton-fused-varlen"
BIG = 1 << 30  # an edge that hides nothing: BIG + any sequence's Sk - Sq stays inside int32


def _vector(x, label, shapes, q):
    return None if x is None else tf._float32_vector(x, label, shapes, q, WHO)


def _features(q, n, longest_q, longest_k, align, window, softcap, alibi_slopes, sinks):
    """(triton_fused._Features with OFF, LOFF relative to each sequence's diagonal, TOP): see the
    kernels' docstring. Edges that hide nothing in any sequence are dropped, as triton-fused drops them."""
    hq = q.shape[1]
    top = 0 if align == "top_left" else BIG
    right = 0 if align == "bottom_right" else BIG
    left, loff = False, 0
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(map(tf._is_int, window))
                and min(window) >= -1):
            raise ValueError(f"{WHO}: window must be (left, right), two ints >= -1 (-1: unbounded), got {window!r}")
        wl, wr = int(window[0]), int(window[1])
        if 0 <= wr < longest_q - 1:  # row 0 of a sequence of Sq_b rows sees up to key Sk_b - Sq_b + wr
            right = min(right, wr)
        if 0 <= wl < longest_k - 1:
            left, loff = True, -wl
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) \
            or softcap < 0:
        raise ValueError(f"{WHO}: softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    slopes = _vector(alibi_slopes, "alibi_slopes", [(hq,), (n, hq)], q)
    sinks = _vector(sinks, "sinks", [(hq,)], q)
    cap = max(float(softcap), tf.SOFTCAP_MIN) if softcap > 0 else 0.0
    feats = tf._Features(right < BIG or top < BIG, right, left, loff, 0, cap, slopes, sinks)
    return feats, top


def _forward(q, k, v, cu, grid_q, scale, precision, cfg, feats, top, kernels=K):
    tq, hq, d = q.shape
    tk, hkv, dv = k.shape[0], k.shape[1], v.shape[2]
    n = cu[0].numel() - 1
    dpad, dvpad = tf._pad(d), tf._pad(dv)
    o = torch.empty((tq, hq, dv), device=q.device, dtype=q.dtype)
    lse = torch.empty((hq, tq), device=q.device, dtype=torch.float32)
    tf._launch(kernels.attn_fwd, lambda bm, bn: (triton.cdiv(grid_q, bm), hq, n), cfg.fwd,
               q, k, v, o, lse,
               0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0),
               0, o.stride(1), o.stride(0),
               hq, hq // hkv, tq, tk, d, dv, feats.off, scale * K.LOG2E_F, **feats.kernel_args(lse),
               D_PAD=dpad, DV_PAD=dvpad, PAD_D=dpad != d, PAD_DV=dvpad != dv, DOT_PREC=precision,
               CU_Q=cu[0], CU_K=cu[1], TOP=top, IS_VARLEN=True, **tf.one_loop(q, precision))
    return o, lse


def _backward(do, q, k, v, o, lse, cu, grid_q, grid_k, scale, precision, cfg, feats, top, kernels=K):
    """(dq, dk, dv, dsinks or None) in the packed layout."""
    tq, hq, d = q.shape
    tk, hkv, dv = k.shape[0], k.shape[1], v.shape[2]
    n = cu[0].numel() - 1
    dpad, dvpad = tf._pad(d), tf._pad(dv)
    do = tf._last_dim_contiguous(do)
    delta = torch.empty((hq, tq), device=q.device, dtype=torch.float32)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dvv = torch.empty_like(v, memory_format=torch.contiguous_format)
    common = dict(**feats.kernel_args(lse, with_sinks=False), D_PAD=dpad, DV_PAD=dvpad, PAD_D=dpad != d,
                  PAD_DV=dvpad != dv, DOT_PREC=precision, CU_Q=cu[0], CU_K=cu[1], TOP=top, IS_VARLEN=True,
                  **tf.one_loop(q, precision))
    # dQ first: it stores delta = rowsum(dO * O), which dK/dV reads
    tf._launch(kernels.attn_bwd_dq, lambda bm, bn: (triton.cdiv(grid_q, bm), hq, n), cfg.dq,
               q, k, v, o, do, lse, delta, dq,
               0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0),
               0, o.stride(1), o.stride(0), 0, do.stride(1), do.stride(0), 0, dq.stride(1), dq.stride(0),
               hq, hq // hkv, tq, tk, d, dv, feats.off, scale * K.LOG2E_F, scale, **common)
    tf._launch(kernels.attn_bwd_dkdv, lambda bm, bn: (triton.cdiv(grid_k, bn), hkv, n), cfg.dkdv,
               q, k, v, do, lse, delta, dk, dvv,
               0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0),
               0, do.stride(1), do.stride(0), 0, dk.stride(1), dk.stride(0), 0, dvv.stride(1), dvv.stride(0),
               hq, hkv, hq // hkv, tq, tk, d, dv, feats.off, scale * K.LOG2E_F, scale, **common)
    dsinks = None
    if feats.sinks is not None:  # -sum over tokens of exp(sink - LSE) * delta; 0 where LSE = -inf
        p = torch.exp(feats.sinks[:, None] - lse)
        dsinks = -(torch.where(lse == -math.inf, 0.0, p) * delta).sum(dim=1)
    return dq, dk, dvv, dsinks


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, grid_q, grid_k, scale, precision, cfg, feats, top, kernels):
        o, lse = _forward(q, k, v, (cu_q, cu_k), grid_q, scale, precision, cfg, feats, top, kernels)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.args = (grid_q, grid_k, scale, precision, cfg, feats, top, kernels)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv, dsinks = _backward(do, q, k, v, o, lse, (cu_q, cu_k), *ctx.args)
        return (dq, dk, dv, dsinks) + (None,) * 10


def flash_attention_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           scale=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None, block_q=None,
                           block_k=None, precision="ieee", configs=None, kernels=K):
    """The full entry point; ``configs`` and ``kernels`` as triton_fused.flash_attention takes them."""
    cu_q, cu_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=tf.DTYPES,
                              who=WHO)
    d, dv = q.shape[-1], v.shape[-1]
    if max(d, dv) > 256:
        raise ValueError(f"{WHO}: head dims up to 256 are supported, got D={d}, Dv={dv}")
    dev = q.device
    if tf.INTERPRET and dev.type != "cpu":
        raise ValueError(f"{WHO}: under TRITON_INTERPRET=1 the kernels run on CPU tensors, got {dev}")
    if not tf.INTERPRET and dev.type != "cuda":
        raise ValueError(f"{WHO}: needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got device {dev}")
    if precision not in tf.PRECISIONS:
        raise ValueError(f"{WHO}: precision must be one of {tf.PRECISIONS}, got {precision!r}")
    for label, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk is not None and (isinstance(blk, bool) or not isinstance(blk, int) or blk < 16
                                or blk & (blk - 1) or blk > 256):
            raise ValueError(f"{WHO}: {label} must be a power of two in 16..256, got {blk!r}")
    align = alignment(causal)
    # the grid covers the longest sequence on each side (max_seqlen_* may overstate it)
    longest_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    longest_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cfg = tf._config(block_q, block_k, tf._pad(max(d, dv)), configs, fp32=dtype_name(q) == "float32")
    if not tf.INTERPRET:
        cfg = tf._fit(cfg, q.element_size(), tf._pad(d), tf._pad(dv))
    feats, top = _features(q, len(cu_q) - 1, longest_q, longest_k, align, window, softcap, alibi_slopes, sinks)
    q, k, v = (tf._last_dim_contiguous(x) for x in (q, k, v))
    return _VarlenAttention.apply(q, k, v, feats.sinks, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                                  max(longest_q, 1), max(longest_k, 1), scale, precision, cfg, feats, top, kernels)


# triton-fused's declaration (devices, dtypes, the interpreter's lane and tags) in the packed layout
DECLARED = dict(tf.DECLARED, varlen=True)


@implementation(name=WHO, **DECLARED)
def varlen_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                     window=None, softcap=0.0, alibi_slopes=None, sinks=None, block_q=None, block_k=None,
                     precision="ieee"):
    """Fused FlashAttention over a packed batch; returns (o (Tq, Hq, Dv), lse (Hq, Tq))."""
    return flash_attention_varlen(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, scale=scale,
                                  window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                  block_q=block_q, block_k=block_k, precision=precision)
