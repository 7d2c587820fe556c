"""Fused kernels with precision bugs, for float16 and bfloat16 only: one bug class per mutant.

The kernel follows FlashAttention-2's rounding exactly (flashcheck/oracle/rounding.py describes it): scores
and softmax statistics in float32, P rounded to the input type before P @ V, float32
accumulators, O rounded once, an float32 LSE; the backward recomputes P from the LSE and rounds
P and dS before their products. It is emulated in NumPy, tile by tile (32 x 32), so that a bug
that rounds an accumulator to the input type after every tile grows with the sequence as it
does on a GPU. Like flash_attn_func, most mutants return no LSE.

``correct`` has no bug and must pass every property (the false-alarm check).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from flashcheck import implementation
from flashcheck.contract.checks import alignment, check_inputs
from flashcheck.oracle.rounding import round_to
from flashcheck.strategies.case import visible

BUGS = {
    "o_accumulated_in_half": "O accumulated in the input type across key tiles",
    "dv_accumulated_in_half": "dV accumulated in the input type across query tiles",
    "dq_accumulated_in_half": "dQ accumulated in the input type across key tiles",
    "rowsum_in_half": "softmax running sum kept in the input type",
    "scores_in_half": "scores rounded to the input type before the softmax",
    "exp_argument_in_half": "s - max rounded to the input type before exp",
    "lse_in_half": "LSE rounded to the input type (bfloat16-sized error in a float32 LSE)",
}
BLOCK = 32
F32 = np.float32


def _tiles(n):
    return [(a, min(a + BLOCK, n)) for a in range(0, n, BLOCK)]


def forward(qg, kg, vg, t, align, scale, bug):
    """Online softmax over key tiles; qg (B, Hkv, G, Sq, D) against kg, vg (B, Hkv, 1, Sk, .)."""
    sq, sk = qg.shape[-2], kg.shape[-2]
    r = lambda x: round_to(x, t).astype(F32)  # noqa: E731
    m = np.full(qg.shape[:-1], -np.inf, F32)
    l = np.zeros(qg.shape[:-1], F32)
    acc = np.zeros(qg.shape[:-1] + (vg.shape[-1],), F32)
    for k0, k1 in _tiles(sk):
        s = (qg @ np.swapaxes(kg[..., k0:k1, :], -1, -2)) * F32(scale)
        if bug == "scores_in_half":
            s = r(s)
        s = np.where(visible(sq, sk, align, np.arange(sq), np.arange(k0, k1)), s, -np.inf)
        m_new = np.maximum(m, s.max(-1))
        shift = np.where(np.isfinite(m_new), m_new, 0).astype(F32)
        arg = s - shift[..., None]
        p = np.exp(r(arg) if bug == "exp_argument_in_half" else arg)
        alpha = np.exp(m - shift)  # rescales what earlier tiles summed
        l = alpha * l + p.sum(-1, dtype=F32)
        acc = alpha[..., None] * acc + r(p) @ vg[..., k0:k1, :]
        if bug == "rowsum_in_half":
            l = r(l)
        if bug == "o_accumulated_in_half":
            acc = r(acc)
        m = m_new
    o = np.divide(acc, l[..., None], out=np.zeros_like(acc), where=l[..., None] > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf).astype(F32)
    return r(o), (r(lse) if bug == "lse_in_half" else lse)


def backward(qg, kg, vg, o, lse, dog, t, align, scale, bug):
    """FlashAttention-2: outer loop over key tiles, inner over query tiles; P from the LSE."""
    sq, sk = qg.shape[-2], kg.shape[-2]
    r = lambda x: round_to(x, t).astype(F32)  # noqa: E731
    delta = (dog * o).sum(-1, dtype=F32)
    shift = np.where(np.isfinite(lse), lse, np.inf).astype(F32)
    dq = np.zeros(qg.shape, F32)
    dk = np.zeros(kg.shape[:2] + kg.shape[-2:], F32)
    dv = np.zeros(vg.shape[:2] + vg.shape[-2:], F32)
    for k0, k1 in _tiles(sk):
        kt, vt = kg[..., k0:k1, :], vg[..., k0:k1, :]
        for q0, q1 in _tiles(sq):
            s = (qg[..., q0:q1, :] @ np.swapaxes(kt, -1, -2)) * F32(scale)
            s = np.where(visible(sq, sk, align, np.arange(q0, q1), np.arange(k0, k1)), s, -np.inf)
            arg = s - shift[..., q0:q1, None]
            p = np.exp(r(arg) if bug == "exp_argument_in_half" else arg)
            dv[..., k0:k1, :] += (np.swapaxes(r(p), -1, -2) @ dog[..., q0:q1, :]).sum(2, dtype=F32)
            if bug == "dv_accumulated_in_half":
                dv[..., k0:k1, :] = r(dv[..., k0:k1, :])
            dp = dog[..., q0:q1, :] @ np.swapaxes(vt, -1, -2)
            ds = r(p * (dp - delta[..., q0:q1, None]))
            dq[..., q0:q1, :] += (ds @ kt) * F32(scale)
            if bug == "dq_accumulated_in_half":
                dq[..., q0:q1, :] = r(dq[..., q0:q1, :])
            dk[..., k0:k1, :] += (np.swapaxes(ds, -1, -2) @ qg[..., q0:q1, :]).sum(2, dtype=F32) * F32(scale)
    return dq, dk, dv


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, align, scale, bug):
        t = str(q.dtype).removeprefix("torch.")
        b, hq, sq, _ = q.shape
        hkv = k.shape[1]
        qg, kg, vg = (x.detach().float().numpy() for x in (q, k, v))
        qg, kg, vg = qg.reshape(b, hkv, hq // hkv, sq, -1), kg[:, :, None], vg[:, :, None]
        o, lse = forward(qg, kg, vg, t, align, scale, bug)
        ctx.state = (qg, kg, vg, o, lse, t, align, scale, bug, q.shape)
        return (torch.from_numpy(o.reshape(b, hq, sq, -1)).to(q.dtype),
                torch.from_numpy(np.ascontiguousarray(lse.reshape(b, hq, sq))))

    @staticmethod
    def backward(ctx, do, _dlse):
        qg, kg, vg, o, lse, t, align, scale, bug, shape = ctx.state
        dog = do.float().numpy().reshape(o.shape)
        dq, dk, dv = backward(qg, kg, vg, o, lse, dog, t, align, scale, bug)
        back = lambda x, s: torch.from_numpy(round_to(x, t).astype(F32).reshape(s)).to(do.dtype)  # noqa: E731
        return back(dq, shape), back(dk, dk.shape), back(dv, dv.shape), None, None, None


def _make(bug):
    @implementation(name=f"precision-{bug or 'correct'}", causal=("bottom_right", "top_left"),
                    dtypes=("float16", "bfloat16"), backward=True, gqa=True, lse=bug == "lse_in_half",
                    register=False)
    def attention(q, k, v, *, causal=False, scale=None):
        check_inputs(q, k, v, dtypes=("float16", "bfloat16"), who="precision mutant")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        o, lse = _Fused.apply(q, k, v, alignment(causal), scale, bug)
        return (o, lse) if bug == "lse_in_half" else o

    attention.__name__ = bug or "correct"
    return attention


correct = _make(None)
globals().update({bug: _make(bug) for bug in BUGS})
