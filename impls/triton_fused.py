"""Fused FlashAttention in Triton: forward, backward (dQ with delta, then dK/dV) and the autograd glue.

``attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None,
block_q=None, block_k=None, precision="ieee")``

- q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); GQA/MQA: query head h reads
  key/value head h // (Hq // Hkv); any D, Dv in 1..256 (padded to a power of two >= 16 with masks);
  any Sq, Sk >= 1; any scale (None = 1/sqrt(D), 0.0 used as given).
- causal: False, True (= "bottom_right"), "bottom_right" (query i sees key j iff j <= i + Sk - Sq)
  or "top_left" (j <= i). A row that sees no key gets O = 0 and LSE = -inf.
- window=(left, right): query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, -1 meaning
  unbounded on that side (None or (-1, -1): off); intersected with causal. Key tiles outside the band
  are skipped, as causal ones are.
- softcap=c (0: off): the scaled logit s becomes c * tanh(s / c), before ALiBi and masking; the
  backward multiplies by 1 - tanh^2.
- alibi_slopes: float32 (Hq,) or (B, Hq); head h adds -slope_h * |i + Sk - Sq - j| to its logits.
  No gradient flows to the slopes.
- sinks: float32 (Hq,), one logit per query head that joins every row's softmax denominator and adds
  no value: O = sum_j p_j v_j with p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)), LSE = log(exp(sink)
  + sum_k exp(s_k)); a row that sees no key gets O = 0 and LSE = sink (-inf without sinks). The sinks'
  gradient, -sum over rows of exp(sink - LSE) * rowsum(dO * O), comes back through autograd.
- returns (O in the input dtype, natural-log LSE in float32 of shape (B, Hq, Sq)).
- float16 / bfloat16 dots run on the tensor cores with float32 accumulation. float32 dots use
  ``precision``: "ieee" (default: true float32 products, what the registered implementation uses and
  what the suite's float32 tolerance needs) or "tf32" (tensor cores, ~1e-3 relative error).
- block_q / block_k (powers of two >= 16) pin the tile sizes of every kernel; None picks the tuned
  default for the device, dtype and head dim. On a GPU, before compiling, a tile whose shared memory
  would exceed 227 KiB is lowered (pipeline stages first, then the larger block, halving), and
  float32 tiles are capped at BLOCK_M * BLOCK_N * D_PAD <= 2**17 (the IEEE FMA path compiles for
  minutes beyond that: 128 x 128 x 256 took 10 minutes; 2**15 in the general build of small calls,
  GENERAL_SCORES); results do not depend on the tile sizes.
  Under the interpreter the pinned sizes are used as given.
- deterministic: no atomics; for GQA the dK/dV program loops over the group's query heads.

Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported
(then without bfloat16, which the interpreter computes wrongly). ``flash_attention(kernels=...)``
runs another build of impls/triton_kernels.py's kernels (mutants/triton.py patches its source).
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, replace

import torch
import triton

from flashcheck.contract import implementation
from flashcheck.impls import interpreter
from flashcheck.contract.memory import MEMORY
from flashcheck.contract.checks import alignment, check_inputs, dtype_name, offset
from flashcheck.impls import triton_kernels as K
from flashcheck.impls import triton_warm as warm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    interpreter.quicken()  # helpers called in every tile, without the interpreter re-swapping tl each time
DTYPES = ("float16", "float32") if INTERPRET else ("float16", "bfloat16", "float32")
# The CPU interpreter runs a 2048 x 2048 forward and backward in about 30 s: its lane stops at 256.
INTERPRET_MAX_SEQ = 256 if INTERPRET else None
BLOCKS = (16, 32, 64, 128)
PRECISIONS = ("ieee", "tf32")
WHO = "triton-fused"
SOFTCAP_MIN = 1e-30

try:  # the name moved between Triton releases
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover
    from triton.runtime.autotuner import OutOfResources


def _pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


# Tuned on an H200 (bench/gpu_bench.py --sweep, fp16, N=4096): (BLOCK_M, BLOCK_N, num_warps, num_stages)
# per padded head dim. dK/dV: BLOCK_M is the query tile, BLOCK_N the key tile. 256 is untuned.
FWD_CFG = {16: (128, 64, 8, 4), 32: (128, 64, 8, 4), 64: (128, 64, 8, 4), 128: (128, 128, 8, 3),
           256: (64, 64, 8, 2)}
DKDV_CFG = {16: (32, 128, 4, 3), 32: (32, 128, 4, 3), 64: (32, 128, 4, 3), 128: (64, 128, 8, 3),
            256: (32, 64, 8, 2)}
DQ_CFG = {16: (128, 64, 8, 3), 32: (128, 64, 8, 3), 64: (128, 64, 8, 3), 128: (128, 64, 8, 3),
          256: (64, 32, 8, 2)}
# IEEE float32 dots run on the FMA units from registers: smaller tiles compile fast and do not spill.
FP32_CFG = {16: (64, 32, 4, 2), 32: (64, 32, 4, 2), 64: (32, 32, 4, 2), 128: (32, 32, 4, 2),
            256: (16, 32, 4, 1)}
INTERP_CFG = (32, 32, 4, 1)


class _Cfg:
    """Launch parameters for one call: per kernel (BLOCK_M, BLOCK_N, num_warps, num_stages)."""

    def __init__(self, fwd, dkdv, dq):
        self.fwd, self.dkdv, self.dq = list(fwd), list(dkdv), list(dq)


def _warps(bm, bn, dpad):
    return 8 if bm * max(bn, dpad) >= 128 * 128 else 4


def _config(block_q, block_k, dpad, overrides=None, fp32=False) -> _Cfg:
    if INTERPRET:
        base = {n: INTERP_CFG for n in ("fwd", "dkdv", "dq")}
    elif fp32:
        base = {n: FP32_CFG[dpad] for n in ("fwd", "dkdv", "dq")}
    else:
        base = {"fwd": FWD_CFG[dpad], "dkdv": DKDV_CFG[dpad], "dq": DQ_CFG[dpad]}
    cfg = {}
    for name, (bm, bn, w, st) in base.items():
        if block_q is not None or block_k is not None:
            bm = block_q if block_q is not None else bm
            bn = block_k if block_k is not None else bn
            w, st = (4, 1) if INTERPRET else (4 if fp32 else _warps(bm, bn, dpad), 1 if fp32 else 2)
        cfg[name] = (bm, bn, w, st)
    if overrides:
        cfg.update(overrides)
    return _Cfg(cfg["fwd"], cfg["dkdv"], cfg["dq"])


SMEM_BUDGET = 227 * 1024  # bytes per program: the most an H100/H200 block may use
FP32_WORK = 1 << 17  # BLOCK_M * BLOCK_N * D_PAD cap for IEEE float32 (FMA path: compile time grows with it)
# The general build's float32 cap (GENERAL_SCORES): its calls are launch-bound, and at 2^17 its dK/dV took
# 7-9 s to compile on a loaded H100 (D_PAD = 64 on 32 x 64 tiles, 128 on 32 x 32).
GENERAL_FP32_WORK = 1 << 15


def _smem(name, bm, bn, st, esize, dp, dvp):
    """Shared memory the kernel's tiles take (matches Triton's allocation for these kernels on sm_90
    to within a few hundred bytes): the resident tile plus num_stages copies of the streamed ones."""
    if name == "fwd":
        return esize * (bm * dp + max(st, 1) * bn * (dp + dvp))
    if name == "dkdv":
        return esize * (bn * (dp + dvp) + max(st, 1) * bm * (dp + dvp))
    return esize * (bm * (dp + dvp) + max(st, 1) * bn * (dp + dvp))  # dq


def _fit(cfg: _Cfg, esize, dp, dvp, fp32_work=FP32_WORK):
    """Lower tiles that would not fit (stages first, then the larger block, never below 16), and cap
    float32 tiles, before anything is compiled: a compile that then fails costs seconds to minutes."""
    for name in ("fwd", "dkdv", "dq"):
        c = getattr(cfg, name)
        while True:
            bm, bn, w, st = c
            over = _smem(name, bm, bn, st, esize, dp, dvp) > SMEM_BUDGET or (
                esize == 4 and bm * bn * max(dp, dvp) > fp32_work)
            if not over or max(bm, bn) <= 16 and st <= 1:
                break
            if st > 2 or (st == 2 and max(bm, bn) <= 16):
                c[3] = st - 1
            elif bm >= bn and bm > 16:
                c[0] = bm // 2
            elif bn > 16:
                c[1] = bn // 2
            else:
                c[3] = st - 1
    return cfg


def _launch(kernel, grid_fn, cfg, *args, **constexprs):
    """Launch with cfg = [BLOCK_M, BLOCK_N (None: the kernel has none), warps, stages]; on shared-memory
    overflow halve a block."""
    while True:
        bm, bn, w, st = cfg
        try:
            kernel[grid_fn(bm, bn)](*args, **warm.blocks(cfg), num_warps=w, num_stages=st, **constexprs)
            return
        except OutOfResources:
            if st > 1:
                cfg[3] = st - 1
            elif bn is not None and max(bm, bn) > 16:
                if bm >= bn:
                    cfg[0] = bm // 2
                else:
                    cfg[1] = bn // 2
            else:
                raise


def _check_device(*tensors):
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"{WHO}: q, k, v must be on one device, got {[str(x.device) for x in tensors]}")
    if INTERPRET:
        if dev.type != "cpu":
            raise ValueError(f"{WHO}: under TRITON_INTERPRET=1 the kernels run on CPU tensors, got {dev}")
    elif dev.type != "cuda":
        raise ValueError(f"{WHO}: needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got device {dev}")


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _dense(x):
    """x itself where it is contiguous, with the strides a fresh tensor of its shape has, at a 16-byte
    aligned address; else a contiguous copy. Triton specializes a kernel on the 16-divisibility of every
    stride and pointer, so a view's layout would compile the backward's kernels again for each
    layout met: on dense copies they depend on the shape alone. A copy reads and writes the tensor once,
    little beside the backward's quadratic work."""
    stride, n = [], 1
    for size in reversed(x.shape):
        stride.append(n)
        n *= size
    if x.stride() == tuple(reversed(stride)) and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True, eq=False)
