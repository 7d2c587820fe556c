"""A Triton FlashAttention written the way many third-party kernels are: autotuned, compiled per shape.

    FLASHCHECK_PROFILE=gpu pytest -m properties --impl examples/triton_autotuned.py:attention  # CUDA
    pytest -m properties --impl examples/triton_autotuned.py:attention  # no CUDA: Triton's interpreter

The sequence lengths and head dims are ``tl.constexpr`` (as in Triton's tutorial, whose N_CTX and
HEAD_DIM are), and ``@triton.autotune`` picks the tiles per (Sq, Sk, D, Dv). So every new shape
costs one compile per tile configuration and a benchmark of each: the plug-in the gpu lane's
shape buckets (strategies/buckets.py) are for. Forward and backward (dK/dV, then dQ, from the
saved LSE) are Triton kernels; GQA, bottom-right causal masking and rows that see no key
(O = 0, LSE = -inf) are handled; float32 dots are IEEE. It declares itself deterministic: no
atomics (the dK/dV program of a kv head sums its query-head group itself), and the autotuner keeps
one configuration per shape for the rest of the process.

Without CUDA, set TRITON_INTERPRET=1 before triton is imported (the flashcheck plugin does so on
a machine without CUDA): the kernels then run on CPU tensors, float16 and float32 only (the
interpreter computes bfloat16 wrongly), lengths up to 48. The interpreter times nothing: flashcheck
picks each shape's tile configuration by a hash, so a run reaches every one of them.
"""
import math
import os

import torch
import triton
import triton.language as tl

from flashcheck import implementation

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
FP32_WORK = 1 << 17  # BLOCK_M * BLOCK_N * padded head dim: IEEE float32 tiles past this compile for minutes


def _configs():
    # No 64x64 tile on 4 warps: on an H100 (Triton 3.6) it returned wrong rows with D = 64 or 128 and
    # a single key tile, and read out of bounds at other shapes (docs/findings.md, 2026-12-05).
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in ((128, 64, 8, 3), (64, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1))]


def _prune(configs, named_args, **kwargs):
    """Drop tiles that would not fit the head dim in float32 (the FMA path compiles them for minutes),
    and 64-key tiles when both head dims are padded: on an H200 (Triton 3.6) those compile to a
    forward that returns wrong rows and, under the autotuner, reads out of bounds (D = 100, Dv = 5
    in fp16 and bf16; the interpreter computes the same tiles right; docs/findings.md)."""
    args = {**named_args, **kwargs}  # the constexprs come as keywords
    if args["D_PAD"] != args["HEAD_DIM"] and args["DV_PAD"] != args["HEAD_DV"]:
        configs = [c for c in configs if c.kwargs["BLOCK_N"] < 64] or configs[-1:]
    if args["Q"].dtype != torch.float32:
        return configs
    width = max(args["D_PAD"], args["DV_PAD"])
    return [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * width <= FP32_WORK] or configs[-1:]


TUNING = dict(configs=_configs(), key=["SEQ_Q", "SEQ_K", "HEAD_DIM", "HEAD_DV"],
              prune_configs_by={"early_config_prune": _prune})


@triton.jit
def _dot(a, b):
    """float32 accumulation; float32 operands multiplied exactly (IEEE), not in TF32."""
    return tl.dot(a, b, input_precision="ieee")


@triton.autotune(**TUNING)
@triton.jit
def _fwd(Q, K, V, O, LSE, qk_scale, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, H, GROUP,
         SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
         D_PAD: tl.constexpr, DV_PAD: tl.constexpr, CAUSAL: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dd, dv = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dd[None, :],
                mask=(rows[:, None] < SEQ_Q) & (dd[None, :] < HEAD_DIM), other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 logits
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    for start in range(0, SEQ_K, BLOCK_N):
        keys = start + cols
        kt = tl.load(K + b * skb + hk * skh + keys[None, :] * skn + dd[:, None],
                     mask=(keys[None, :] < SEQ_K) & (dd[:, None] < HEAD_DIM), other=0.0)
        s = _dot(q, kt) * qk_scale
        seen = keys[None, :] < SEQ_K
        if CAUSAL:  # bottom-right: query i sees key j iff j <= i + Sk - Sq
            seen = seen & (keys[None, :] <= rows[:, None] + (SEQ_K - SEQ_Q))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays at zero
        p = tl.exp2(s - base[:, None])
        fade = tl.exp2(m - base)
        l = l * fade + tl.sum(p, 1)
        vt = tl.load(V + b * svb + hk * svh + keys[:, None] * svn + dv[None, :],
                     mask=(keys[:, None] < SEQ_K) & (dv[None, :] < HEAD_DV), other=0.0)
        acc = acc * fade[:, None] + _dot(p.to(vt.dtype), vt)
        m = m_new
    empty = l == 0.0  # a row that sees no key: O = 0, LSE = -inf
    o = acc / tl.where(empty, 1.0, l)[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * som + dv[None, :], o.to(O.dtype.element_ty),
             mask=(rows[:, None] < SEQ_Q) & (dv[None, :] < HEAD_DV))
    lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, l))) * 0.6931471805599453)
    tl.store(LSE + bh * SEQ_Q + rows, lse, mask=rows < SEQ_Q)


