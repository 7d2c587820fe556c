"""JAX's attention kernels as built-ins, fed torch tensors through DLPack (zero copy).

| name | what | devices | dtypes | limits |
|---|---|---|---|---|
| jax-xla | jax.nn.dot_product_attention(implementation="xla") | cpu, cuda | float64, float32, bfloat16 (+ float16 on cuda) | Dv == D |
| jax-cudnn | jax.nn.dot_product_attention(implementation="cudnn") | cuda | float16, bfloat16 | Dv == D, a multiple of 8, <= 128 (256 from sm90) |
| jax-pallas | jax.experimental.pallas.ops.gpu.attention.mha (Triton) | cuda | float16, bfloat16, float32 | Dv == D, Hq == Hkv, lengths <= 128 or multiples of 128 |

What the sources say (jax 0.10-0.11), and the declarations that follow:
- Layout: JAX takes (B, S, H, D); flashcheck's (B, H, S, D) is transposed inside the jitted call.
- Causal: the XLA path masks with tril(ones(Sq, Sk)), Pallas with ``q_pos >= k_pos``, cuDNN with its
  CAUSAL mask: all top-left aligned (query i sees key j iff j <= i), so causal=("top_left",). The
  bottom-right alignment, the window (its ``local_window_size`` is centred on the top-left diagonal)
  and the sequence lengths are not wrapped yet.
- GQA: the XLA and cuDNN paths take fewer key/value heads; Pallas's grid indexes K and V by the
  query head, so it needs Hq == Hkv.
- LSE: Pallas's residual is float32 in base 2 (m + log2 l of log2(e)-scaled scores) and is
  converted here to the natural log. dot_product_attention's residual is cast to the input type
  (fp16/bf16 for every cuDNN call), so those two declare lse=False.
- float16 on XLA:CPU: jax asks for the F16_F16_F32 dot algorithm, which XLA:CPU rejects under jit
  ("The precision 'F16_F16_F32' is not supported by dot_general on CPU"), for every shape; jax's
  own fall-back only catches it outside jit. Not declared on the CPU.
- Precision: see PRECISION below; none of today's declarable precisions is exact for these
  kernels (the lead's catalogue of rounding sites will name them).

Backward: jax.vjp of the same jitted function, wired into torch.autograd (``_JaxAttention``).
Without jax the module fails to import and the three names are unavailable with that reason
(impls/builtin.py); without CUDA (torch's and jax's both) the two GPU kernels are unavailable.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from flashcheck.impls import implementation
from flashcheck.impls.checks import alignment, check_inputs

# JAX grabs 75% of the GPU's memory at its first CUDA call unless told not to, which would
# starve torch and the suite's other kernels in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:
    raise ImportError(f"flashcheck.impls.jax_attn needs jax (pip install 'jax[cpu]', or jax[cuda12]): {exc}") from exc

NAMES = ("jax-xla", "jax-cudnn", "jax-pallas")
UNAVAILABLE: dict[str, str] = {}


def _jax_has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # "Unknown backend gpu" / no CUDA plug-in
        return False


_CUDA = torch.cuda.is_available() and _jax_has_gpu()


def _x64(dtype):
    """float64 needs jax's x64 mode, or DLPack silently hands back float32; only then, so the other
    dtypes trace exactly as in a user's default jax."""
    return jax.enable_x64(dtype == torch.float64)


def _to_jax(t: torch.Tensor):
    # DLPack refuses a tensor that requires grad, and jax takes compact strides only.
    return jax.dlpack.from_dlpack(t.detach().contiguous())


def _to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


class _JaxAttention(torch.autograd.Function):
    """O (and an LSE, which carries no gradient) from a jitted JAX function; the backward calls
    jax.vjp of that same function on the saved inputs."""

    @staticmethod
    def forward(ctx, q, k, v, fwd, bwd):
        ctx.save_for_backward(q, k, v)
        ctx.bwd = bwd
        with _x64(q.dtype):
            out = fwd(*map(_to_jax, (q, k, v)))
        o, lse = out if isinstance(out, tuple) else (out, None)
        if lse is None:
            return _to_torch(o)
        lse = _to_torch(lse)
        ctx.mark_non_differentiable(lse)
        return _to_torch(o), lse

    @staticmethod
    def backward(ctx, do, *_):  # an LSE's gradient, if any, is not supported (marked non-differentiable)
        q, k, v = ctx.saved_tensors
        with _x64(q.dtype):
            grads = ctx.bwd(*map(_to_jax, (q, k, v, do)))
        return (*map(_to_torch, grads), None, None)