class _Features:
    """One call's masking band and optional features, as the kernels take them (see triton_kernels)."""

    causal: bool = False  # keys past i + off are hidden (a causal mask or a window's right edge)
    off: int = 0
    left: bool = False  # keys before i + loff are hidden (a window's left edge)
    loff: int = 0
    diag: int = 0  # Sk - Sq, where ALiBi's distances are measured from
    softcap: float = 0.0
    slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    general: bool = False  # the general build (GENERAL_SCORES)

    def kernel_args(self, dummy, with_sinks=True):
        """Keyword arguments of the kernels; ``dummy`` (a float32 tensor) fills unused pointers."""
        args = dict(LOFF=self.loff, DIAG=self.diag, cap2=self.softcap * K.LOG2E_F,
                    SLOPES=dummy if self.slopes is None else self.slopes,
                    ssb=0 if self.slopes is None or self.slopes.ndim == 1 else self.slopes.stride(0),
                    CAUSAL=self.causal, LEFT=self.left, SOFTCAP=self.softcap_flag(), ALIBI=self.slopes is not None)
        if with_sinks:
            args.update(SINKS=dummy if self.sinks is None else self.sinks, HAS_SINKS=self.sinks is not None)
        return args

    def softcap_flag(self):
        """The kernels' SOFTCAP: 2 in the general build, which takes a cap of 0 as none at run time."""
        return 2 if self.general else self.softcap > 0


