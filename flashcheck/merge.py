"""Merging attention over two sets of keys through their log-sum-exps: the step split-KV kernels
(flash-decoding), ring attention and cascade inference take after attending over each chunk.

Attention over keys K_a and K_b together is a weighted sum of the attention over each:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

with the natural-log LSE of the dense contract. A row that sees no key in a chunk has lse = -inf
there, and that chunk's o (0 by the contract) gets weight 0; a row that sees no key in either
gives o = 0 and lse = -inf, never NaN. The weights are formed from the larger of the two LSEs,
so neither exponential overflows.

Kernel authors can check their own merge against this one; the property suite uses it to merge
a kernel's results over two halves of the keys.
"""
from __future__ import annotations

import numpy as np


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """(o, lse) of attention over the keys of both states.

    ``o_*``: (..., S, Dv); ``lse_*``: (..., S), natural log. NumPy arrays or torch tensors (both
    of one kind). The result has o_a's type and dtype; the arithmetic runs in float64 for float64
    inputs, else in float32, as the LSEs are kept.
    """
    _check(o_a, lse_a, o_b, lse_b)
    xp = _namespace(o_a)
    if xp is np:
        o_a, lse_a, o_b, lse_b = map(np.asarray, (o_a, lse_a, o_b, lse_b))
    wide = xp.float64 in (o_a.dtype, o_b.dtype, lse_a.dtype, lse_b.dtype)
    work = xp.float64 if wide else xp.float32
    return merge_splits(xp.stack([_to(o_a, work), _to(o_b, work)]), xp.stack([_to(lse_a, work), _to(lse_b, work)]),
                        dtype=o_a.dtype)


def merge_splits(o, lse, *, dtype=None):
    """(o, lse) of attention over the keys of N states at once, as a split-KV kernel's combine step
    does: ``o`` (N, ..., S, Dv), ``lse`` (N, ..., S).

    One pass, from the largest LSE of each row, rounds the merged LSE once. Merging N states two
    at a time rounds it N - 1 times instead, and at many splits that alone can pass the oracle's
    bound for a single kernel (tests/test_merge.py measures both).
    """
    xp = _namespace(o)
    if xp is np:
        o, lse = np.asarray(o), np.asarray(lse)
    work = xp.float64 if xp.float64 in (o.dtype, lse.dtype) else xp.float32
    if o.shape[:-1] != lse.shape or o.ndim < 3:
        raise ValueError(f"merge_splits: expected o (N, ..., S, Dv) and lse (N, ..., S), got o {tuple(o.shape)} "
                         f"and lse {tuple(lse.shape)}")
    ls = _to(lse, work)
    m = ls.max(0) if xp is np else ls.amax(0)  # NaN stays NaN: a NaN LSE is never merged away
    empty = m == -float("inf")  # -inf in every state: the row sees no key at all
    m0 = xp.where(empty, 0.0, m)
    w = xp.exp(ls - m0)  # at most 1; exp(-inf) = 0 for an empty state
    total = xp.where(empty, 1.0, w.sum(0))
    merged = xp.where(empty, -float("inf"), m0 + xp.log(total))
    scale = xp.where(empty, 0.0, 1.0 / total)
    out = ((w * scale)[..., None] * _to(o, work)).sum(0)
    return _to(out, o.dtype if dtype is None else dtype), merged


def _to(x, dtype):
    return x.astype(dtype) if isinstance(x, np.ndarray) else x.to(dtype)


def _namespace(x):
    if type(x).__module__.startswith("torch"):
        import torch

        return torch
    return np


def _check(o_a, lse_a, o_b, lse_b):
    kinds = {type(x).__module__.split(".")[0] for x in (o_a, lse_a, o_b, lse_b)}
    if len(kinds) > 1:
        raise TypeError(f"merge_attention_states: expected four NumPy arrays or four torch tensors, got {sorted(kinds)}")
    shapes = [tuple(x.shape) for x in (o_a, lse_a, o_b, lse_b)]
    if shapes[0] != shapes[2] or shapes[1] != shapes[3]:
        raise ValueError(f"merge_attention_states: the two states differ in shape: o {shapes[0]} and {shapes[2]}, "
                         f"lse {shapes[1]} and {shapes[3]}")
    if len(shapes[0]) < 2 or shapes[0][:-1] != shapes[1]:
        raise ValueError(f"merge_attention_states: expected o (..., S, Dv) and lse (..., S), got o {shapes[0]} "
                         f"and lse {shapes[1]}")