def _bhsd(f):
    """f on JAX's (B, S, H, D) layout -> the same function on flashcheck's (B, H, S, D)."""
    def g(q, k, v):
        out = f(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)))
        if isinstance(out, tuple):  # (o, lse (B, H, S))
            return jnp.swapaxes(out[0], 1, 2), out[1]
        return jnp.swapaxes(out, 1, 2)
    return g


@functools.lru_cache(maxsize=None)
def _compiled(core, causal: bool, scale: float):
    """The jitted forward and the jitted vjp for one (kernel, causal, scale); jax caches per shape."""
    f = _bhsd(functools.partial(core, causal=causal, scale=scale))

    def o_only(q, k, v):
        out = f(q, k, v)
        return out[0] if isinstance(out, tuple) else out

    def vjp(q, k, v, do):
        return jax.vjp(o_only, q, k, v)[1](do)

    return jax.jit(f), jax.jit(vjp)


def _register(name, core, *, devices, dtypes, gqa, lse, head_dims, precision, known_issues=(), supports=None,
              tags=()):
    who = name

    def attention(q, k, v, *, causal=False, scale=None):
        for label, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{who}: {label} must be a torch.Tensor, got {type(x).__name__}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"{who}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
        if q.device.type not in devices:
            raise ValueError(f"{who}: unsupported device {q.device}; supported: {', '.join(devices)}")
        _, hq, hkv, _, _, d, dv = check_inputs(q, k, v, dtypes=dtypes, who=who)
        if hq != hkv and not gqa:
            raise ValueError(f"{who}: no GQA; Hq must equal Hkv, got {hq} and {hkv}")
        if d != dv:
            raise ValueError(f"{who}: jax needs Dv == D (value shaped like key), got D={d}, Dv={dv}")
        if isinstance(head_dims, frozenset) and d not in head_dims:
            raise ValueError(f"{who}: head dim {d} not supported; supported: {min(head_dims)}..{max(head_dims)} "
                             "in steps of 8")
        if isinstance(head_dims, tuple) and not head_dims[0] <= d <= head_dims[1]:
            raise ValueError(f"{who}: head dim {d} outside the supported range {list(head_dims)}")
        if causal not in (False, None, True, "top_left"):
            alignment(causal)  # names a malformed value
            raise ValueError(f"{who}: JAX's causal mask is top-left aligned; {causal!r} is not supported")
        if supports is not None:
            from flashcheck.strategies import AttentionCase  # only the shape matters here

            why = supports(AttentionCase(sq=q.shape[2], sk=k.shape[2], d=d, dv=dv))
            if isinstance(why, str):
                raise ValueError(f"{who}: {why}")
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        fwd, bwd = _compiled(core, causal in (True, "top_left"), scale)
        return _JaxAttention.apply(q, k, v, fwd, bwd)

    attention.__name__ = attention.__qualname__ = name.replace("-", "_")
    attention.__doc__ = f"{name}: JAX attention through DLPack (see impls/jax_attn.py)."
    implementation(name=name, causal=("top_left",), dtypes=dtypes, devices=devices, backward=True, gqa=gqa,
                   lse=lse, framework="torch", head_dims=head_dims, equal_head_dims=True, precision=precision,
                   known_issues=known_issues, supports=supports, tags=tags)(attention)
    return attention


def _xla(q, k, v, *, causal, scale):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="xla")


def _cudnn(q, k, v, *, causal, scale):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")


# The XLA path in float32 normalizes P before the P.V product; on an sm80+ GPU its float32 dots run
# on TF32 (jax's default matmul precision), so it is held to "tf32" there, which rounds P before
# the normalization (the lead's catalogue is to name "P normalized, then rounded"). In fp16/bf16 it
# forms S and the softmax in float32, rounds the normalized P to the input type, and its autodiff
# rounds dP (and dS) to the input type: "fused" rounds P unnormalized and never rounds dP.
XLA_PRECISION = "tf32" if _CUDA else "fused"

xla_attention = _register(
    "jax-xla", _xla, devices=("cpu", "cuda") if _CUDA else ("cpu",),
    dtypes=("float64", "float32", "float16", "bfloat16") if _CUDA else ("float64", "float32", "bfloat16"),
    gqa=True, lse=False, head_dims=(1, 256), precision=XLA_PRECISION,
    # XLA:CPU compiles each new shape for 1-3 s (forward and vjp): the full run there is opt-in,
    # pytest -m properties --impl jax-xla
    tags=() if _CUDA else ("slow",))

if not _CUDA:
    why = ("a CUDA kernel; this machine has no CUDA" if not torch.cuda.is_available()
           else f"a CUDA kernel, and jax {jax.__version__} here has no GPU backend (jax[cuda12] not installed)")
    UNAVAILABLE.update({"jax-cudnn": why, "jax-pallas": why})
