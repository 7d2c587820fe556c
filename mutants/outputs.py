"""Deliberately broken kernels that take out= (docs/mutants.md): the suite hands them a view inside a
buffer with guard bands on both sides and checks that nothing past the view changed, and that the
view is what comes back.

The kernel is dense attention in its own dtype, written into out, forward only (inference kernels
are the ones that take out=).
``bug=None`` is the correct kernel. Each mutant is a plug-in, ``mutants/outputs.py:<name>``.
"""
from __future__ import annotations

import math

import torch

from flashcheck.contract import implementation
from flashcheck.contract.checks import check_inputs

DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)  # the gpu lane kills them on CUDA

BUGS = {
    "writes_one_row_past_out": "writes O, then its last row once more one row past the end of out",
    "writes_before_out": "writes its first row one row before the start of out as well",
    "returns_a_new_tensor": "computes O into a tensor of its own and returns that, leaving out unwritten",
}


def _dense(q, k, v, causal, scale):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        j, i = torch.arange(sk, device=q.device)[None, :], torch.arange(sq, device=q.device)[:, None]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    denom = p.sum(-1, keepdim=True)
    return p @ v / torch.where(denom == 0, torch.ones_like(denom), denom)


def _kernel(bug):
    def attention(q, k, v, *, causal=False, scale=None, out=None):
        check_inputs(q, k, v, dtypes=("float32", "float64"), who="mutant")
        o = _dense(q, k, v, causal, scale)
        if out is None or bug == "returns_a_new_tensor":
            return o
        with torch.no_grad():
            out.copy_(o)
            row = out.shape[-1]
            flat = out.as_strided((out.numel() + 2 * row,), (1,), out.storage_offset() - row)
            if bug == "writes_one_row_past_out":
                flat[-row:] = o[-1, -1, -1]
            if bug == "writes_before_out":
                flat[:row] = o[0, 0, 0]
        return out

    return attention


def _register(name, bug):
    return implementation(name=name, causal="bottom_right", dtypes=("float32", "float64"), devices=DEVICES,
                          gqa=True, out=True, register=False)(_kernel(bug))


correct = _register("outputs-correct", None)
for _bug in BUGS:
    globals()[_bug] = _register(f"outputs-{_bug}", _bug)
