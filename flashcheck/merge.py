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
    if type(o_a).__module__.startswith("torch"):
        import torch as xp

        wide = xp.float64 in (o_a.dtype, o_b.dtype, lse_a.dtype, lse_b.dtype)
        work, to = (xp.float64 if wide else xp.float32), (lambda x, t: x.to(t))
    else:
        xp = np
        o_a, lse_a, o_b, lse_b = map(np.asarray, (o_a, lse_a, o_b, lse_b))
        wide = np.float64 in (o_a.dtype, o_b.dtype, lse_a.dtype, lse_b.dtype)
        work, to = (np.float64 if wide else np.float32), (lambda x, t: x.astype(t))
    la, lb = to(lse_a, work), to(lse_b, work)
    m = xp.maximum(la, lb)  # NaN stays NaN: a NaN LSE is never merged away
    empty = m == -float("inf")  # -inf on both sides: the row sees no key at all
    m0 = xp.where(empty, 0.0, m)
    wa, wb = xp.exp(la - m0), xp.exp(lb - m0)  # at most 1; exp(-inf) = 0 for an empty side
    total = xp.where(empty, 1.0, wa + wb)
    lse = xp.where(empty, -float("inf"), m0 + xp.log(total))
    scale = xp.where(empty, 0.0, 1.0 / total)
    o = (wa * scale)[..., None] * to(o_a, work) + (wb * scale)[..., None] * to(o_b, work)
    return to(o, o_a.dtype), to(lse, work)


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
