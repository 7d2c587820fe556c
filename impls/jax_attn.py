"""JAX's attention kernels as built-ins, fed torch tensors through DLPack (zero copy).

| name | what | devices | dtypes | limits |
|---|---|---|---|---|
| jax-xla | jax.nn.dot_product_attention(implementation="xla") | cpu, cuda | float32, bfloat16 (+ float16 on cuda) | Dv == D |
| jax-cudnn | jax.nn.dot_product_attention(implementation="cudnn") | cuda | float16, bfloat16 | Dv == D, a multiple of 8, <= 128 (256 from sm90) |
| jax-pallas | jax.experimental.pallas.ops.gpu.attention.mha (Triton) | cuda | float16, bfloat16, float32 | Dv == D, Hq == Hkv, lengths <= 128 or multiples of 128, Sq // 32 == Sk // 32 |

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
- float64 on the XLA path: the softmax is "always carried out in fp32" (its source), so float64
  inputs get float32 accuracy (errors ~1e-7): not declared, since float64 is held to float64.
- float16 on XLA:CPU: jax asks for the F16_F16_F32 dot algorithm, which XLA:CPU rejects under jit
  ("The precision 'F16_F16_F32' is not supported by dot_general on CPU"), for every shape; jax's
  own fall-back only catches it outside jit. Not declared on the CPU.
- Precision: the XLA path declares the "dense" rounding site (XLA_PRECISION below), plus "tf32"
  on the GPU; Pallas "tf32" (its float32 dots); cuDNN "fused".

Backward: jax.vjp of the same jitted function, wired into torch.autograd (``_JaxAttention``).
Without jax the module fails to import and the three names are unavailable with that reason
(impls/builtin.py); without CUDA (torch's and jax's both) the two GPU kernels are unavailable.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from flashcheck.contract import KnownIssue, implementation
from flashcheck.contract.checks import alignment, check_inputs, check_tensors
from flashcheck.impls import cudnn

# JAX grabs 75% of the GPU's memory at its first CUDA call unless told not to, which would
# starve torch and the suite's other kernels in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:
    raise ImportError(f"flashcheck.impls.jax_attn needs jax (pip install 'jax[cpu]', or jax[cuda12]): {exc}") from exc

UNAVAILABLE: dict[str, str] = {}


def _jax_has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # "Unknown backend gpu" / no CUDA plug-in
        return False


_CUDA = torch.cuda.is_available() and _jax_has_gpu()


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


@functools.lru_cache(maxsize=256)  # each holds its compiled shapes
def _compiled(core, causal: bool, scale: float, lse: bool):
    """The jitted forward and the jitted vjp for one (kernel, causal, scale); jax caches per shape.
    The vjp differentiates the call without the LSE (Pallas refuses to differentiate its residuals)."""
    fwd = _bhsd(functools.partial(core, causal=causal, scale=scale, lse=lse))
    o_only = _bhsd(functools.partial(core, causal=causal, scale=scale, lse=False))

    def vjp(q, k, v, do):
        return jax.vjp(o_only, q, k, v)[1](do)

    return jax.jit(fwd), jax.jit(vjp)


@dataclass(frozen=True)
class _Shape:
    """The fields of an AttentionCase that a ``supports`` rule here reads."""

    batch: int
    hq: int
    hkv: int
    sq: int
    sk: int
    d: int
    dtype: str


def _register(name, core, *, devices, dtypes, gqa, lse, head_dims, precision, known_issues=(), supports=None,
              tags=()):
    who = name

    def attention(q, k, v, *, causal=False, scale=None):
        check_tensors(q, k, v, devices=devices, who=who)
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
        if supports is not None:  # the same rule the strategies draw inside, as a named refusal
            why = supports(_Shape(q.shape[0], hq, hkv, q.shape[2], k.shape[2], d, str(q.dtype).removeprefix("torch.")))
            if isinstance(why, str):
                raise ValueError(f"{who}: {why}")
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        fwd, bwd = _compiled(core, causal in (True, "top_left"), scale, lse)
        return _JaxAttention.apply(q, k, v, fwd, bwd)

    attention.__name__ = attention.__qualname__ = name.replace("-", "_")
    attention.__doc__ = f"{name}: JAX attention through DLPack (see impls/jax_attn.py)."
    implementation(name=name, causal=("top_left",), dtypes=dtypes, devices=devices, backward=True, gqa=gqa,
                   lse=lse, framework="torch", head_dims=head_dims, equal_head_dims=True, precision=precision,
                   known_issues=known_issues, supports=supports, tags=tags)(attention)
    return attention


def _xla(q, k, v, *, causal, scale, lse):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="xla")


def _cudnn(q, k, v, *, causal, scale, lse):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")


def _pallas(q, k, v, *, causal, scale, lse):
    from jax.experimental.pallas.ops.gpu.attention import mha

    if not lse:
        return mha(q, k, v, None, sm_scale=scale, causal=causal)
    o, lse2 = mha(q, k, v, None, sm_scale=scale, causal=causal, return_residuals=True)
    return o, lse2 * math.log(2.0)  # its LSE is in base 2: log2(e)-scaled scores, exp2


# What the XLA path rounds (its source, and a float64 emulation, rounding.Sites(p_normalized, dp_rounded,
# softmax_vjp, ds_float32), that gives jax 0.10.2's bf16 results on XLA:CPU bit for bit on 86-100% of entries and
# within 0.4 of a bf16 ulp of the largest entry elsewhere, on four probed cases): S and the
# softmax in float32; P normalized, then rounded to the input type for P.V; its autodiff rounds dP =
# dO.V^T to the input type, takes the softmax's delta as rowsum(dP * P) with the float32 P, and keeps
# dS (times the scale) in float32 for the dQ and dK products. That is the "dense" rounding site: under plain "fused"
# a bf16 dQ entry came out at 1.11x the bound on the CPU (AttentionCase(batch=2, hq=2, hkv=2,
# sq=40, sk=40, d=32, dv=32, causal='top_left', scale=2.0, dtype='bfloat16', regime='negative',
# seed=23)), exactly where the emulation with dP in bf16 lands (0.28x with dP in float32). On an
# sm80+ GPU its float32 dots also run on TF32 (jax's default matmul precision).
XLA_PRECISION = "tf32+dense" if _CUDA else "dense"


def _degenerate(c) -> bool:
    """One batch, one key/value head, and at most one of Hq * Sq (a key/value head's query rows), Sk
    and D above 1: XLA rewrites such dots, and measured on XLA:CPU this is exactly where bf16 fails."""
    return c.batch == 1 and c.hkv == 1 and sum(n > 1 for n in (c.hq * c.sq, c.sk, c.d)) <= 1


# Found by this suite on XLA:CPU (jax/jaxlib 0.10.2): bf16 attention with one batch and one key/value
# head, where at most one of Hq * Sq, Sk, D exceeds 1, fails to compile under jit: "Algorithm not supported
# by the ElementalIrEmitter: ALG_DOT_BF16_BF16_F32" (the dot algorithm jax asks for in bf16).
XLA_CPU_BF16_DEGENERATE = KnownIssue(
    "XLA:CPU: bf16 attention fails to compile (ALG_DOT_BF16_BF16_F32 in the ElementalIrEmitter) when "
    "B = Hkv = 1 and at most one of Hq * Sq, Sk, D exceeds 1",
    applies=lambda c: c.dtype == "bfloat16" and _degenerate(c),
    witness=dict(sq=1, sk=1, d=2, dv=2, dtype="bfloat16"),
    failure=r"ElementalIrEmitter")

# Found by this suite on XLA:CPU (jaxlib 0.10.2): bf16 at D = 1 aborts the whole process for some
# shapes ("ynn_emitter.cc:201] Check failed: instr->opcode() == HloOpcode::kBitcast (reshape vs.
# bitcast)"): B = Hq = Hkv = 1 at Sq = Sk = 64 (32 runs), B = 2, Hq = Hkv = 3 at Sq = Sk = 36. A
# witness cannot run without killing the test run, so every bf16 case at D = 1 is a declared limit
# on the CPU instead of a KnownIssue (docs/findings.md).
def _xla_cpu_supports(c):
    if c.dtype == "bfloat16" and c.d == 1:
        return "XLA:CPU aborts the process on some bf16 attention shapes at D = 1 (ynn_emitter Check failed)"
    return True


# On an H200 (jax 0.11) the suite found the XLA path failing to jit in fp16 at size-1 dimensions;
# its predicate and witness are to be confirmed by scratch/jax_gpu_findings.py (the degenerate rule
# above is what XLA:CPU shows for bf16).
# scratch/jax_gpu_findings.py on the H200 (jax 0.11): 40 of 48 small fp16 shapes fail to jit with
# "INVALID_ARGUMENT: Unsupported dot precision algorithm: 4", far beyond the size-1 rule first
# guessed (34 mismatches), so every fp16 case is declared; bf16 and fp32 compile on every shape probed.
XLA_CUDA_FP16_DEGENERATE = KnownIssue(
    "XLA:GPU: fp16 attention fails to jit (Unsupported dot precision algorithm)",
    applies=lambda c: c.dtype == "float16",
    witness=dict(sq=1, sk=1, d=1, dv=1, dtype="float16"),
    failure=r"Error|not supported|precision algorithm")

xla_attention = _register(
    "jax-xla", _xla, devices=("cpu", "cuda") if _CUDA else ("cpu",),
    dtypes=("float32", "float16", "bfloat16") if _CUDA else ("float32", "bfloat16"),
    gqa=True, lse=False, head_dims=(1, 256), precision=XLA_PRECISION,
    known_issues=[XLA_CUDA_FP16_DEGENERATE] if _CUDA else [XLA_CPU_BF16_DEGENERATE],
    supports=None if _CUDA else _xla_cpu_supports,
    # XLA:CPU compiles each new shape for 1-3 s (forward and vjp): the full run there is opt-in,
    # pytest -m properties --impl jax-xla
    tags=() if _CUDA else ("slow",))

if _CUDA:
    # Found by this suite on an H200 (jax 0.11, cuDNN 9): NaN for scale <= 0 (witness to be shrunk
    # by scratch/jax_gpu_findings.py).
    CUDNN_NONPOSITIVE_SCALE = KnownIssue(
        "jax cuDNN attention: scale <= 0 returns NaN",
        applies=lambda c: c.scale is not None and c.scale <= 0,
        witness=dict(sq=64, sk=64, d=8, dv=8, scale=0.0, dtype="float16"),
        failure=r"got \S*nan")
    CUDNN_LOW_ROW_DQ_NAN = cudnn.low_row_dq_nan("jax cuDNN attention")
    _hopper = torch.cuda.get_device_capability() >= (9, 0)
    def _cudnn_supports(c):
        # Seen on an H200 (jax 0.11): forward and backward raise "NotImplementedError: Unsupported
        # sequence length Q 17, KV 33" (also Q 1 KV 1, Q 1 KV 2, Q 3 KV 5), while Q = KV = 16 runs.
        # The exact rule was not probed further; multiples of 64 are declared, a subset of every
        # rule those probes allow.
        if c.sq % 64 or c.sk % 64:
            return f"jax's cuDNN attention backward needs Sq and Sk multiples of 64, got {c.sq}, {c.sk}"
        return True

    cudnn_attention = _register(
        "jax-cudnn", _cudnn, devices=("cuda",), dtypes=("float16", "bfloat16"), gqa=True, lse=False,
        supports=_cudnn_supports,
        # jax's own check: a multiple of 8, at most 256 from sm90 (128 before)
        head_dims=frozenset(range(8, (256 if _hopper else 128) + 1, 8)), precision="fused",
        known_issues=[CUDNN_NONPOSITIVE_SCALE, CUDNN_LOW_ROW_DQ_NAN])

    def _pallas_supports(c):
        """What mha refuses with an error: each length a multiple of its forward block (128, or the
        whole length below it), and, for the backward, Sq and Sk cut into as many blocks of 32."""
        for n, label in ((c.sq, "Sq"), (c.sk, "Sk"), (c.d, "D")):
            if n & (n - 1):  # seen on an H200: "requires ... arrays whose size is a power of 2"
                return f"Pallas's Triton lowering needs power-of-two sizes, got {label} = {n}"
        for n, label in ((c.sq, "Sq"), (c.sk, "Sk")):
            if n > 128 and n % 128:
                return f"Pallas mha needs {label} <= 128 or a multiple of 128, got {n}"
        if c.sq // min(32, c.sq) != c.sk // min(32, c.sk):
            return f"Pallas mha's backward needs Sq // 32 == Sk // 32 (below 32: one block), got {c.sq}, {c.sk}"
        return True

    # Found by this suite on an H200 (jax 0.11); predicates and witnesses to be confirmed and shrunk
    # by scratch/jax_gpu_findings.py. Causal with Sq > Sk also reproduces in Pallas's CPU interpreter:
    # the last query blocks loop over key blocks past Sk.
    PALLAS_CAUSAL_SQ_GT_SK = KnownIssue(
        "Pallas mha: causal with Sq > Sk reads keys past Sk (wrong or NaN output)",
        applies=lambda c: c.causal is not None and c.sq > c.sk,
        witness=dict(sq=32, sk=16, d=32, dv=32, causal="top_left", dtype="float16"),
        failure=r"off by more than allowed|nan")
    # Guessed from Triton's smallest dot tile (16); the H200 run of the findings script measures it.
    PALLAS_SMALL = KnownIssue(
        "Pallas mha: wrong results at small head dims or lengths (below 16)",
        applies=lambda c: c.d < 16 or min(c.sq, c.sk) < 16,
        witness=dict(sq=16, sk=16, d=8, dv=8, dtype="float16"),
        failure=r"off by more than allowed|nan")
    pallas_attention = _register(
        "jax-pallas", _pallas, devices=("cuda",), dtypes=("float32", "float16", "bfloat16"), gqa=False, lse=True,
        # fp32 dots: TF32, to nearest; D = rowsum(dO * O) from fp16 products, rounded to fp16 (docs/oracle.md)
        head_dims=(1, 256), precision="tf32+delta", supports=_pallas_supports,
        known_issues=[PALLAS_CAUSAL_SQ_GT_SK, PALLAS_SMALL])
else:
    why = ("a CUDA kernel; this machine has no CUDA" if not torch.cuda.is_available()
           else f"a CUDA kernel, and jax {jax.__version__} here has no GPU backend (jax[cuda12] not installed)")
    UNAVAILABLE.update({"jax-cudnn": why, "jax-pallas": why})
