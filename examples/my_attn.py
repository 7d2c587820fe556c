"""A small FlashAttention-style kernel in plain torch, as a kernel author's repository holds one.

    pytest --impl my_attn.py:attention -m properties     # or: flashcheck check my_attn.py:attention

The forward walks the keys in blocks of BLOCK_K, keeping a running max ``m`` and a running
sum ``l`` per query row and rescaling what was summed so far whenever the max grows
(online softmax). Backward comes from torch.autograd. It validates its input, as the
contract asks, and runs on CPU and CUDA.
"""
import math

import torch

from flashcheck import implementation

BLOCK_K = 16


def _check(q, k, v):
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError(f"q, k, v must have rank 4 (batch, heads, seq, dim), got {q.ndim}, {k.ndim}, {v.ndim}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}, "
                         f"v {v.shape[1]})")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k has sequence length {k.shape[2]} but v has {v.shape[2]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} differs from k head dim {k.shape[3]}")


@implementation(name="my-attn", causal="bottom_right", dtypes=("float32", "float64"), devices=("cpu", "cuda"),
                backward=True, gqa=True)
def attention(q, k, v, *, causal=False, scale=None):
    _check(q, k, v)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    m = torch.full(q.shape[:3] + (1,), -math.inf, dtype=q.dtype, device=q.device)  # running max
    l = torch.zeros_like(m)  # running sum of exp(s - m)
    acc = torch.zeros(q.shape[:3] + v.shape[-1:], dtype=q.dtype, device=q.device)
    rows = torch.arange(sq, device=q.device)[:, None]
    for start in range(0, sk, BLOCK_K):
        s = scale * q @ k[:, :, start:start + BLOCK_K].transpose(-1, -2)
        if causal:  # bottom-right: query i sees key j iff j <= i + sk - sq
            cols = torch.arange(start, min(start + BLOCK_K, sk), device=q.device)[None, :]
            s = s.masked_fill(cols > rows + sk - sq, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        base = torch.where(torch.isinf(m_new), 0.0, m_new)  # a row that has seen no key yet stays at 0
        p = torch.exp(s - base)
        fade = torch.exp(m - base)  # rescales what was summed against the old max
        l = fade * l + p.sum(-1, keepdim=True)
        acc = fade * acc + p @ v[:, :, start:start + BLOCK_K]
        m = m_new
    # a row that sees no key has l = 0 and must output 0
    return torch.where(l > 0, acc / l.clamp_min(torch.finfo(l.dtype).tiny), 0.0)