def one_loop(q, precision, feats: _Features | None = None) -> dict:
    """The kernels' ONE_LOOP flag: IEEE float32 and the general build run every tile through the masked
    loop (triton_kernels)."""
    return dict(ONE_LOOP=(feats is not None and feats.general) or (q.dtype == torch.float32 and precision == "ieee"))


def _pads(d, dv, feats: _Features) -> dict:
    """The head dims' padding; the general build masks the columns whether or not there is padding."""
    dpad, dvpad = _pad(d), _pad(dv)
    return dict(D_PAD=dpad, DV_PAD=dvpad, PAD_D=feats.general or dpad != d, PAD_DV=feats.general or dvpad != dv)


# The general build. A call of at most GENERAL_SCORES score entries (B * Hq * Sq * Sk) runs in
# microseconds, less than its launches, and compiling a build for it takes seconds. Such calls run one
# build per dtype, tiles, padded head dims and sinks: the band always on (a right edge at the last key
# where there is no causal mask or window edge, a left edge before the first key where there is none),
# ALiBi always on (slopes of 0 where there are none), the softcap decided at run time (SOFTCAP = 2), every
# tile through the masked loop, the head dims' columns masked, and no integer or pointer specialized
# (triton_kernels._unspecialized). A run of many small shapes (a test suite's, a server's) then compiles
# each of those once instead of once per causal flag, window edge, softcap, ALiBi, exact or padded head
# dim, and 16-divisible or unit stride, length or head count. Larger calls keep the specialized build.
# IEEE float32 is in it too, on tiles capped at GENERAL_FP32_WORK: at D_PAD = 128 (16 x 16 tiles) an
# H100 compiled its three kernels in 4.7 s, where the specialized build (32 x 32) took 20 s for six, three
# per causal flag, and its forward + backward ran as fast at 2^17 to 2^20 score entries (about 1 ms,
# host-bound; docs/gpu-lane.md, eighth session). Under the interpreter every call takes the specialized
# build unless asked (general=True): it is the one the CPU lane and the mutants test, and
# tests/test_triton_band.py tests the general one.
GENERAL_SCORES = 0 if INTERPRET else 1 << 20


