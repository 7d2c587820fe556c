"""Deliberately broken kernels with a mask tensor (attn_mask, bool, True = may attend) and an additive
bias (attn_bias), in the bug classes shipped kernels had: a mask read as if it were broadcast over
heads or over the batch, a fully masked row filled with finfo.min instead of -inf (so it averages
every value), the mask applied to P after the softmax instead of to the scores, a bias added before
the scale, -inf in the bias replaced by finfo.min, and no gradient for the bias (docs/mutants.md).

The kernel is dense attention in its own dtype, with autograd for the backward. ``bug=None`` is
the correct kernel. Each mutant is a plug-in, ``mutants/masks.py:<name>``.
"""
from __future__ import annotations

import math

import torch

from flashcheck.contract import implementation
from flashcheck.contract.checks import check_features, check_inputs

BUGS = {
    "mask_first_head_only": "reads the mask of head 0 for every head (a per-head mask taken as broadcast)",
    "mask_first_batch_only": "reads the mask of batch entry 0 for every entry",
    "finfo_min_for_hidden": "hides scores with finfo.min, not -inf: a row with no True entry averages every value",
    "mask_after_softmax": "zeroes the hidden probabilities after the softmax, without renormalizing",
    "bias_before_scale": "adds the bias to q k^T before the scale, not to the scaled scores",
    "bias_ninf_to_finfo_min": "replaces -inf in the bias by finfo.min (nan_to_num): a row it hides entirely is uniform",
    "bias_no_gradient": "adds a detached bias: attn_bias gets no gradient",
}


def _kernel(bug):
    def attention(q, k, v, *, causal=False, scale=None, attn_mask=None, attn_bias=None):
        check_inputs(q, k, v, dtypes=("float32", "float64"), who="mutant")
        check_features(q, who="mutant", attn_mask=attn_mask, sk=k.shape[2], attn_bias=attn_bias)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = q @ k.transpose(-1, -2)
        sq, sk = q.shape[2], k.shape[2]
        seen = torch.ones(1, 1, sq, sk, dtype=torch.bool)
        if attn_bias is not None:
            bias = attn_bias.detach() if bug == "bias_no_gradient" else attn_bias
            if bug == "bias_ninf_to_finfo_min":
                bias = torch.nan_to_num(bias, neginf=torch.finfo(bias.dtype).min)
            seen = seen & (bias > float("-inf"))
            bias = torch.where(bias > float("-inf"), bias, torch.zeros_like(bias)).to(s.dtype)
            s = (s + bias) * scale if bug == "bias_before_scale" else s * scale + bias
        else:
            s = s * scale
        if causal:
            seen = seen & (torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq)
        if attn_mask is not None:
            m = attn_mask
            if bug == "mask_first_head_only":
                m = m[:, :1]
            if bug == "mask_first_batch_only":
                m = m[:1]
            if bug == "mask_after_softmax":
                p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
                return (p * m) @ v
            seen = seen & m
        hidden = torch.finfo(s.dtype).min if bug == "finfo_min_for_hidden" else float("-inf")
        s = s.masked_fill(~seen, hidden)
        top = s.amax(-1, keepdim=True)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # a row that sees nothing: O = 0, not NaN
        p = torch.exp(s - top)
        denom = p.sum(-1, keepdim=True)
        return p @ v / torch.where(denom == 0, torch.ones_like(denom), denom)

    return attention


def _register(name, bug):
    return implementation(name=name, causal="bottom_right", dtypes=("float32", "float64"), devices=("cpu",),
                          backward=True, gqa=True, mask=True, bias=True, register=False)(_kernel(bug))


correct = _register("masks-correct", None)
for _bug in BUGS:
    globals()[_bug] = _register(f"masks-{_bug}", _bug)
