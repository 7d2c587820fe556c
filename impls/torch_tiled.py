"""PyTorch tiled FlashAttention: online-softmax forward, FlashAttention-2 backward from the LSE.

Nothing here ever holds an Sq x Sk matrix: the forward keeps, per query row, a running max
m, a running sum l of exp(s - m) and an unnormalized output acc, and saves only O and the
log-sum-exp; the backward recomputes each tile of P from that LSE. Memory for forward plus
backward therefore grows linearly with sequence length (properties/test_memory.py measures it).

Layout: query head h reads key/value head h // G, with G = Hq // Hkv. q is viewed as
(B*Hkv, Sq, G, D), so a query tile [q0, q1) of all G heads of one group is a single
((q1 - q0) * G, D) matrix per key/value head: one bmm against the group's key tile serves
the whole group, and in the backward the same bmm sums dK and dV over the group for free.

The Python loops run over tiles only (query tiles x key tiles); every tile operation is
a batched matmul or an elementwise op over (batch x kv heads). fp16/bf16 inputs are
computed in float32, float64 in float64; O and the gradients come back in the input dtype,
the LSE in the compute dtype (float32 for half types, as in FlashAttention).
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from flashcheck.impls import implementation
from flashcheck.impls.checks import alignment, check_blocks, check_inputs, offset

WHO = "torch-tiled"
DTYPES = ("float64", "float32", "float16", "bfloat16")
NEG_INF = float("-inf")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Accumulating fp16/bf16 in its own precision loses the small terms of l and acc.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, S, E) -> (B*Hkv, S, G, E), contiguous; a view when G == 1 and x is contiguous."""
    b, h, s, e = x.shape
    g = h // hkv
    return x.reshape(b, hkv, g, s, e).transpose(2, 3).reshape(b * hkv, s, g, e).contiguous()


def _ungrouped(x: torch.Tensor, b: int, hkv: int) -> torch.Tensor:
    """(B*Hkv, S, G, *E) -> (B, Hkv*G, S, *E)."""
    bh, s, g, *e = x.shape
    return x.reshape(b, hkv, s, g, *e).transpose(2, 3).reshape(b, hkv * g, s, *e)


def _hide(s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, off: int, g: int):
    """Set to -inf, in place, the scores of tile (rows q0:q1, keys k0:k1) whose key is in a row's future."""
    rows = torch.arange(q0, q1, device=s.device)
    cols = torch.arange(k0, k1, device=s.device)
    hidden = cols[None, :] > rows[:, None] + off  # per element, not per tile
    s.view(s.shape[0], q1 - q0, g, k1 - k0).masked_fill_(hidden[:, None, :], NEG_INF)


def _forward(qg, kg, vg, *, align, scale, block_q, block_k):
    """Online softmax over key tiles for each query tile. Returns O (B*Hkv, Sq, G, Dv) and LSE (B*Hkv, Sq, G)."""
    bh, sq, g, d = qg.shape
    sk, dv = kg.shape[1], vg.shape[2]
    off = offset(sq, sk, align)
    # Rows whose every key tile is skipped keep these: O = 0, LSE = -inf (DESIGN.md).
    o = torch.zeros(bh, sq, g, dv, dtype=qg.dtype, device=qg.device)
    lse = torch.full((bh, sq, g), NEG_INF, dtype=qg.dtype, device=qg.device)
    for q0 in range(0, sq, block_q):
        q1 = min(q0 + block_q, sq)
        # The last key any row of this tile sees is (q1 - 1) + off; key tiles past it are skipped.
        k_end = sk if align is None else min(sk, q1 + off)
        if k_end <= 0:
            continue
        qt = qg[:, q0:q1].reshape(bh, -1, d)
        m = torch.full(qt.shape[:2], NEG_INF, dtype=qg.dtype, device=qg.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(bh, qt.shape[1], dv, dtype=qg.dtype, device=qg.device)
        for k0 in range(0, k_end, block_k):
            k1 = min(k0 + block_k, sk)
            # s = scale * q k^T for this tile only.
            s = torch.bmm(qt, kg[:, k0:k1].transpose(1, 2)).mul_(scale)
            if align is not None and k1 - 1 > q0 + off:
                _hide(s, q0, q1, k0, k1, off, g)  # the tile straddles the diagonal
            # New running max; the old sums must be rescaled to it.
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen no key yet has m_new = -inf: shift it by 0 so exp gives 0, not NaN.
            shift = m_new.masked_fill(m_new == NEG_INF, 0.0)
            p = s.sub_(shift.unsqueeze(-1)).exp_()
            # exp(m_old - m_new) rescales what the earlier tiles summed.
            alpha = (m - shift).exp_()
            l.mul_(alpha).add_(p.sum(dim=-1))
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p, vg[:, k0:k1])
            m = m_new
        # Normalize once at the end; l == 0 only for a row that saw no key (O = 0 there).
        o[:, q0:q1] = (acc / l.masked_fill(l == 0, 1.0).unsqueeze(-1)).view(bh, q1 - q0, g, dv)
        # m + log l: natural-log LSE; -inf + log 0 = -inf for a row that saw no key.
        lse[:, q0:q1] = (m + l.log()).view(bh, q1 - q0, g)
    return o, lse


