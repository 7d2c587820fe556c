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
    # a document-mask kernel (isolates_nan=False): one masked attention over the whole packed batch
    "document_mask_soft": "another sequence's keys are hidden by a logit 12 lower, not -inf: they keep a "
                          "probability of about 6e-6 each",
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


def _document(bug):
    """The packed batch as one sequence under a document mask, as FlexAttention runs it: a hidden key
    gets probability 0 and its value is still multiplied in (declared with isolates_nan=False)."""
    def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None):
        cu_q, cu_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=DTYPES,
                                  who="mutant")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        lq = torch.tensor([b - a for a, b in zip(cu_q, cu_q[1:])])
        lk = torch.tensor([b - a for a, b in zip(cu_k, cu_k[1:])])
        sq = torch.repeat_interleave(torch.arange(len(lq)), lq)[:, None]  # each token's sequence
        sk = torch.repeat_interleave(torch.arange(len(lk)), lk)[None, :]
        i = torch.arange(q.shape[0])[:, None] - torch.tensor(cu_q[:-1])[sq]  # position within its sequence
        j = torch.arange(k.shape[0])[None, :] - torch.tensor(cu_k[:-1])[sk]
        seen = sq == sk
        if alignment(causal) == "bottom_right":
            seen &= j <= i + lk[sk] - lq[sq]
        elif alignment(causal) == "top_left":
            seen &= j <= i
        g = q.shape[1] // k.shape[1]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(g, 0), v.transpose(0, 1).repeat_interleave(g, 0)
        s = scale * qh @ kh.transpose(-1, -2)
        m = s.masked_fill(~seen, float("-inf")).amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        if bug == "document_mask_soft":  # (a row whose sequence has no keys stays empty)
            s = torch.where(seen | (sq != sk).all(-1, keepdim=True), s, s - 12)
            s = s.masked_fill(~(sq == sk).any(-1, keepdim=True), float("-inf"))
        else:  # hidden scores are -inf before exp, as a mask_mod makes them
            s = s.masked_fill(~seen, float("-inf"))
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        o = p @ vh / torch.where(denom == 0, torch.ones_like(denom), denom)
        lse = torch.where(denom == 0, torch.full_like(denom, float("-inf")), torch.log(denom) + m)
        return o.transpose(0, 1), lse[..., 0]

    return attention


def _register(name, bug):
    kernel, kw = (_document(bug), {"isolates_nan": False}) if bug and bug.startswith("document") else (_kernel(bug), {})
    return implementation(name=name, causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cpu",),
                          backward=True, gqa=True, lse=True, varlen=True, register=False, **kw)(kernel)


correct = _register("varlen-correct", None)
# the document-mask kernel without its bug: NaN values of other sequences reach it (0 * NaN), finite ones never
document_correct = implementation(name="varlen-document-correct", causal=("bottom_right", "top_left"),
                                  dtypes=DTYPES, devices=("cpu",), backward=True, gqa=True, lse=True, varlen=True,
                                  isolates_nan=False, register=False)(_document(None))
for _bug in BUGS:
    globals()[_bug] = _register(f"varlen-{_bug}", _bug)
