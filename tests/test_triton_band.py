"""impls/triton_fused.py: a band without a right edge (no mask at all, or a window's left edge alone)
gives full attention over the keys it shows, forward and backward, across partial tiles and a GQA group."""
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashcheck.impls import triton_fused as tf  # noqa: E402

pytestmark = pytest.mark.skipif(not tf.INTERPRET, reason="needs TRITON_INTERPRET=1 set before triton is imported")


def _dense(q, k, v, left=None):
    """float64 attention over the keys the band shows (only a left edge, or none)."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sq, sk = s.shape[-2:]
    if left is not None:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j < i + sk - sq - left, -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("left", [None, 5])
def test_a_band_without_a_right_edge_gives_full_attention_forward_and_backward(left):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 33, 16, requires_grad=True)  # GQA, several tiles each way, partial last tiles
    k, v = torch.randn(2, 2, 47, 16, requires_grad=True), torch.randn(2, 2, 47, 16, requires_grad=True)
    o, lse = tf.flash_attention(q, k, v, window=None if left is None else (left, -1), block_q=16, block_k=32)
    want_o, want_lse = _dense(q, k, v, left)
    do = torch.randn_like(o)
    got = (o, lse, *torch.autograd.grad(o, (q, k, v), do))
    want = (want_o, want_lse, *torch.autograd.grad(want_o, (q, k, v), do.double()))
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), got, want):
        err = (a.double() - b).abs().max().item()
        assert err < 1e-5, f"{name}: largest error {err:.3g} against float64 attention, expected < 1e-5"


@pytest.mark.parametrize("causal, window, d, features", [
    (False, None, 16, {}), (False, None, 5, {}), ("top_left", None, 16, {}), ("bottom_right", None, 5, {}),
    (False, (5, -1), 16, {}), (False, (3, 2), 5, {}), ("top_left", (4, 9), 16, {}), ("bottom_right", (6, -1), 16, {}),
    ("bottom_right", None, 96, {}),  # D_PAD 128: float32 there takes the general build on a GPU too
    ("bottom_right", None, 16, dict(softcap=2.5)), (False, (4, 9), 5, dict(alibi=True)),
    ("top_left", None, 16, dict(softcap=0.7, alibi=True))])
def test_the_general_build_gives_the_specialized_builds_results(causal, window, d, features):
    """Small calls on a GPU run the general build (tf.GENERAL_SCORES): the band always on, ALiBi always on,
    the softcap decided at run time, one masked loop, the head dims' columns masked. Both edges, slopes
    of 0, a cap of 0 and the padding left off must change nothing; a softcap or ALiBi asked for must act."""
    torch.manual_seed(1)
    q = torch.randn(1, 4, 33, d, requires_grad=True)  # GQA, several tiles each way, partial last tiles
    k, v = torch.randn(1, 2, 47, d, requires_grad=True), torch.randn(1, 2, 47, d, requires_grad=True)
    do = torch.randn(1, 4, 33, d)
    features = dict(features)
    if features.pop("alibi", False):
        features["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out = {}
    for general in (False, True):
        o, lse = tf.flash_attention(q, k, v, causal=causal, window=window, block_q=16, block_k=32, general=general,
                                    **features)
        out[general] = (o, lse, *torch.autograd.grad(o, (q, k, v), do))
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), out[True], out[False]):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a)), f"{name}: the general build's infinities differ"
        err = (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
        assert err < 1e-5, f"{name}: the general build differs from the specialized one by {err:.3g}, expected < 1e-5"
