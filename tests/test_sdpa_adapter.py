"""The SDPA built-ins' input adaptations (impls/sdpa.py) add no rounding of their own.

An adaptation that is exact in real arithmetic can still round where the backend does not: two
calls whose gradients each round to the input type, then add. The oracle holds the built-in to
the kernel's rounding, so such an adaptation is a false alarm waiting for the right case. These
run the math backend in bfloat16 on the CPU (float32 inside, outputs rounded to bfloat16).
"""
import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend

from flashcheck.impls import sdpa
from flashcheck.strategies import AttentionCase

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run(q, k, v, do, **adapt):
    """O and the gradients of one adapted call, as float64 arrays."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = sdpa.call_sdpa(*leaves, backend=SDPBackend.MATH, scale=None, **adapt)
    o.backward(do)
    return [x.double().numpy() for x in (o.detach(), *(t.grad for t in leaves))]


@pytest.mark.parametrize("causal", [False, True])
def test_one_key_doubled_gives_the_single_key_results_bit_for_bit(causal):
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, n, 8, generator=gen).to(torch.bfloat16) for n in (37, 1, 1, 37))
    single = _run(q, k, v, do, causal=causal)
    doubled = _run(q, k, v, do, causal=causal, min_keys=2)
    for name, want, got in zip(("O", "dQ", "dK", "dV"), single, doubled):
        worst = np.abs(got - want).max()
        assert worst == 0, f"{name} of the doubled key should equal the single key's bit for bit; differs by {worst:.3e}"


def test_causal_with_more_queries_than_keys_is_refused_not_split():
    q, k, v = (torch.randn(1, 1, n, 8, dtype=torch.bfloat16) for n in (5, 3, 3))
    with pytest.raises(ValueError, match="only when Sq == Sk"):
        sdpa.call_sdpa(q, k, v, backend=SDPBackend.MATH, causal=True, scale=None, square_causal=True)
    wide = sdpa.call_sdpa(q[:, :, :2], k, v, backend=SDPBackend.MATH, causal=True, scale=None, square_causal=True)
    assert wide.shape == (1, 1, 2, 8), f"Sq < Sk is sliced to a square call; got shape {tuple(wide.shape)}"
    assert sdpa.square_causal_only(AttentionCase(sq=5, sk=3, causal="top_left")) == sdpa.SQUARE_CAUSAL
    assert sdpa.square_causal_only(AttentionCase(sq=5, sk=3)) is True
    assert sdpa.square_causal_only(AttentionCase(sq=3, sk=5, causal="top_left")) is True
