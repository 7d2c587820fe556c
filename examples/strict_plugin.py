"""A kernel that raises whenever it is called outside its declaration, so a run of the suite
proves that the suite never asks it for anything it did not declare.

    pytest -m properties --impl examples/strict_plugin.py:attention

It declares the rest of the contract's keywords: no ``scale=`` argument (``scale_arg=False``),
head dims from a range with a step, lengths between ``min_seq`` and ``max_seq``, no GQA, and a
``supports`` predicate for a limit no keyword expresses (here: non-causal calls need an even
number of keys). The attention itself is torch SDPA's math backend with a bottom-right mask.
"""
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcheck import implementation

DTYPES = (torch.float32, torch.float64)
HEAD_DIMS = range(8, 65, 8)
MIN_SEQ, MAX_SEQ = 2, 24


def even_keys_unless_causal(case):
    return case.causal is not None or case.sk % 2 == 0 or "non-causal calls need an even number of keys"


def _refuse_undeclared(q, k, v, causal):
    for label, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"strict: {label} must be a rank 4 tensor (batch, heads, seq, dim)")
        if x.dtype not in DTYPES or x.device.type != "cpu":
            raise TypeError(f"strict: {label} has dtype {x.dtype} on {x.device}; declared: float32/float64 on cpu")
    (b, hq, sq, d), (bk, hk, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    if not (b == bk == bv) or not (hq == hk == hv):
        raise ValueError(f"strict: batch and heads must match (no GQA declared): q {q.shape}, k {k.shape}, v {v.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"strict: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if sk != sv or dk != d:
        raise ValueError(f"strict: k {k.shape} does not match q {q.shape} and v {v.shape}")
    if d not in HEAD_DIMS or dv not in HEAD_DIMS:
        raise ValueError(f"strict: head dims D={d}, Dv={dv} outside the declared {HEAD_DIMS}")
    if not (MIN_SEQ <= sq <= MAX_SEQ and MIN_SEQ <= sk <= MAX_SEQ):
        raise ValueError(f"strict: lengths Sq={sq}, Sk={sk} outside the declared [{MIN_SEQ}, {MAX_SEQ}]")
    if not causal and sk % 2:
        raise ValueError(f"strict: non-causal calls need an even number of keys, got Sk={sk}")
    if causal not in (False, True):
        raise ValueError(f"strict: causal must be a bool, got {causal!r}")


@implementation(name="strict", causal="bottom_right", dtypes=("float32", "float64"), devices=("cpu",), backward=True,
                gqa=False, lse=True, head_dims=HEAD_DIMS, min_seq=MIN_SEQ, max_seq=MAX_SEQ,
                supports=even_keys_unless_causal, scale_arg=False)
def attention(q, k, v, *, causal=False):
    _refuse_undeclared(q, k, v, causal)
    sq, sk = q.shape[2], k.shape[2]
    # bottom-right: query i sees key j iff j <= i + Sk - Sq; a row that sees no key gives 0
    seen = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
    scores = (q @ k.transpose(-1, -2)).detach() / math.sqrt(q.shape[-1])
    if seen is not None:
        scores = scores.masked_fill(~seen, -math.inf)
    return o, torch.logsumexp(scores, dim=-1)