def _kernel(kernels, name, feats: _Features):
    """Kernel ``name`` of module ``kernels``, in its unspecialized build for the general build's calls."""
    return getattr(kernels, name + "_general") if feats.general else getattr(kernels, name)


def _general(feats: _Features, q, sk) -> _Features:
    """``feats`` as the general build takes them: both edges of the band on, where they hide nothing,
    and ALiBi on, with slopes of 0 where there are none (s - 0 * |i - j| is s exactly)."""
    sq = q.shape[2]
    off = min(feats.off, sk) if feats.causal else sk  # j <= i + Sk: every key
    loff = feats.loff if feats.left else -sq  # j >= i - Sq: every key
    slopes = feats.slopes if feats.slopes is not None else torch.zeros(q.shape[1], device=q.device)
    return replace(feats, causal=True, off=off, left=True, loff=loff, slopes=slopes, general=True)


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _float32_vector(x, label, shapes, q, who=WHO):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: {label} must be a torch tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{who}: {label} must be float32, got {dtype_name(x)}")
    if tuple(x.shape) not in shapes:
        raise ValueError(f"{who}: {label} must have shape {' or '.join(map(str, shapes))}, got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{who}: {label} is on {x.device} but q is on {q.device}")
    return x.contiguous()


def _features(q, k, align, window=None, softcap=0.0, alibi_slopes=None, sinks=None) -> _Features:
    """Validate the optional arguments and turn them into the kernels' band and flags.

    Edges that hide nothing (a right edge at or past the last key of row 0, a left edge at or before
    key 0 for the last row) are dropped, so a window as wide as the sequence runs the plain kernel.
    """
    b, hq, sq = q.shape[:3]
    sk = k.shape[2]
    causal, off = align is not None, offset(sq, sk, align)
    left, loff = False, 0
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(map(_is_int, window))
                and min(window) >= -1):
            raise ValueError(f"{WHO}: window must be (left, right), two ints >= -1 (-1: unbounded), got {window!r}")
        wl, wr = int(window[0]), int(window[1])
        if 0 <= wr < sq - 1:
            off = min(off, sk - sq + wr) if causal else sk - sq + wr
            causal = True
        if 0 <= wl < sk - 1:
            left, loff = True, sk - sq - wl
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) \
            or softcap < 0:
        raise ValueError(f"{WHO}: softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    slopes = None if alibi_slopes is None else _float32_vector(alibi_slopes, "alibi_slopes", [(hq,), (b, hq)], q)
    sinks = None if sinks is None else _float32_vector(sinks, "sinks", [(hq,)], q)
    # Caps below 1e-30 run as 1e-30 so the kernels' float32 constants stay normal: the capped logits
    # are within 1e-30 of 0 either way, far below any rounding of the softmax.
    cap = max(float(softcap), SOFTCAP_MIN) if softcap > 0 else 0.0
    return _Features(causal, off, left, loff, sk - sq if slopes is not None else 0, cap, slopes, sinks)


def _sink_grad(sinks, lse, delta):
    """d/d sink_h of sum(O * dO) = -sum over (b, i) of P_sink[b, h, i] * rowsum(dO * O)[b, h, i]."""
    p = torch.exp(sinks[None, :, None] - lse)
    p = torch.where(lse == -math.inf, 0.0, p)  # a sink of -inf over a row that sees no key: exp(nan)
    return -(p * delta).sum(dim=(0, 2))


def _forward(q, k, v, align, scale, precision, cfg: _Cfg, kernels=K, out=None, feats: _Features | None = None):
    """out=(o, lse) writes into given buffers (the reliability tests pass NaN-filled ones)."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if out is None:
        o = torch.empty((b, hq, sq, dv), device=q.device, dtype=q.dtype)
        lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    else:
        o, lse = out
    feats = feats or _features(q, k, align)
    _launch(_kernel(kernels, "attn_fwd", feats), lambda bm, bn: (triton.cdiv(sq, bm), hq, b), cfg.fwd,
            q, k, v, o, lse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            hq, hq // hkv, sq, sk, d, dv, feats.off, scale * K.LOG2E_F, **feats.kernel_args(lse),
            **_pads(d, dv, feats), DOT_PREC=precision, **one_loop(q, precision, feats))
    return o, lse


def _bwd_launches(do, q, k, v, o, lse, delta, dq, dk, dvv, scale, precision, cfg: _Cfg, kernels, feats: _Features):
    """The backward's launches in order, as (kernel, grid_fn, cfg, args, keyword arguments): dQ first, as it
    stores the delta = rowsum(dO * O) that dK/dV reads."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    common = dict(**feats.kernel_args(lse, with_sinks=False), **_pads(d, dv, feats), DOT_PREC=precision,
                  **one_loop(q, precision, feats))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    do_strides = (do.stride(0), do.stride(1), do.stride(2))
    return [(_kernel(kernels, "attn_bwd_dq", feats), lambda bm, bn: (triton.cdiv(sq, bm), hq, b), cfg.dq,
             (q, k, v, o, do, lse, delta, dq, *strides, o.stride(0), o.stride(1), o.stride(2), *do_strides,
              dq.stride(0), dq.stride(1), dq.stride(2), hq, hq // hkv, sq, sk, d, dv, feats.off,
              scale * K.LOG2E_F, scale), common),
            (_kernel(kernels, "attn_bwd_dkdv", feats), lambda bm, bn: (triton.cdiv(sk, bn), hkv, b), cfg.dkdv,
             (q, k, v, do, lse, delta, dk, dvv, *strides, *do_strides, dk.stride(0), dk.stride(1), dk.stride(2),
              dvv.stride(0), dvv.stride(1), dvv.stride(2), hq, hkv, hq // hkv, sq, sk, d, dv, feats.off,
              scale * K.LOG2E_F, scale), common)]


