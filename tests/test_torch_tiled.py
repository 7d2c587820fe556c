"""torch tiled only: its custom autograd.Function against torch.autograd.gradcheck, and double backward.

The suite's shared properties already hold torch-tiled to the float64 oracle; these check the
hand-written backward directly against finite differences of the forward, through autograd's
own machinery, on shapes chosen to cover every branch of the tile loops.
"""
import pytest
import torch

from flashcheck.impls.torch_tiled import attention

pytestmark = pytest.mark.properties

# (B, Hq, Hkv, Sq, Sk, D, Dv), causal, (block_q, block_k), scale
CASES = [
    pytest.param((1, 2, 2, 5, 5, 4, 4), False, (2, 3), None, id="plain-partial-tiles"),
    pytest.param((2, 4, 2, 6, 7, 3, 5), False, (4, 2), 0.7, id="gqa-dv-ne-d"),
    pytest.param((1, 3, 1, 4, 6, 2, 2), "top_left", (3, 2), None, id="mqa-causal-top-left"),
    pytest.param((1, 2, 1, 6, 4, 3, 2), "bottom_right", (2, 2), None, id="masked-rows-bottom-right"),
    pytest.param((1, 1, 1, 7, 3, 2, 3), "bottom_right", (8, 1), -1.3, id="masked-rows-one-tile"),
    pytest.param((1, 2, 2, 3, 8, 4, 4), "top_left", (1, 3), 0.0, id="zero-scale-causal"),
    pytest.param((1, 1, 1, 1, 1, 1, 1), "bottom_right", (1, 1), None, id="one-by-one"),
]


def _inputs(shape, seed=0):
    b, hq, hkv, sq, sk, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, dv)


@pytest.mark.parametrize("shape, causal, blocks, scale", CASES)
def test_backward_passes_gradcheck(shape, causal, blocks, scale):
    q, k, v = _inputs(shape)
    bq, bk = blocks

    def f(q, k, v):
        return attention(q, k, v, causal=causal, scale=scale, block_q=bq, block_k=bk)[0]

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_fully_masked_rows_have_zero_output_and_gradients():
    # Sq = 6 > Sk = 4 with bottom-right causal: rows 0 and 1 see no key.
    q, k, v = (x.detach().float().requires_grad_() for x in _inputs((1, 2, 1, 6, 4, 3, 2)))
    o, lse = attention(q, k, v, causal="bottom_right", block_q=2, block_k=2)
    assert torch.equal(o[:, :, :2], torch.zeros_like(o[:, :, :2]))
    assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    o.backward(torch.randn_like(o))
    assert torch.equal(q.grad[:, :, :2], torch.zeros_like(q.grad[:, :, :2]))
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_double_backward_raises_a_clear_error():
    q, k, v = _inputs((1, 2, 1, 4, 5, 3, 3))
    o, _ = attention(q, k, v, causal=True, block_q=2, block_k=2)
    (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


def test_lse_is_not_differentiable():
    q, k, v = _inputs((1, 1, 1, 3, 3, 2, 2))
    o, lse = attention(q, k, v)
    assert o.requires_grad and not lse.requires_grad
