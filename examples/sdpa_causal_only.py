"""A kernel that supports only part of the problem, declared as such: torch SDPA's math backend
standing in for a causal-only kernel with a few head dims and square, not-too-short sequences.

    pytest -m properties --impl examples/sdpa_causal_only.py:attention

Every declaration narrows what the suite draws for it; a property it cannot run at all
(rows that see no key, the non-causal invariances, the LSE) is skipped with the reason.
``deterministic=True`` adds the check that repeated calls agree bit for bit.
"""
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcheck import implementation
from flashcheck.contract.checks import check_inputs

DTYPES = ("float32", "float64")


@implementation(name="sdpa-causal-only", causal="top_left", causal_only=True, head_dims={16, 32, 64}, min_seq=16,
                equal_lengths=True, deterministic=True, dtypes=DTYPES, devices=("cpu",),
                backward=True, gqa=True, lse=False)
def attention(q, k, v, *, causal=True, scale=None):
    check_inputs(q, k, v, dtypes=DTYPES, who="sdpa-causal-only")  # SDPA itself broadcasts a batch of 1
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