def _bwd_key(q, k, v, o, precision, cfg: _Cfg, kernels, feats: _Features):
    """What the backward's compiles depend on (more finely than Triton's own keys: exact shapes). Its
    tensors are dense (_dense), so their shapes give their strides and alignment."""
    return (id(kernels), q.device, precision, tuple(cfg.dkdv), tuple(cfg.dq), feats.general, feats.causal, feats.left,
            feats.softcap_flag(), None if feats.slopes is None or feats.general else feats.slopes.ndim,
            *((x.dtype, tuple(x.shape)) for x in (q, k, v, o)))


def _compile_backward_ahead(q, k, v, o, lse, scale, precision, cfg: _Cfg, kernels, feats: _Features) -> list:
    """Start the backward's compiles while the forward runs (triton_warm), for a dO laid out as O is."""
    if INTERPRET:
        return []

    def launches():  # on dense tensors, as the backward runs: they stand in for dO, dQ, dK and dV too
        qd, kd, vd, od = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, o))
        return _bwd_launches(od, qd, kd, vd, od, lse, torch.empty_like(lse), qd, kd, vd, scale, precision, cfg,
                             kernels, feats)

    return warm.ahead(_bwd_key(q, k, v, o, precision, cfg, kernels, feats), launches, q.device)


def _backward(do, q, k, v, o, lse, align, scale, precision, cfg: _Cfg, kernels=K, out=None,
              feats: _Features | None = None, compiling=()):
    """(dq, dk, dv, dsinks or None). out=(delta, dq, dk, dv) writes into given buffers (the reliability
    tests pass NaN-filled ones). ``compiling``: the futures of compiles started by the forward."""
    do, q, k, v, o = (_dense(x) for x in (do, q, k, v, o))
    feats = feats or _features(q, k, align)
    if out is None:
        delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dvv = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:
        delta, dq, dk, dvv = out
    launches = _bwd_launches(do, q, k, v, o, lse, delta, dq, dk, dvv, scale, precision, cfg, kernels, feats)
    warm.wait(compiling)
    if not INTERPRET:  # a forward that compiled nothing ahead (a backward called alone): compile both at once
        warm.wait(warm.ahead(_bwd_key(q, k, v, o, precision, cfg, kernels, feats), lambda: launches, q.device))
    for kernel, grid_fn, c, args, kwargs in launches:
        _launch(kernel, grid_fn, c, *args, **kwargs)
    dsinks = None if feats.sinks is None else _sink_grad(feats.sinks, lse, delta)
    return dq, dk, dvv, dsinks


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, align, scale, precision, cfg, kernels, feats, grad):
        o = torch.empty((*q.shape[:3], v.shape[3]), device=q.device, dtype=q.dtype)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        ctx.compiling = _compile_backward_ahead(q, k, v, o, lse, scale, precision, cfg, kernels, feats) if grad else []
        _forward(q, k, v, align, scale, precision, cfg, kernels, out=(o, lse), feats=feats)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (align, scale, precision, cfg, kernels)
        ctx.feats = feats  # holds sinks and slopes, which autograd hands in unchanged
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = _backward(do, q, k, v, o, lse, *ctx.args, feats=ctx.feats, compiling=ctx.compiling)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


