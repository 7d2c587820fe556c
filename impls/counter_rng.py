"""A counter-based random number generator for dropout: the keep decision of score (b, h, i, j)
is a pure function of the seed and that position, so the forward and the backward (and any
tiling of either) draw the same mask without storing it, as FlashAttention's Philox does.

The hash is MurmurHash3's 32-bit finalizer, applied twice, on int64 tensors holding 32-bit
values; products are split into 16-bit halves so no int64 ever overflows.
"""
from __future__ import annotations

import numpy as np
import torch

M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """x * c mod 2^32 for x < 2^32, without overflowing int64."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & M32


def _fmix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform(seed: int, counter):
    """float64 in [0, 1) for each int64 counter (counters below 2^62); a torch tensor or a NumPy array."""
    key = _fmix32((seed & M32) ^ 0x9E3779B9)
    key2 = _fmix32(((seed >> 32) & M32) ^ 0x7F4A7C15)
    x = _fmix32((counter & M32) ^ key)
    x = _fmix32((x + (counter >> 32) + key2) & M32)
    return (x.to(torch.float64) if isinstance(x, torch.Tensor) else x.astype(np.float64)) / 2.0 ** 32


def keep(seed: int, p: float, counter: torch.Tensor) -> torch.Tensor:
    """True where the score at ``counter`` survives dropout with probability p."""
    return uniform(seed, counter) >= p


def position_counter(b: int, h: int, sq: int, sk: int, device=None) -> torch.Tensor:
    """The counter of every position of a (B, H, Sq, Sk) score tensor: ((b * H + h) * Sq + i) * Sk + j."""
    return torch.arange(b * h * sq * sk, device=device, dtype=torch.int64).view(b, h, sq, sk)


def keep_mask(b: int, h: int, sq: int, sk: int, p: float, seed: int, device=None) -> torch.Tensor:
    """The whole (B, H, Sq, Sk) keep mask for dropout probability p and this seed."""
    return keep(seed, p, position_counter(b, h, sq, sk, device))
