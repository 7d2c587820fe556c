"""Deliberately broken kernels that read their inputs as a raw-pointer kernel does, trusting a
layout the caller never promised (docs/mutants.md). The suite lays inputs out in every way
flashcheck/contract/memory.py names: transposed BSHD views, rows padded with NaN, storage
offsets, stride-0 broadcast dimensions.

The kernel is dense attention in its own dtype, with autograd for the backward. ``bug=None`` is
the correct kernel. Each mutant is a plug-in, ``mutants/strides.py:<name>``.
"""
from __future__ import annotations

import math

import torch

from flashcheck.contract import implementation
from flashcheck.contract.checks import check_inputs

# On CUDA too where there is one (the gpu lane kills them there: a strided read or an unwritten row
# of memory the caching allocator recycles is a GPU kernel's bug first)
DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)

BUGS = {
    "assumes_contiguous_strides": "reads q, k, v from their storage with contiguous (B, H, S, D) strides",
    "ignores_storage_offset": "reads q, k, v from the start of their storage, not their first element",
    # memory the kernel allocates itself: torch.empty is often zeros on a fresh page, the right O by luck
    "leaves_unseen_rows_unwritten": "returns O in a torch.empty buffer whose rows that see no key it never writes",
    # an unmasked tile load: the key past the end is read, its score hidden, and 0 x what lies there kept
    "reads_one_key_past_the_end": "loads one key and value row past Sk from storage and masks only its score",
}


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _read(x, bug):
    if bug == "assumes_contiguous_strides":
        return torch.as_strided(x, x.shape, _contiguous_strides(x.shape), x.storage_offset())
    if bug == "ignores_storage_offset":
        return torch.as_strided(x, x.shape, x.stride(), 0)
    return x


def _one_row_more(x):
    """x (B, H, S, D) with row S too, read from the storage as a raw pointer would: the next head's first
    row, a padded row, or the margin past S. Where the storage ends there, x as it is (torch refuses)."""
    shape = (*x.shape[:2], x.shape[2] + 1, x.shape[3])
    last = x.storage_offset() + sum((n - 1) * st for n, st in zip(shape, x.stride()))
    if last >= x.untyped_storage().nbytes() // x.element_size():
        return x
    return torch.as_strided(x, shape, x.stride(), x.storage_offset())


def _kernel(bug):
    def attention(q, k, v, *, causal=False, scale=None):
        check_inputs(q, k, v, dtypes=("float32", "float64"), who="mutant")
        q, k, v = (_read(x, bug) for x in (q, k, v))
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        sk = k.shape[2]
        if bug == "reads_one_key_past_the_end":
            k, v = _one_row_more(k), _one_row_more(v)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = scale * q @ k.transpose(-1, -2)
        s[..., sk:] = float("-inf")  # the key past the end, if read, is hidden: its P is 0, and 0 x NaN is NaN
        if causal:
            sq = q.shape[2]
            i = torch.arange(sq, device=q.device)[:, None]
            j = torch.arange(s.shape[-1], device=q.device)[None, :]
            s = s.masked_fill(j > i + sk - sq, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row that sees nothing: O = 0, not NaN
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        o = p @ v / torch.where(denom == 0, torch.ones_like(denom), denom)
        if bug == "leaves_unseen_rows_unwritten":
            return torch.where(denom > 0, o, torch.empty(o.shape, dtype=o.dtype, device=o.device))
        return o

    return attention


def _register(name, bug):
    return implementation(name=name, causal="bottom_right", dtypes=("float32", "float64"), devices=DEVICES,
                          backward=True, gqa=True, register=False)(_kernel(bug))


correct = _register("strides-correct", None)
for _bug in BUGS:
    globals()[_bug] = _register(f"strides-{_bug}", _bug)