def flash_attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None,
                    sinks=None, block_q=None, block_k=None, precision="ieee", configs=None, kernels=K, general=None):
    """The full entry point. ``configs`` overrides launch parameters per kernel, e.g.
    ``{"fwd": (128, 64, 8, 3)}`` as (BLOCK_M, BLOCK_N, num_warps, num_stages) (used by the benchmark);
    ``kernels`` is the module the Triton kernels come from (a mutant's build); ``general`` picks the
    general build (True) or the specialized one (False) instead of by size (GENERAL_SCORES)."""
    b, hq, hkv, sq, sk, d, dv = check_inputs(q, k, v, dtypes=DTYPES, who=WHO)
    if INTERPRET and "bfloat16" in (dtype_name(q),):  # pragma: no cover  (check_inputs already refuses)
        raise TypeError(f"{WHO}: the Triton interpreter computes bfloat16 wrongly; not supported there")
    if max(d, dv) > 256:
        raise ValueError(f"{WHO}: head dims up to 256 are supported, got D={d}, Dv={dv}")
    _check_device(q, k, v)
    align = alignment(causal)
    if precision not in PRECISIONS:
        raise ValueError(f"{WHO}: precision must be one of {PRECISIONS}, got {precision!r}")
    for label, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk is not None and (isinstance(blk, bool) or not isinstance(blk, int) or blk < 16
                                or blk & (blk - 1) or blk > 256):
            raise ValueError(f"{WHO}: {label} must be a power of two in 16..256, got {blk!r}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if general is None:
        general = b * hq * sq * sk <= GENERAL_SCORES
    cfg = _config(block_q, block_k, _pad(max(d, dv)), configs, fp32=dtype_name(q) == "float32")
    if not INTERPRET:
        cfg = _fit(cfg, q.element_size(), _pad(d), _pad(dv), GENERAL_FP32_WORK if general else FP32_WORK)
    feats = _features(q, k, align, window, softcap, alibi_slopes, sinks)
    if general:
        feats = _general(feats, q, sk)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, feats.sinks) if x is not None)
    return _FlashAttention.apply(q, k, v, feats.sinks, align, scale, precision, cfg, kernels, feats, grad)


# What triton-fused declares; its mutants (mutants/triton.py) declare the same.
DECLARED = dict(causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cpu",) if INTERPRET else ("cuda",),
                backward=True, gqa=True, lse=True, framework="torch", blocks=BLOCKS, head_dims=(1, 256),
                max_seq=INTERPRET_MAX_SEQ, window=True, softcap=True, alibi=True, sinks=True,
                layouts=tuple(MEMORY),  # Triton specializes on pointer alignment: any view works
                # On CPU, in Triton's interpreter, the full property run takes about 13 CPU-minutes: opt-in
                # there (pytest -m "properties and interpreter" --impl triton-fused); CI still runs the
                # Triton mutants through the interpreter (mutants/test_mutants.py).
                tags=("interpreter", "slow") if INTERPRET else ())


@implementation(name="triton-fused", **DECLARED)
def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None,
              block_q=None, block_k=None, precision="ieee"):
    """Fused FlashAttention; returns (O, LSE). float32 dots are IEEE unless precision="tf32"."""
    return flash_attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, block_q=block_q, block_k=block_k,
                           precision=precision)
