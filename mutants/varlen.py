"""Deliberately broken packed-batch (varlen) kernels in torch: one bug per switch, each a class
the bug survey found in shipped kernels (docs/mutants.md).

The kernel walks the sequences of a packed batch, and attends each one densely in its own
dtype, with autograd for the backward. ``bug=None`` is the correct kernel; it runs through the
same harness and must pass. Each mutant is a plug-in, ``mutants/varlen.py:<name>``.
"""
from __future__ import annotations

import math

import torch

from flashcheck.contract import implementation
from flashcheck.contract.checks import alignment, check_varlen

BUGS = {
    "keys_past_own_end": "each sequence reads max_seqlen_k keys from its start: the next sequence's keys leak in",
    "offset_rounded_to_tile": "a sequence's key offset rounded down to a 16-token tile",
    "empty_sequence_nan": "a sequence without keys gives NaN, not O = 0",
    "causal_from_longest": "the causal diagonal from max_seqlen_k - max_seqlen_q, not each sequence's own lengths",
}
DTYPES = ("float32", "float64")


def _attend(q, k, v, scale, align, diag):
    """q (Hq, Sq, D), k (Hkv, Sk, D): O (Hq, Sq, Dv) and LSE (Hq, Sq); a row seeing no key gives 0, -inf."""
    if k.shape[1] == 0:  # no key at all: amax over nothing would raise
        return q.new_zeros((*q.shape[:2], v.shape[-1])) + 0 * q.sum(), q.new_full(q.shape[:2], float("-inf"))
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = scale * q @ k.transpose(-1, -2)
    if align is not None:
        i = torch.arange(q.shape[1], device=q.device)[:, None]
        j = torch.arange(k.shape[1], device=q.device)[None, :]
        s = s.masked_fill(j > i + diag, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row without keys: exp(-inf) = 0, not NaN
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    o = p @ v / torch.where(denom == 0, torch.ones_like(denom), denom)
    lse = torch.where(denom == 0, torch.full_like(denom, float("-inf")), torch.log(denom) + m)
    return o, lse[..., 0]


def _kernel(bug):
    def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None):
        cu_q, cu_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=DTYPES,
                                  who="mutant")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        align = alignment(causal)
        os_, lses = [], []
        for b in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            if bug == "keys_past_own_end":
                k1 = min(k0 + max_seqlen_k, k.shape[0])
            elif bug == "offset_rounded_to_tile":
                k0 = k0 // 16 * 16
            sq, sk = q1 - q0, k1 - k0
            if bug == "empty_sequence_nan" and sk == 0:
                os_.append(torch.full((sq, q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype) + 0 * q[q0:q1, :, :1])
                lses.append(torch.full((q.shape[1], sq), float("nan"), dtype=q.dtype))
                continue
            diag = (max_seqlen_k - max_seqlen_q if bug == "causal_from_longest" else sk - sq) \
                if align == "bottom_right" else 0
            o, lse = _attend(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1), scale,
                             align, diag)
            os_.append(o.transpose(0, 1))
            lses.append(lse)
        return torch.cat(os_, 0), torch.cat(lses, 1)

    return attention


def _register(name, bug):
    return implementation(name=name, causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cpu",),
                          backward=True, gqa=True, lse=True, varlen=True, register=False)(_kernel(bug))


correct = _register("varlen-correct", None)
for _bug in BUGS:
    globals()[_bug] = _register(f"varlen-{_bug}", _bug)
