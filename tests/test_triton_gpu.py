"""Reliability of the Triton kernels on a CUDA GPU (marker ``gpu``; skipped without CUDA).

- bitwise determinism of forward and backward over repeated runs at batch * heads >= 64;
- output buffers poisoned with NaN before the call are fully overwritten (every kernel is handed
  NaN-filled output buffers through the launchers' out= hook);
- values stored past Sk / Sq / D in a longer buffer that is sliced down (filled with NaN)
  never leak into the results, forward or gradients.
compute-sanitizer (memcheck, racecheck) runs through bench/sanitize.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA, which this machine lacks")]

from flashcheck.oracle.rounding import HALF as DTYPES  # noqa: E402


def _tf():
    from flashcheck.impls import triton_fused
    if triton_fused.INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 runs the kernels on CPU tensors")
    return triton_fused


def _inputs(b, hq, hkv, sq, sk, d, dv, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float32).to(dt)  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, dv), mk(b, hq, sq, dv)


def _run(tf, q, k, v, do, **kw):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o, lse = tf.attention(q, k, v, **kw)
    o.backward(do)
    torch.cuda.synchronize()
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def _dense64(q, k, v, do, causal, scale):
    from flashcheck.oracle import reference
    qn, kn, vn, don = (x.double().cpu().numpy() for x in (q, k, v, do))
    o, lse = reference.dense_forward(qn, kn, vn, causal=causal, scale=scale)
    return (o, lse) + reference.dense_backward(qn, kn, vn, o, lse, don, causal=causal, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_forward_and_backward_are_bitwise_deterministic(dtype, causal):
    tf = _tf()
    # batch * heads = 4 * 16 = 64 query heads over 4 kv heads (GQA); ragged lengths
    q, k, v, do = _inputs(4, 16, 4, 777, 1000, 64, 64, dtype)
    first = _run(tf, q, k, v, do, causal=causal)
    for _ in range(4):
        again = _run(tf, q, k, v, do, causal=causal)
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between identical runs"


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", ["bottom_right", "top_left", False])
@pytest.mark.parametrize("dims", [(2, 4, 2, 300, 130, 40, 24), (1, 2, 1, 77, 200, 128, 128),
                                  (1, 3, 3, 129, 129, 64, 16)])
def test_nan_poisoned_output_buffers_are_fully_overwritten(dtype, causal, dims):
    """Every kernel writes every element of its outputs: O, LSE, delta, dQ, dK, dV start as NaN."""
    tf = _tf()
    b, hq, hkv, sq, sk, d, dv = dims  # first: Sq > Sk, so bottom-right has rows that see no key
    q, k, v, do = _inputs(b, hq, hkv, sq, sk, d, dv, dtype, seed=1)
    align = tf.alignment(causal)
    scale = 1 / math.sqrt(d)
    cfg = lambda: tf._config(None, None, tf._pad(max(d, dv)))  # noqa: E731
    o, lse = _nan((b, hq, sq, dv), q.dtype), _nan((b, hq, sq), torch.float32)
    tf._forward(q, k, v, align, scale, "ieee", cfg(), out=(o, lse))
    torch.cuda.synchronize()
    assert not torch.isnan(o).any(), "forward left NaN in O"
    assert not torch.isnan(lse).any(), "forward left NaN in LSE"
    ref = _run(tf, q, k, v, do, causal=causal)
    assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1])
    bufs = (_nan((b, hq, sq), torch.float32), _nan(q.shape, q.dtype), _nan(k.shape, k.dtype), _nan(v.shape, v.dtype))
    tf._backward(do, q, k, v, o, lse, align, scale, "ieee", cfg(), out=bufs)
    torch.cuda.synchronize()
    for name, x in zip(("delta", "dq", "dk", "dv"), bufs):
        assert not torch.isnan(x).any(), f"backward left NaN in {name}"
    for name, x, r in zip(("dq", "dk", "dv"), bufs[1:], ref[2:]):
        assert torch.equal(x, r), f"{name} differs from the autograd path"
    if causal == "bottom_right" and sq > sk:
        hidden = torch.arange(sq, device="cuda") < sq - sk
        assert torch.all(o[:, :, hidden] == 0) and torch.all(lse[:, :, hidden] == -math.inf)


def _padded(x, extra_rows, extra_cols, fill=float("nan")):
    """x as a view into a longer, wider buffer filled with ``fill`` (same values, non-contiguous strides)."""
    b, h, s, d = x.shape
    buf = torch.full((b, h, s + extra_rows, d + extra_cols), fill, device=x.device, dtype=x.dtype)
    buf[:, :, :s, :d] = x
    return buf[:, :, :s, :d]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("dims", [(1, 4, 1, 100, 77, 40, 40), (2, 2, 2, 129, 255, 64, 64),
                                  (1, 2, 1, 64, 64, 128, 96)])
def test_values_past_the_sliced_length_never_leak(dtype, causal, dims):
    tf = _tf()
    q, k, v, do = _inputs(*dims, dtype, seed=2)
    # the reference reads the same strides (so the same compiled kernel) with zeros past the slice
    ref = _run(tf, *(_padded(x, 37, 8, 0.0) for x in (q, k, v, do)), causal=causal)
    qs, ks, vs, dos = (_padded(x, 37, 8) for x in (q, k, v, do))
    assert not ks.is_contiguous()
    got = _run(tf, qs, ks, vs, dos, causal=causal)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), ref, got):
        assert not torch.isnan(b).any(), f"NaN from the padded buffer leaked into {name}"
        assert torch.equal(a, b), f"{name} differs between contiguous and sliced inputs"
    # and the result is right against float64 dense attention
    truth = _dense64(q, k, v, do, causal, None)
    for name, a, t in zip(("o", "lse", "dq", "dk", "dv"), got, truth):
        a = a.double().cpu().numpy()
        fin = np.isfinite(t)
        assert np.array_equal(np.isfinite(a), fin), name
        err = np.abs(a[fin] - t[fin]).max() / max(1.0, np.abs(t[fin]).max()) if fin.any() else 0.0
        assert err < 3e-2, f"{name}: relative error {err:.2e}"


def test_float32_ieee_matches_float64_tightly():
    tf = _tf()
    q, k, v, do = _inputs(1, 4, 2, 200, 333, 72, 72, "float32", seed=3)
    got = _run(tf, q, k, v, do, causal="bottom_right")
    truth = _dense64(q, k, v, do, "bottom_right", None)
    for name, a, t in zip(("o", "lse", "dq", "dk", "dv"), got, truth):
        a = a.double().cpu().numpy()
        fin = np.isfinite(t)
        err = np.abs(a[fin] - t[fin]).max() / max(1.0, np.abs(t[fin]).max())
        assert err < 1e-5, f"{name}: IEEE float32 relative error {err:.2e}"
