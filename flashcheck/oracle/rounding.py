"""The rounding model: what a correct fused FlashAttention kernel computes, emulated in NumPy.

A fused kernel does not compute "attention in float16". It reads float16 (or bfloat16) inputs,
forms the scores S and the softmax statistics in float32, rounds the probabilities P to the
input type only to feed the P @ V product, accumulates in float32 and rounds O once at the end;
its LSE stays float32. The backward recomputes P in float32 from the LSE, rounds P for dV and
dS for dQ and dK, and again accumulates in float32. ``fused`` reproduces those steps exactly
(NumPy's float32 matmul accumulates in float32, as tensor cores do), so the oracle can read off
the error a correct kernel makes on each entry of each result.

Correct kernels also round at other places (``Sites``, the catalogue; docs/oracle.md says which
real kernels do what). ``fused(..., sites=...)`` emulates each one, and the oracle's rule admits
each one, either always or under a declared precision:

| site | admitted by |
|---|---|
| dS rounded after it is multiplied by the scale | always |
| with GQA, each query head's dK and dV rounded to the input type, then summed over the group (FlashAttention-2, SDPA flash) | always |
| an exp2 softmax: scores times log2(e), the max and the LSE in log2 units, times ln 2 at the end (FlashAttention, FlexAttention) | always |
| TF32 operands rounded to nearest (JAX Pallas) or by truncation (Triton's dots on an H200) | "tf32" |
| P divided by its row sum before it is rounded, dP rounded to the input type; autodiff's softmax vjp, D = rowsum(dP * P), with dS kept in float32 (dense attention with a float32 softmax and its autodiff: XLA) | "dense" |
| q * scale, or k * scale * log2(e), rounded to the input type before QK^T (Triton's tutorial) | "prescaled" |
| D = rowsum(dO * O) from products rounded to the input type, D itself rounded to it (JAX Pallas's mha) | "delta" |

Declared precisions combine with "+" ("tf32+prescaled"). "naive" is plain dense attention
computed in the input type; the oracle keeps its older, looser rule for kernels that declare it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

# The vocabulary every part shares: the dtypes (float64 first, where shrinking ends when a bug is
# not about precision), the half-precision ones, and the results an attention call gives.
DTYPES = ("float64", "float32", "float16", "bfloat16")
HALF = ("float16", "bfloat16")
RESULTS = ("o", "lse", "dq", "dk", "dv")
SITES = ("tf32", "dense", "prescaled", "delta")  # the declarable rounding sites, in their canonical order
PRECISIONS = ("fused",) + tuple("+".join(c) for n in range(1, len(SITES) + 1)
                                for c in itertools.combinations(SITES, n)) + ("naive",)
DECLARES = {"tf32": "matmul operands rounded to TF32 (10 mantissa bits), to nearest or by truncation",
            "dense": "P normalized before it is rounded, and dP rounded to the input type (dense attention "
                     "with a float32 softmax, and its autodiff)",
            "prescaled": "q*scale or k*scale*log2(e) rounded to the input type before the dot product",
            "delta": "the backward's D = rowsum(dO * O) from products rounded to the input type, and D rounded to it",
            "naive": "plain dense attention computed in the input type"}
LOG2E = 1.4426950408889634


def round_to(x: np.ndarray, fmt: str, truncate: bool = False) -> np.ndarray:
    """Round to the nearest ``fmt`` value (float64/float32/float16/bfloat16/tf32), kept in float32 or
    float64; with ``truncate``, tf32 drops its bits towards zero instead (as tensor cores may)."""
    if fmt == "float64":
        return np.asarray(x, np.float64)
    x = np.asarray(x, np.float32)
    if fmt == "float32":
        return x
    if fmt == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    drop = {"bfloat16": 16, "tf32": 13}[fmt]  # mantissa bits a float32 loses, rounded to nearest even
    bits = x.view(np.uint32).astype(np.uint64)
    if not (truncate and fmt == "tf32"):
        half, lsb = (1 << (drop - 1)) - 1, (bits >> drop) & 1
        bits = bits + half + lsb
    bits = bits >> drop << drop
    return bits.astype(np.uint32).view(np.float32)


@dataclass(frozen=True)
class Precision:
    """Where a kernel of dtype t with this declared precision may round.

    acc: the accumulation type; p_fmt: what P and dS are rounded to before their products;
    operand_fmt: what q, k, v, dO are rounded to inside products (tf32); out_fmt: O and gradients,
    which is also the input type. truncate: TF32 may truncate; p_normalized ("dense": P normalized
    before it is rounded, dP rounded to t), prescaled and delta: the other declarable sites.
    """

    acc: str
    p_fmt: str
    operand_fmt: str
    out_fmt: str
    truncate: bool = False
    p_normalized: bool = False
    prescaled: bool = False
    delta: bool = False

    @classmethod
    def of(cls, dtype: str, precision: str = "fused") -> "Precision":
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        parts = set(precision.split("+"))
        if dtype == "float64":
            return cls("float64", "float64", "float64", "float64")
        sites = dict(p_normalized="dense" in parts, prescaled="prescaled" in parts, delta="delta" in parts)
        if dtype in HALF:
            return cls("float32", dtype, "float32", dtype, **sites)
        tf32 = "tf32" if "tf32" in parts else "float32"
        return cls("float32", tf32, tf32, "float32", truncate="tf32" in parts, **sites)


@dataclass(frozen=True)
class Sites:
    """Which rounding a kernel does where it may differ from the model (the module's table)."""

    tf32_truncate: bool = False  # TF32 operands truncated, not rounded to nearest
    p_normalized: bool = False  # P / rowsum rounded to the P @ V operand type, not exp(s - m)
    dp_rounded: bool = False  # dP = dO V^T rounded to the input type
    prescaled: str | None = None  # "q": q * scale rounded to t; "k": k * scale * log2(e), base-2 softmax
    ds_scaled: bool = False  # dS * scale rounded, not dS
    heads_rounded: bool = False  # GQA: each query head's dK, dV rounded to t before the group's sum
    exp2: bool = False  # scores times log2(e) in the accumulator, exp2, the LSE kept in log2 units (times ln 2 at the end)
    delta_rounded: bool = False  # D = rowsum(dO * O): each product rounded to t, the float32 sum rounded to t
    softmax_vjp: bool = False  # autodiff of a dense softmax: D = rowsum(dP * P), with the float32 P
    ds_float32: bool = False  # dS times the scale kept in float32 for its products (XLA's autodiff)

    def admitted_by(self, dtype: str) -> str:
        """The smallest precision whose rule admits these sites for inputs of ``dtype``."""
        parts = [n for n, on in (("tf32", self.tf32_truncate and dtype == "float32"),
                                 ("dense", self.p_normalized or (self.dp_rounded and dtype in HALF)),
                                 ("prescaled", self.prescaled is not None),
                                 ("delta", self.delta_rounded and dtype in HALF)) if on]
        return "+".join(parts) or "fused"


def _grouped(x, hkv):
    b, h = x.shape[:2]
    return x.reshape((b, hkv, h // hkv) + x.shape[2:])


def fused(q, k, v, do, visible, scale: float, pr: Precision, sites: Sites = Sites()) -> dict:
    """Forward and backward as a correct fused kernel computes them; float64 arrays of the results.

    q, k, v, do hold values exact in the input dtype; ``visible`` is the (Sq, Sk) mask.
    """
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    acc = np.float64 if pr.acc == "float64" else np.float32
    tr = sites.tf32_truncate  # only TF32 truncates: conversions to float16 and bfloat16 round to nearest
    op = lambda x: round_to(x, pr.operand_fmt, tr).astype(acc)  # noqa: E731
    rp = lambda x: round_to(x, pr.p_fmt, tr).astype(acc)  # noqa: E731
    rt = lambda x: round_to(x, pr.out_fmt).astype(acc)  # noqa: E731  (to the input type)
    q0, k0 = _grouped(q.astype(acc), hkv), k.astype(acc)[:, :, None]
    qg, dog = op(q0), _grouped(op(do), hkv)  # (B, Hkv, G, Sq, .)
    kg, vg = op(k0), op(v)[:, :, None]  # (B, Hkv, 1, Sk, .)
    sc = acc(scale)
    # S and the softmax statistics in the accumulation type; a pre-scaled kernel forms its scores
    # from operands already multiplied by the scale (and log2 e, for an exp2 softmax) in t.
    base, qs, ks = acc(1.0), qg, kg
    if sites.prescaled == "q":
        qs = op(rt(q0 * sc))  # pre-scaled from the loaded q: TF32 rounds the product once
        s = qs @ np.swapaxes(kg, -1, -2)
    elif sites.prescaled == "k":
        base, ks = acc(np.log(2.0)), op(rt(k0 * (sc * acc(LOG2E))))
        s = qg @ np.swapaxes(ks, -1, -2)  # base-2 logits
    elif sites.exp2:  # FlashAttention's, Triton's tutorial's and FlexAttention's softmax
        base = acc(np.log(2.0))
        s = ((qg @ np.swapaxes(kg, -1, -2)) * sc) * acc(LOG2E)
    else:
        s = (qg @ np.swapaxes(kg, -1, -2)) * sc
    s = np.where(visible, s, -np.inf).astype(acc)
    exp = np.exp if base == 1 else np.exp2
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(acc)  # a row that sees nothing: exp(-inf) = 0
    p = exp(s - m)
    l = p.sum(axis=-1, keepdims=True, dtype=acc)
    # P rounded to the input type before P @ V; O normalized once (or P first), then rounded.
    if sites.p_normalized:
        o = rp(np.divide(p, l, out=np.zeros_like(p), where=l > 0)) @ vg
    else:
        o_acc = rp(p) @ vg
        o = np.divide(o_acc, l, out=np.zeros_like(o_acc), where=l > 0)
    o_t = round_to(o, pr.out_fmt).astype(acc)
    with np.errstate(divide="ignore"):
        lse_b = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)) / base, -np.inf)[..., 0].astype(acc)
    # Backward: P from the LSE in the accumulation type; D from the O the kernel returned.
    shift = np.where(np.isfinite(lse_b), lse_b, np.inf)[..., None].astype(acc)
    p = exp(s - shift)
    group = (lambda x: rt(x).sum(axis=2, dtype=acc)) if sites.heads_rounded else (lambda x: x.sum(axis=2, dtype=acc))
    dv = group(np.swapaxes(rp(p), -1, -2) @ dog)
    dp = dog @ np.swapaxes(vg, -1, -2)
    if sites.dp_rounded:
        dp = rt(dp)
    if sites.delta_rounded:  # Pallas: jnp.sum(o * do) on half operands, stored through the input type
        delta = rt(rt(dog * o_t).sum(axis=-1, keepdims=True, dtype=acc))
    elif sites.softmax_vjp:  # the softmax's own vjp: the dP it was handed, against its float32 P
        delta = (dp * p).sum(axis=-1, keepdims=True, dtype=acc)
    else:
        delta = (dog * o_t).sum(axis=-1, keepdims=True, dtype=acc)
    ds = p * (dp - delta)
    # dQ = dS K scale and dK = dS^T Q scale; a pre-scaled operand already carries the scale.
    q_sc, k_sc = (sc, acc(1.0)) if sites.prescaled == "q" else (acc(1.0), sc) if sites.prescaled == "k" else (sc, sc)
    q_for_dk = qs if sites.prescaled == "q" else qg
    if sites.ds_float32:  # XLA: the float32 dS times the scale feeds float32 (or TF32) products
        ds_sc = op(ds * sc)
        dq, dk = ds_sc @ kg, group(np.swapaxes(ds_sc, -1, -2) @ qg)
    else:  # dS rounded to the operand type of its products
        if sites.prescaled == "k":  # dS K' ln 2 = dS K scale, with K' the pre-scaled K
            dq = (rp(ds) @ ks) * base
        elif sites.ds_scaled:
            dq = rp(ds * sc) @ kg
        else:
            dq = (rp(ds) @ kg) * q_sc
        if sites.ds_scaled and sites.prescaled != "q":
            dk = group(np.swapaxes(rp(ds * sc), -1, -2) @ q_for_dk)
        else:
            dk = group((np.swapaxes(rp(ds), -1, -2) @ q_for_dk) * k_sc)
    out = lambda x: round_to(x, pr.out_fmt).astype(np.float64)  # noqa: E731
    lse = (lse_b * base).astype(np.float64)  # back from log2 units in the accumulator, as a kernel does
    return {"o": out(o_t.reshape(b, hq, sq, -1)), "lse": lse.reshape(b, hq, sq),
            "dq": out(dq.reshape(q.shape)), "dk": out(dk), "dv": out(dv)}
