"""A plug-in for torch's scaled_dot_product_attention, exactly as a kernel author writes one.

    pytest -m properties --impl examples/sdpa_plugin.py:attention

SDPA's is_causal is top-left aligned, so that is what it declares; it returns no LSE.
Backward runs through torch.autograd.
"""
import torch.nn.functional as F

from flashcheck import KnownIssue, implementation

# Found by this suite on torch 2.13 (CPU flash backend): declared so the rest of the space
# keeps being tested, and checked by properties/test_known_issues.py so a fix is noticed.
ZERO_SCALE_CAUSAL = KnownIssue(
    "causal attention with scale=0.0 returns NaN on the CPU flash backend",
    applies=lambda case: case.causal is not None and case.scale == 0.0,
    witness=dict(sq=1, sk=2, causal="top_left", scale=0.0),
    failure=r"got \S*nan",  # what the oracle reports at the witness: the issue, not some other failure
)


@implementation(name="sdpa-plugin", causal="top_left", dtypes=("float32", "float64"), devices=("cpu", "cuda"),
                backward=True, gqa=True, lse=False, known_issues=[ZERO_SCALE_CAUSAL])
def attention(q, k, v, *, causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