@triton.jit
def _probs(q, kt, lse2, rows, keys, qk_scale, SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr, CAUSAL: tl.constexpr):
    """P recomputed from the forward's LSE (base 2 here; +inf for rows that see no key, so their P is 0)."""
    s = _dot(q, kt) * qk_scale
    seen = (keys[None, :] < SEQ_K) & (rows[:, None] < SEQ_Q)
    if CAUSAL:
        seen = seen & (keys[None, :] <= rows[:, None] + (SEQ_K - SEQ_Q))
    return tl.exp2(tl.where(seen, s, float("-inf")) - lse2[:, None])  # hidden scores never reach exp2


@triton.autotune(**TUNING)
@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
              H, GROUP, HKV,
              SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
              D_PAD: tl.constexpr, DV_PAD: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, batch, kv head); q, dO, K, V, dK, dV contiguous except for Q/K/V strides."""
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    b, hk = bh // HKV, bh % HKV
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dd, dv_ = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    kt = tl.load(K + b * skb + hk * skh + keys[None, :] * skn + dd[:, None],
                 mask=(keys[None, :] < SEQ_K) & (dd[:, None] < HEAD_DIM), other=0.0)  # (D, N)
    vt = tl.load(V + b * svb + hk * svh + keys[None, :] * svn + dv_[:, None],
                 mask=(keys[None, :] < SEQ_K) & (dv_[:, None] < HEAD_DV), other=0.0)  # (Dv, N)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        row0 = (b * H + h) * SEQ_Q
        for start in range(0, SEQ_Q, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dd[None, :],
                        mask=(rows[:, None] < SEQ_Q) & (dd[None, :] < HEAD_DIM), other=0.0)
            do = tl.load(DO + (row0 + rows[:, None]) * HEAD_DV + dv_[None, :],
                         mask=(rows[:, None] < SEQ_Q) & (dv_[None, :] < HEAD_DV), other=0.0)
            lse = tl.load(LSE + row0 + rows, mask=rows < SEQ_Q, other=float("inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            delta = tl.load(DELTA + row0 + rows, mask=rows < SEQ_Q, other=0.0)
            p = _probs(q, kt, lse2, rows, keys, qk_scale, SEQ_Q, SEQ_K, CAUSAL)  # (M, N)
            dv += _dot(tl.trans(p.to(do.dtype)), do)
            ds = p * (_dot(do, vt) - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q)
    out = (keys[:, None] < SEQ_K)
    tl.store(DK + (bh * SEQ_K + keys[:, None]) * HEAD_DIM + dd[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
             mask=out & (dd[None, :] < HEAD_DIM))
    tl.store(DV + (bh * SEQ_K + keys[:, None]) * HEAD_DV + dv_[None, :], dv.to(DV.dtype.element_ty),
             mask=out & (dv_[None, :] < HEAD_DV))


@triton.autotune(**TUNING)
@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, qk_scale, sm_scale, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
            H, GROUP,
            SEQ_Q: tl.constexpr, SEQ_K: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
            D_PAD: tl.constexpr, DV_PAD: tl.constexpr, CAUSAL: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch, query head)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dd, dv_ = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dd[None, :],
                mask=(rows[:, None] < SEQ_Q) & (dd[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(DO + (bh * SEQ_Q + rows[:, None]) * HEAD_DV + dv_[None, :],
                 mask=(rows[:, None] < SEQ_Q) & (dv_[None, :] < HEAD_DV), other=0.0)
    lse = tl.load(LSE + bh * SEQ_Q + rows, mask=rows < SEQ_Q, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + bh * SEQ_Q + rows, mask=rows < SEQ_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(0, SEQ_K, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        kt = tl.load(K + b * skb + hk * skh + keys[None, :] * skn + dd[:, None],
                     mask=(keys[None, :] < SEQ_K) & (dd[:, None] < HEAD_DIM), other=0.0)
        vt = tl.load(V + b * svb + hk * svh + keys[None, :] * svn + dv_[:, None],
                     mask=(keys[None, :] < SEQ_K) & (dv_[:, None] < HEAD_DV), other=0.0)
        p = _probs(q, kt, lse2, rows, keys, qk_scale, SEQ_Q, SEQ_K, CAUSAL)
        ds = p * (_dot(do, vt) - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt))
    tl.store(DQ + (bh * SEQ_Q + rows[:, None]) * HEAD_DIM + dd[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < SEQ_Q) & (dd[None, :] < HEAD_DIM))


def _pad(n):
    return max(16, triton.next_power_of_2(n))


def _shape_args(q, k, v, causal):
    """The constexprs: every new (Sq, Sk, D, Dv) is a new kernel, and a new autotuning."""
    sq, d, sk, dv = q.shape[2], q.shape[3], k.shape[2], v.shape[3]
    return dict(SEQ_Q=sq, SEQ_K=sk, HEAD_DIM=d, HEAD_DV=dv, D_PAD=_pad(d), DV_PAD=_pad(dv), CAUSAL=bool(causal))


def _strides(*tensors):
    return [s for t in tensors for s in t.stride()[:3]]


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        b, hq, sq, _ = q.shape
        hkv = k.shape[1]
        o = torch.empty(q.shape[:3] + v.shape[3:], device=q.device, dtype=q.dtype)
        lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
        shape = _shape_args(q, k, v, causal)
        grid = lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), b * hq)  # noqa: E731
        _fwd[grid](q, k, v, o, lse, scale * LOG2E, *_strides(q, k, v, o), hq, hq // hkv, **shape)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        b, hq, sq, _ = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        do = do.contiguous()
        delta = (o.float() * do.float()).sum(-1).contiguous()  # rowsum(dO * O), the softmax backward's term
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        # dK, dV per query head group: one program per kv head sums its group (no atomics)
        dk = torch.empty(k.shape, device=q.device, dtype=q.dtype)
        dv = torch.empty(v.shape, device=q.device, dtype=q.dtype)
        shape = _shape_args(q, k, v, ctx.causal)
        args = (q, k, v, do, lse, delta)
        scales = (ctx.scale * LOG2E, ctx.scale, *_strides(q, k, v))
        _bwd_dkdv[lambda meta: (triton.cdiv(sk, meta["BLOCK_N"]), b * hkv)](*args, dk, dv, *scales, hq, hq // hkv,
                                                                             hkv, **shape)
        _bwd_dq[lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), b * hq)](*args, dq, *scales, hq, hq // hkv, **shape)
        return dq, dk, dv, None, None


def _check(q, k, v):
    """Refuse bad input with an error that names the problem."""
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError(f"q, k, v must have rank 4 (batch, heads, seq, head dim), got {q.ndim}, {k.ndim}, {v.ndim}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads but v has {v.shape[1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k has sequence length {k.shape[2]} but v has {v.shape[2]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} differs from k head dim {k.shape[3]}")
    if max(q.shape[3], v.shape[3]) > 256:
        raise ValueError(f"head dims up to 256 are supported, got {q.shape[3]} and {v.shape[3]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise TypeError(f"q, k, v must share one dtype of {sorted(map(str, DTYPES))}, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    want = "cpu" if INTERPRET else "cuda"
    if any(x.device.type != want for x in (q, k, v)):
        raise ValueError(f"q, k, v must be {want} tensors{' (TRITON_INTERPRET=1)' if INTERPRET else ''}, got "
                         f"{q.device}, {k.device}, {v.device}")


DTYPES = (torch.float16, torch.float32) if INTERPRET else (torch.float16, torch.bfloat16, torch.float32)


@implementation(name="triton-autotuned", causal="bottom_right", dtypes=tuple(str(t)[6:] for t in DTYPES),
                devices=("cpu",) if INTERPRET else ("cuda",), backward=True, gqa=True, lse=True, deterministic=True,
                max_seq=48 if INTERPRET else None, tags=("interpreter",) if INTERPRET else ())
def attention(q, k, v, *, causal=False, scale=None):
    _check(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _Attention.apply(q, k, v, causal, scale)
