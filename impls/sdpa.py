"""torch.nn.functional.scaled_dot_product_attention, one implementation per backend, as external oracles.

Each backend is pinned with torch.nn.attention.sdpa_kernel(<that backend only>), so a backend
that refuses an input raises ("No available kernel") instead of silently falling back to another.

Declared capabilities follow torch's own dispatch checks (aten/src/ATen/native/transformers,
sdp_utils*.cpp) as of torch 2.11-2.13:

| name | device | dtypes | limits |
|---|---|---|---|
| sdpa-math | cpu, cuda | all four | none |
| sdpa-flash (cpu) | cpu | all four | D == Dv |
| sdpa-flash (cuda) | cuda, sm80+ | fp16, bf16 | D == Dv <= 256; causal only when Sq == Sk |
| sdpa-efficient | cuda | fp16, bf16, fp32 | D, Dv multiples of 8 (fp16/bf16) or 4 (fp32) |
| sdpa-cudnn | cuda, sm80+ | fp16, bf16 | D, Dv multiples of 8 and <= 128; Sk >= 2 |

SDPA's is_causal is top-left aligned (query i sees key j iff j <= i), so causal=("top_left",).
SDPA returns no LSE (lse=False). GQA is passed as enable_gqa=True where torch has it.

D == Dv is declared (equal_head_dims). Limits the Implementation record cannot express (a
head-dim multiple, Sk >= 2, causal with Sq < Sk) are met by input adaptations below that are exact
forward and backward, in every dtype, so every property still runs on the backend itself:
zero-padding D (q and k) leaves the scores unchanged once the scale is fixed from the true D;
zero-padding Dv only adds output columns that are sliced off; duplicating a single key/value
leaves softmax attention unchanged and gives both copies the same gradients; top-left causal with
Sq < Sk drops the keys no row sees. Each adaptation is applied only to the backends that need it;
autograd carries the gradients back through them. Causal with Sq > Sk is declared unsupported
(``supports``) where the backend needs square causal: splitting it into two calls would round dK
and dV twice, a rounding no kernel of the backend does.

Features: the sliding window and ALiBi are an additive float attn_mask (-inf where the window or
the causal mask hides a key, -slope * |i + Sk - Sq - j| elsewhere), declared by the backends that
take one unadapted: math (CPU, CUDA) and the CPU flash kernel. A softcap, sinks and dropout with a
known seed are not expressible through SDPA's arguments, so no backend declares them.

A failure the suite found and that is reported upstream is declared as a KnownIssue: the
strategies steer around it and properties/test_known_issues.py checks it still reproduces.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from flashcheck.contract import KnownIssue, implementation
from flashcheck.contract.memory import DEFAULT, MEMORY
from flashcheck.contract.checks import alignment, check_features, check_inputs, check_tensors
from flashcheck.impls import cudnn
from flashcheck.oracle.rounding import DTYPES

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError as exc:  # torch < 2.3: no per-backend selection, so nothing to register honestly
    raise ImportError(f"flashcheck.impls.sdpa needs torch.nn.attention.sdpa_kernel: {exc}") from exc



def probe(backend, device="cpu", dtype=torch.float32, gqa=False) -> str | None:
    """Why this backend does not run here (with enable_gqa, when asked), or None when it does.
    One tiny call says it best: enable_gqa arrived in torch 2.5 and reached the fused backends
    later; kernels need a GPU arch."""
    said = []
    try:
        q = torch.zeros(1, 2, 4, 8, device=device, dtype=dtype)
        kv = q[:, :1].contiguous() if gqa else q
        with warnings.catch_warnings(record=True) as said, sdpa_kernel(backend):
            warnings.simplefilter("always")  # a refusing backend explains itself in warnings
            F.scaled_dot_product_attention(q, kv, kv, **({"enable_gqa": True} if gqa else {}))
        return None
    except (TypeError, RuntimeError) as exc:
        why = "; ".join(str(w.message).strip().splitlines()[0] for w in said if str(w.message).strip())
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}" + (f" ({why})" if why else "")


def runs(backend, device="cpu", dtype=torch.float32, gqa=False) -> bool:
    return probe(backend, device, dtype, gqa) is None


HAS_GQA = runs(SDPBackend.MATH, gqa=True)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _sdpa(q, k, v, backend, causal: bool, scale, attn_mask=None):
    kw = {"enable_gqa": True} if HAS_GQA and q.shape[1] != k.shape[1] else {}
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, attn_mask=attn_mask, **kw)


def feature_mask(q, k, causal: bool, window, alibi_slopes, attn_mask=None, attn_bias=None):
    """The window, the ALiBi bias and a bool attn_mask (True = may attend) as SDPA's additive float
    attn_mask (B or 1, Hq or 1, Sq, Sk), with the top-left causal mask folded in (SDPA refuses
    attn_mask together with is_causal); None when unneeded."""
    window = (-1, -1) if window is None else tuple(window)
    if window == (-1, -1) and alibi_slopes is None and attn_mask is None and attn_bias is None:
        return None
    sq, sk = q.shape[2], k.shape[2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = torch.arange(sq, device=q.device)[:, None]
    cols = torch.arange(sk, device=q.device)[None, :]
    dist = cols - (rows + sk - sq)  # key position against the query's (bottom-right) diagonal
    hidden = (cols > rows) if causal else torch.zeros_like(dist, dtype=torch.bool)
    left, right = window
    if left >= 0:
        hidden |= dist < -left
    if right >= 0:
        hidden |= dist > right
    bias = torch.zeros(1, 1, sq, sk, dtype=cdt, device=q.device)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(cdt).expand(q.shape[0], q.shape[1])[:, :, None, None]
        bias = bias - slopes * dist.abs().to(cdt)
    if attn_mask is not None:
        hidden = hidden | ~attn_mask
    if attn_bias is not None:  # differentiable: SDPA's attn_mask gradient is the bias's
        hidden = hidden | (attn_bias == float("-inf"))
        bias = bias + torch.where(hidden, 0.0, attn_bias.to(cdt))
    return torch.where(hidden, float("-inf"), bias).to(q.dtype)


# Splitting it would be exact forward (rows 0..Sk-1 square causal, the rest non-causal) but not backward:
# on an H200 such a split of sdpa-flash failed dV at 1.08x in bf16, an emulation of the split gave its
# value bit for bit, and the single call's emulation lies within half the bound (docs/findings.md).
SQUARE_CAUSAL = ("this SDPA backend takes is_causal only when Sq == Sk (Sq < Sk is sliced to it exactly); "
                 "top-left causal with Sq > Sk would take two calls, whose dK and dV each round to the input "
                 "type before their sum")


def square_causal_only(case):
    """``supports`` of a backend whose is_causal needs Sq == Sk (call_sdpa's ``square_causal``)."""
    return SQUARE_CAUSAL if case.causal is not None and case.sq > case.sk else True


def call_sdpa(q, k, v, *, backend, causal: bool, scale, head_dim_multiple=1, min_keys=1, square_causal=False,
              attn_mask=None):
    """SDPA on one backend, adapting (exactly) the inputs to the backend's shape limits."""
    d, dv, sq, sk = q.shape[-1], v.shape[-1], q.shape[2], k.shape[2]
    dp, dvp = _round_up(d, head_dim_multiple), _round_up(dv, head_dim_multiple)
    if (dp, dvp) != (d, dv):
        # SDPA would derive its default scale from the padded D: fix it from the true D first.
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        q, k = F.pad(q, (0, dp - d)), F.pad(k, (0, dp - d))  # zero columns add 0 to every score
        v = F.pad(v, (0, dvp - dv))  # zero columns give zero output columns, sliced off below
    if sk == 1 < min_keys:
        # The single key and value, twice: the softmax weights split 1/2 + 1/2 and O = v is unchanged.
        # Top-left, every row sees key 0, so the causal call is the plain one: both copies are seen
        # alike and get the same gradients, whose sum is exactly twice one. (Causal, row 0 would see
        # one copy and later rows both: two gradients, each rounded to the input type, then summed.)
        # A mask's one column goes with its key (the causal mask is already in it).
        causal = False
        k, v = k.expand(-1, -1, 2, -1).contiguous(), v.expand(-1, -1, 2, -1).contiguous()
        sk = 2
        if attn_mask is not None:
            attn_mask = attn_mask.expand(*attn_mask.shape[:-1], 2)
    if attn_mask is not None:  # the feature mask already holds the causal mask
        o = _sdpa(q, k, v, backend, False, scale, attn_mask)
    elif causal and square_causal and sq != sk:
        if sq > sk:
            raise ValueError(SQUARE_CAUSAL)
        # Top-left: no row sees a key at or past Sq, so those keys drop out (their dK, dV are 0).
        o = _sdpa(q, k[:, :, :sq].contiguous(), v[:, :, :sq].contiguous(), backend, True, scale)
    else:
        o = _sdpa(q, k, v, backend, causal, scale)
    return o[..., :dv] if dvp != dv else o


def takes_mask(backend, device="cpu", dtype=torch.float32, grad=False) -> bool:
    """Whether this backend runs one tiny call with an additive attn_mask (and, with ``grad``, returns
    that mask's gradient): the window and mask tensors (and bias tensors) are declared from it."""
    try:
        q = torch.randn(1, 2, 4, 8, device=device, dtype=dtype, requires_grad=grad)
        mask = torch.zeros(1, 2, 4, 4, device=device, dtype=dtype, requires_grad=grad)
        with warnings.catch_warnings(), sdpa_kernel(backend):
            warnings.simplefilter("ignore")  # a refusing backend explains itself in warnings
            o = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        if grad:
            o.sum().backward()
            return mask.grad is not None
        return True
    except (TypeError, RuntimeError):
        return False


def _register(name, backend, *, devices, dtypes, gqa=HAS_GQA, head_dims=(1, 256), equal_head_dims=False,
              known_issues=(), precision="fused", masks=False, bias=False, **adapt):
    """``masks=True``: the backend takes an additive attn_mask, so it declares the window and mask
    tensors; ``bias=True``: and returns its gradient, so it declares bias tensors. (ALiBi through attn_mask
    is not declared: SDPA wants the mask in the input type, which rounds an fp16/bf16 bias to 2-3 digits,
    2x past a fused kernel's error on the H200-free CPU run.)"""
    who = name

    def attention(q, k, v, *, causal=False, scale=None, window=None, alibi_slopes=None, attn_mask=None,
                  attn_bias=None):
        check_tensors(q, k, v, devices=devices, who=who)
        _, hq, hkv, _, _, d, dv = check_inputs(q, k, v, dtypes=dtypes, who=who)
        if hq != hkv and not gqa:
            raise ValueError(f"{who}: no GQA here (torch {torch.__version__}); Hq must equal Hkv, got {hq} and {hkv}")
        lo, hi = head_dims
        if not (lo <= d <= hi and lo <= dv <= hi):
            raise ValueError(f"{who}: head dims D={d}, Dv={dv} outside the supported range [{lo}, {hi}]")
        if equal_head_dims and d != dv:
            raise ValueError(f"{who}: this backend needs Dv == D, got D={d}, Dv={dv}")
        # The suite passes causal=True for an implementation with one declared alignment: here, top-left.
        if causal not in (False, None, True, "top_left"):
            alignment(causal)  # names a malformed value
            raise ValueError(f"{who}: SDPA's is_causal is top-left aligned; {causal!r} is not supported")
        causal = causal in (True, "top_left")
        window = check_features(q, who=who, window=window, alibi_slopes=alibi_slopes, attn_mask=attn_mask,
                                sk=k.shape[2], attn_bias=attn_bias)
        mask = feature_mask(q, k, causal, window, alibi_slopes, attn_mask, attn_bias)
        return call_sdpa(q, k, v, backend=backend, causal=causal, scale=None if scale is None else float(scale),
                         attn_mask=mask, **adapt)

    attention.__name__ = attention.__qualname__ = name.replace("-", "_")
    attention.__doc__ = f"torch SDPA pinned to SDPBackend.{backend.name} (see impls/sdpa.py)."
    implementation(name=name, causal=("top_left",), dtypes=dtypes, devices=devices, backward=True,
                   gqa=gqa, lse=False, framework="torch", head_dims=head_dims, equal_head_dims=equal_head_dims,
                   known_issues=known_issues, precision=precision, window=masks, mask=masks,
                   bias=bias, supports=square_causal_only if adapt.get("square_causal") else None,
                   # plain torch ops: capturable, and traceable by dynamo (properties/test_launch.py)
                   cuda_graphs="cuda" in devices, compile=True,
                   # the math backend is plain matmuls: any view; the fused ones vectorize their loads
                   layouts=tuple(MEMORY) if backend == SDPBackend.MATH else DEFAULT)(attention)
    return attention


# Found by this suite (torch 2.11-2.13): the CPU flash kernel writes -inf into the masked scores and
# only then multiplies by the scale, so scale = 0 gives -inf * 0 = NaN and scale < 0 gives +inf.
CPU_FLASH_CAUSAL_NONPOSITIVE_SCALE = KnownIssue(
    "CPU flash SDPA: causal with scale <= 0 returns NaN (the mask's -inf is multiplied by the scale)",
    applies=lambda case: case.causal is not None and case.scale is not None and case.scale <= 0,
    witness=dict(sq=1, sk=2, d=1, dv=1, causal="top_left", scale=0.0, dtype="float32"),
    failure=r"got \S*nan",
)

# Found by this suite on an H200 (torch 2.11+cu130, 2026-11-30): the CUDA flash and cuDNN kernels
# return NaN for scale = 0, causal or not, forward and gradients; math and efficient do not.
CUDA_ZERO_SCALE = KnownIssue(
    "CUDA flash / cuDNN SDPA: scale = 0.0 returns NaN, forward and gradients",
    applies=lambda case: case.scale == 0.0,
    witness=dict(sq=1, sk=1, d=1, dv=1, scale=0.0, dtype="float16"),
    failure=r"got \S*nan",
)

_CUDA = torch.cuda.is_available()
UNAVAILABLE: dict[str, str] = {}  # backend left out here -> why (reported as a skip by the suite)


def _available(name, backend, device="cpu", dtype=torch.float32) -> bool:
    why = probe(backend, device, dtype)
    if why is not None:
        UNAVAILABLE[name] = f"the probe call of SDPBackend.{backend.name} on {device} failed: {why}"
    return why is None


# On CUDA the math backend rounds S = q k^T to fp16/bf16 before the softmax: plain dense
# attention in the input type, held to the naive rule. On the CPU it computes in float32.
math_attention = _register("sdpa-math", SDPBackend.MATH, devices=("cpu", "cuda") if _CUDA else ("cpu",),
                           dtypes=DTYPES, precision="naive" if _CUDA else "fused", masks=True, bias=True)

if _CUDA:
    # The suite runs a declared CUDA implementation on CUDA when it is present, so each fused backend
    # is registered for the device whose kernel it names, and only if it runs on this GPU.
    def _cuda(backend):
        """What one tiny fp16 call on this GPU shows the backend takes: GQA, an attn_mask, its gradient."""
        return {"gqa": runs(backend, "cuda", torch.float16, gqa=True),
                "masks": takes_mask(backend, "cuda", torch.float16),
                "bias": takes_mask(backend, "cuda", torch.float16, grad=True)}

    if _available("sdpa-flash", SDPBackend.FLASH_ATTENTION, "cuda", torch.float16):
        flash_attention = _register("sdpa-flash", SDPBackend.FLASH_ATTENTION, devices=("cuda",),
                                    dtypes=("float16", "bfloat16"), equal_head_dims=True, square_causal=True,
                                    known_issues=[CUDA_ZERO_SCALE], **_cuda(SDPBackend.FLASH_ATTENTION))
    if _available("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION, "cuda", torch.float16):
        # Its fp16 backward carried 3.1x the fused bound on a dK entry (heavy-tailed values, H200,
        # torch 2.11): it is held to the naive rule.
        efficient_attention = _register("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION, devices=("cuda",),
                                        dtypes=("float32", "float16", "bfloat16"), head_dim_multiple=8,
                                        precision="naive", **_cuda(SDPBackend.EFFICIENT_ATTENTION))
    if _available("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION, "cuda", torch.float16):
        # With an attn_mask, cuDNN failed three mask properties on the H200 (torch 2.11, 2026-12-03: a
        # full-length window against none, an all-True mask against none, rows that see no key); their
        # messages were lost with the run, so until they are triaged it declares no masks.
        cudnn_attention = _register("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION, devices=("cuda",),
                                    dtypes=("float16", "bfloat16"), head_dims=(1, 128), head_dim_multiple=8,
                                    min_keys=2, known_issues=[CUDA_ZERO_SCALE, cudnn.low_row_dq_nan("cuDNN SDPA")],
                                    **_cuda(SDPBackend.CUDNN_ATTENTION) | {"masks": False, "bias": False})
elif _available("sdpa-flash", SDPBackend.FLASH_ATTENTION):
    # The CPU flash kernel (aten _scaled_dot_product_flash_attention_for_cpu).
    # Its fp16/bf16 backward carries about 3x a fused kernel's rounding in dK and dV (largest error
    # 1.0-2.2x the fused bound at Sq = Sk = 128-2048, where torch-tiled stays at 0.35x): it is held
    # to the naive rule, k x the error of plain dense attention in the input type.
    flash_attention = _register("sdpa-flash", SDPBackend.FLASH_ATTENTION, devices=("cpu",), dtypes=DTYPES,
                                equal_head_dims=True, known_issues=[CPU_FLASH_CAUSAL_NONPOSITIVE_SCALE],
                                precision="naive", gqa=runs(SDPBackend.FLASH_ATTENTION, gqa=True), masks=True,
                                # it takes no attn_mask that requires grad ("No available kernel")
                                bias=takes_mask(SDPBackend.FLASH_ATTENTION, grad=True))
if not _CUDA:
    UNAVAILABLE.update({n: "a CUDA backend; this machine has no CUDA" for n in ("sdpa-efficient", "sdpa-cudnn")})