def _backward(qg, kg, vg, og, lse, dog, *, align, scale, block_q, block_k):
    """FlashAttention-2 backward: outer loop over key tiles (dK, dV stay local), inner over query tiles."""
    bh, sq, g, d = qg.shape
    sk, dv = kg.shape[1], vg.shape[2]
    off = offset(sq, sk, align)
    # delta_i = rowsum(dO * O) = sum_j P_ij dP_ij: the softmax Jacobian's row term, without P.
    delta = (dog * og).sum(dim=-1)
    # A row that saw no key has LSE = -inf: make it +inf so P = exp(s - inf) = 0 there, not NaN.
    lse = lse.masked_fill(lse == NEG_INF, float("inf"))
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(kg)
    dvv = torch.zeros_like(vg)
    for k0 in range(0, sk, block_k):
        k1 = min(k0 + block_k, sk)
        # The first row that sees key k0 is k0 - off: query tiles above it are skipped.
        q_start = 0 if align is None else max(0, k0 - off)
        if q_start >= sq:
            break  # no row sees these keys, nor any later ones: dK = dV = 0
        kt, vt = kg[:, k0:k1], vg[:, k0:k1]
        dk_acc = torch.zeros_like(kt)
        dv_acc = torch.zeros_like(vt)
        for q0 in range(q_start, sq, block_q):
            q1 = min(q0 + block_q, sq)
            qt = qg[:, q0:q1].reshape(bh, -1, d)
            dot = dog[:, q0:q1].reshape(bh, -1, dv)
            s = torch.bmm(qt, kt.transpose(1, 2)).mul_(scale)
            if align is not None and k1 - 1 > q0 + off:
                _hide(s, q0, q1, k0, k1, off, g)  # the same per-element mask as the forward
            # P recomputed from the saved LSE: exactly the forward's normalized probabilities.
            p = s.sub_(lse[:, q0:q1].reshape(bh, -1, 1)).exp_()
            # dV_j += P^T dO (the rows of all G heads of a group sum into their shared kv head).
            dv_acc.baddbmm_(p.transpose(1, 2), dot)
            dp = torch.bmm(dot, vt.transpose(1, 2))
            # dS = P * (dP - delta), in place over P (P is no longer needed).
            ds = p.mul_(dp.sub_(delta[:, q0:q1].reshape(bh, -1, 1)))
            # dQ_i += dS K_j and dK_j += dS^T Q_i; the scale is applied once at the end.
            dq[:, q0:q1] += torch.bmm(ds, kt).view(bh, q1 - q0, g, d)
            dk_acc.baddbmm_(ds.transpose(1, 2), qt)
        dk[:, k0:k1] = dk_acc
        dvv[:, k0:k1] = dv_acc
    return dq.mul_(scale), dk.mul_(scale), dvv


class TiledAttention(torch.autograd.Function):
    """O, LSE = attention(q, k, v); backward recomputes P tile by tile from the saved LSE."""

    @staticmethod
    def forward(ctx, q, k, v, align, scale, block_q, block_k):
        b, hkv = q.shape[0], k.shape[1]
        cdt = _compute_dtype(q.dtype)
        qg = _grouped(q.to(cdt), hkv)
        kg = k.to(cdt).reshape(b * hkv, *k.shape[2:])
        vg = v.to(cdt).reshape(b * hkv, *v.shape[2:])
        og, lse = _forward(qg, kg, vg, align=align, scale=scale, block_q=block_q, block_k=block_k)
        # The high-precision O and LSE are what the backward needs (delta and P); both are O(S).
        ctx.save_for_backward(q, k, v, og, lse)
        ctx.cfg = dict(align=align, scale=scale, block_q=block_q, block_k=block_k)
        o = _ungrouped(og, b, hkv).to(q.dtype)
        # LSE stays in the compute dtype (float32 for fp16/bf16, as FlashAttention returns it):
        # it overflows float16 long before the logits do, and needs more than 11 bits anyway.
        lse_out = _ungrouped(lse, b, hkv).clone()
        ctx.mark_non_differentiable(lse_out)
        return o, lse_out

    @staticmethod
    @once_differentiable  # the backward itself is not differentiable: double backward raises
    def backward(ctx, do, _dlse):
        q, k, v, og, lse = ctx.saved_tensors
        b, hkv = q.shape[0], k.shape[1]
        cdt = og.dtype
        qg = _grouped(q.to(cdt), hkv)
        kg = k.to(cdt).reshape(b * hkv, *k.shape[2:])
        vg = v.to(cdt).reshape(b * hkv, *v.shape[2:])
        dog = _grouped(do.to(cdt), hkv)
        dq, dk, dv = _backward(qg, kg, vg, og, lse, dog, **ctx.cfg)
        return (_ungrouped(dq, b, hkv).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype),
                None, None, None, None)


def _check_devices(q, k, v):
    for label, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{WHO}: {label} must be a torch.Tensor, got {type(x).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{WHO}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{WHO}: unsupported device {q.device}; supported: cpu, cuda")


@implementation(name=WHO, causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cpu", "cuda"),
                backward=True, gqa=True, lse=True, framework="torch", blocks="any")
def attention(q, k, v, *, causal=False, scale=None, block_q=256, block_k=256):
    """Tiled FlashAttention. Returns O in the input dtype and LSE (float32 for fp16/bf16 inputs);
    differentiable in q, k, v.

    causal: False, True (= "bottom_right"), "bottom_right" or "top_left" (DESIGN.md).
    scale: None means 1/sqrt(D); any float, 0.0 included, is used as given.
    block_q, block_k: tile sizes; any int >= 1 (large tiles are faster, memory is O(block_q * block_k)).
    """
    _check_devices(q, k, v)
    check_inputs(q, k, v, dtypes=DTYPES, who=WHO)
    check_blocks(block_q, block_k, who=WHO)
    align = alignment(causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return TiledAttention.apply(q, k, v, align, scale, block_q, block_k)
