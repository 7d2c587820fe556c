"""The rounding model: what a correct fused FlashAttention kernel computes, emulated in NumPy.

A fused kernel does not compute "attention in float16". It reads float16 (or bfloat16) inputs,
forms the scores S and the softmax statistics in float32, rounds the probabilities P to the
input type only to feed the P @ V product, accumulates in float32 and rounds O once at the end;
its LSE stays float32. The backward recomputes P in float32 from the LSE, rounds P for dV and
dS for dQ and dK, and again accumulates in float32. ``fused`` reproduces those steps exactly
(NumPy's float32 matmul accumulates in float32, as tensor cores do), so the oracle can read off
the error a correct kernel makes on each entry of each result.

Precisions (``Precision``) name where rounding happens:
- "fused": the steps above; for float32 inputs nothing is rounded below float32, for float64
  everything stays float64.
- "tf32": float32 inputs whose matmul operands are rounded to TF32 (10 mantissa bits), as
  tensor cores do when TF32 is allowed.
- "naive": plain dense attention computed in the input type; the oracle keeps its older,
  looser rule for kernels that declare it (see oracle.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRECISIONS = ("fused", "tf32", "naive")
HALF = ("float16", "bfloat16")


def round_to(x: np.ndarray, fmt: str) -> np.ndarray:
    """Round to the nearest ``fmt`` value (float64/float32/float16/bfloat16/tf32), kept in float32 or float64."""
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
    half, lsb = (1 << (drop - 1)) - 1, (bits >> drop) & 1
    bits = (bits + half + lsb) >> drop << drop
    return bits.astype(np.uint32).view(np.float32)


@dataclass(frozen=True)
class Precision:
    """Where a kernel of dtype t with this declared precision rounds.

    acc: the accumulation type; p_fmt: what P and dS are rounded to before their products;
    operand_fmt: what q, k, v, dO are rounded to inside products (tf32); out_fmt: O and gradients.
    """

    acc: str
    p_fmt: str
    operand_fmt: str
    out_fmt: str

    @classmethod
    def of(cls, dtype: str, precision: str = "fused") -> "Precision":
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if dtype == "float64":
            return cls("float64", "float64", "float64", "float64")
        if dtype in HALF:
            return cls("float32", dtype, "float32", dtype)
        tf32 = "tf32" if precision == "tf32" else "float32"
        return cls("float32", tf32, tf32, "float32")


def _grouped(x, hkv):
    b, h = x.shape[:2]
    return x.reshape((b, hkv, h // hkv) + x.shape[2:])


def fused(q, k, v, do, visible, scale: float, pr: Precision) -> dict:
    """Forward and backward as a correct fused kernel computes them; float64 arrays of the results.

    q, k, v, do hold values exact in the input dtype; ``visible`` is the (Sq, Sk) mask.
    """
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    acc = np.float64 if pr.acc == "float64" else np.float32
    op = lambda x: round_to(x, pr.operand_fmt).astype(acc)  # noqa: E731
    rp = lambda x: round_to(x, pr.p_fmt).astype(acc)  # noqa: E731
    qg, dog = _grouped(op(q), hkv), _grouped(op(do), hkv)  # (B, Hkv, G, Sq, .)
    kg, vg = op(k)[:, :, None], op(v)[:, :, None]  # (B, Hkv, 1, Sk, .)
    sc = acc(scale)
    # S and the softmax statistics in the accumulation type.
    s = np.where(visible, (qg @ np.swapaxes(kg, -1, -2)) * sc, -np.inf).astype(acc)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(acc)  # a row that sees nothing: exp(-inf) = 0
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True, dtype=acc)
    # P rounded to the input type before P @ V; O normalized once, then rounded.
    o_acc = rp(p) @ vg
    o = np.divide(o_acc, l, out=np.zeros_like(o_acc), where=l > 0)
    o_t = round_to(o, pr.out_fmt).astype(acc)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0].astype(acc)
    # Backward: P from the LSE in the accumulation type; D from the O the kernel returned.
    shift = np.where(np.isfinite(lse), lse, np.inf)[..., None].astype(acc)
    p = np.exp(s - shift)
    dv = (np.swapaxes(rp(p), -1, -2) @ dog).sum(axis=2, dtype=acc)
    dp = dog @ np.swapaxes(vg, -1, -2)
    delta = (dog * o_t).sum(axis=-1, keepdims=True, dtype=acc)
    ds = rp(p * (dp - delta))
    dq = (ds @ kg) * sc
    dk = (np.swapaxes(ds, -1, -2) @ qg).sum(axis=2, dtype=acc) * sc
    out = lambda x: round_to(x, pr.out_fmt).astype(np.float64)  # noqa: E731
    return {"o": out(o_t.reshape(b, hq, sq, -1)), "lse": lse.reshape(b, hq, sq).astype(np.float64),
            "dq": out(dq.reshape(q.shape)), "dk": out(dk), "dv": out(dv)}
