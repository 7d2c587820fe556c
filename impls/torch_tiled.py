"""PyTorch tiled FlashAttention: online-softmax forward, FlashAttention-2 backward from the LSE.

Nothing here ever holds an Sq x Sk matrix: the forward keeps, per query row, a running max
m, a running sum l of exp(s - m) and an unnormalized output acc, and saves only O and the
log-sum-exp; the backward recomputes each tile of P from that LSE. Memory for forward plus
backward therefore grows linearly with sequence length (tests/test_memory.py measures it).

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

from flashcheck.contract import implementation
from flashcheck.contract.memory import MEMORY
from flashcheck.impls import counter_rng
from flashcheck.oracle.rounding import DTYPES
from flashcheck.contract.checks import alignment, check_blocks, check_features, check_inputs, check_varlen, offset

WHO = "torch-tiled"
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


class _Features:
    """Everything besides q, k, v that shapes one tile's scores: the causal mask, the window, the
    softcap, the ALiBi bias, the sinks, the attn_mask and the dropout mask (docs/features.md)."""

    def __init__(self, *, sq, sk, g, align, scale, window, softcap, slopes, sinks, dropout_p, seed, mask=None,
                 bias=None):
        self.sq, self.sk, self.g, self.align, self.scale = sq, sk, g, align, scale
        self.off = offset(sq, sk, align)
        left, right = window if window is not None else (-1, -1)
        self.left, self.right = left, right
        self.softcap, self.slopes, self.sinks = softcap, slopes, sinks  # slopes, sinks: (B*Hkv, G) or None
        self.dropout_p, self.seed = dropout_p, seed
        self.mask = mask  # (B*Hkv, Sq, G, Sk) bool, True = may attend, or None
        self.bias = bias  # (B*Hkv, Sq, G, Sk) in the compute dtype, or None

    def key_range(self, q0, q1):
        """[first, last) keys any row of q0:q1 may see: tiles outside are skipped."""
        diag = self.sk - self.sq
        start = 0 if self.left < 0 else max(0, q0 + diag - self.left)
        end = self.sk
        if self.align is not None:
            end = min(end, q1 + self.off)
        if self.right >= 0:
            end = min(end, q1 + diag + self.right)
        return start, end

    def query_range(self, k0, k1):
        """[first, last) query rows that may see a key of k0:k1."""
        diag = self.sk - self.sq
        start = 0 if self.align is None else max(0, k0 - self.off)
        if self.right >= 0:
            start = max(start, k0 - diag - self.right)
        end = self.sq if self.left < 0 else min(self.sq, k1 - diag + self.left)
        return start, end

    def scores(self, qt, kt, q0, q1, k0, k1):
        """The tile's logits (B*Hkv, (q1 - q0) * G, k1 - k0) and tanh(s / c) for the softcap's gradient."""
        s = torch.bmm(qt, kt.transpose(1, 2)).mul_(self.scale)
        t = None
        if self.softcap:
            t = s.div_(self.softcap).tanh_()
            s = t * self.softcap
        tile = s.view(s.shape[0], q1 - q0, self.g, k1 - k0)
        rows = torch.arange(q0, q1, device=s.device)[:, None]
        cols = torch.arange(k0, k1, device=s.device)[None, :]
        dist = cols - (rows + self.sk - self.sq)  # key position against the query's diagonal
        if self.slopes is not None:
            tile.sub_(self.slopes[:, None, :, None] * dist.abs()[None, :, None, :].to(s.dtype))
        if self.bias is not None:  # after the softcap and ALiBi; -inf entries hide their keys
            tile.add_(self.bias[:, q0:q1, :, k0:k1])
        hidden = torch.zeros_like(dist, dtype=torch.bool)
        if self.align is not None:
            hidden |= cols > rows + self.off  # per element, not per tile
        if self.left >= 0:
            hidden |= dist < -self.left
        if self.right >= 0:
            hidden |= dist > self.right
        tile.masked_fill_(hidden[None, :, None, :], NEG_INF)
        if self.mask is not None:
            tile.masked_fill_(~self.mask[:, q0:q1, :, k0:k1], NEG_INF)
        return s, t

    def keep_weights(self, q0, q1, k0, k1, like):
        """keep / (1 - p) for the tile, or None without dropout; the counter of score (b, h, i, j) is
        ((b * Hq + h) * Sq + i) * Sk + j, and b * Hq + h = bh * G + gi in the grouped layout."""
        if not self.dropout_p:
            return None
        bh = torch.arange(like.shape[0], device=like.device)[:, None, None, None]
        gi = torch.arange(self.g, device=like.device)[None, None, :, None]
        i = torch.arange(q0, q1, device=like.device)[None, :, None, None]
        j = torch.arange(k0, k1, device=like.device)[None, None, None, :]
        counter = ((bh * self.g + gi) * self.sq + i) * self.sk + j
        kept = counter_rng.keep(self.seed, self.dropout_p, counter)
        return (kept.to(like.dtype) / (1.0 - self.dropout_p)).view(like.shape)


def _forward(qg, kg, vg, ft: _Features, *, block_q, block_k, keys=None):
    """Online softmax over key tiles for each query tile. Returns O (B*Hkv, Sq, G, Dv) and LSE (B*Hkv, Sq, G).
    ``keys=(first, last)`` attends to those keys alone (one split of split-KV)."""
    bh, sq, g, d = qg.shape
    sk, dv = kg.shape[1], vg.shape[2]
    first, last = keys or (0, sk)
    o = torch.zeros(bh, sq, g, dv, dtype=qg.dtype, device=qg.device)
    lse = torch.full((bh, sq, g), NEG_INF, dtype=qg.dtype, device=qg.device)
    for q0 in range(0, sq, block_q):
        q1 = min(q0 + block_q, sq)
        qt = qg[:, q0:q1].reshape(bh, -1, d)
        m = torch.full(qt.shape[:2], NEG_INF, dtype=qg.dtype, device=qg.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(bh, qt.shape[1], dv, dtype=qg.dtype, device=qg.device)
        k_start, k_end = ft.key_range(q0, q1)
        for k0 in range(max(k_start, first), min(k_end, last), block_k):
            k1 = min(k0 + block_k, last)
            s, _ = ft.scores(qt, kg[:, k0:k1], q0, q1, k0, k1)
            # New running max; the old sums must be rescaled to it.
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen no key yet has m_new = -inf: shift it by 0 so exp gives 0, not NaN.
            shift = m_new.masked_fill(m_new == NEG_INF, 0.0)
            p = s.sub_(shift.unsqueeze(-1)).exp_()
            # exp(m_old - m_new) rescales what the earlier tiles summed.
            alpha = (m - shift).exp_()
            l.mul_(alpha).add_(p.sum(dim=-1))  # the softmax sums every probability, dropped or not
            w = ft.keep_weights(q0, q1, k0, k1, p)
            acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p if w is None else p * w, vg[:, k0:k1])
            m = m_new
        if ft.sinks is not None:
            # The sink joins the denominator as one more logit with no value.
            sink = ft.sinks[:, None, :].expand(bh, q1 - q0, g).reshape(bh, -1)
            m_new = torch.maximum(m, sink)
            shift = m_new.masked_fill(m_new == NEG_INF, 0.0)
            alpha = (m - shift).exp_()
            l = l * alpha + (sink - shift).exp()
            acc.mul_(alpha.unsqueeze(-1))
            m = m_new
        # Normalize once at the end; l == 0 only for a row that saw no key and no sink (O = 0 there).
        o[:, q0:q1] = (acc / l.masked_fill(l == 0, 1.0).unsqueeze(-1)).view(bh, q1 - q0, g, dv)
        # m + log l: natural-log LSE; -inf + log 0 = -inf for a row that saw nothing.
        lse[:, q0:q1] = (m + l.log()).view(bh, q1 - q0, g)
    return o, lse


def _backward(qg, kg, vg, og, lse, dog, ft: _Features, *, block_q, block_k):
    """FlashAttention-2 backward: outer loop over key tiles (dK, dV stay local), inner over query tiles."""
    bh, sq, g, d = qg.shape
    sk, dv = kg.shape[1], vg.shape[2]
    # delta_i = rowsum(dO * O) = sum_j P_ij dP_ij: the softmax Jacobian's row term, without P.
    delta = (dog * og).sum(dim=-1)
    # A row that saw nothing has LSE = -inf: make it +inf so P = exp(s - inf) = 0 there, not NaN.
    lse = lse.masked_fill(lse == NEG_INF, float("inf"))
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(kg)
    dvv = torch.zeros_like(vg)
    dbias = None if ft.bias is None else torch.zeros_like(ft.bias)
    for k0 in range(0, sk, block_k):
        k1 = min(k0 + block_k, sk)
        q_start, q_end = ft.query_range(k0, k1)
        if q_start >= q_end:
            continue  # no row sees these keys: dK = dV = 0
        kt, vt = kg[:, k0:k1], vg[:, k0:k1]
        dk_acc = torch.zeros_like(kt)
        dv_acc = torch.zeros_like(vt)
        for q0 in range(q_start, q_end, block_q):
            q1 = min(q0 + block_q, sq)
            qt = qg[:, q0:q1].reshape(bh, -1, d)
            dot = dog[:, q0:q1].reshape(bh, -1, dv)
            s, t = ft.scores(qt, kt, q0, q1, k0, k1)  # the same logits and mask as the forward
            # P recomputed from the saved LSE: exactly the forward's normalized probabilities.
            p = s.sub_(lse[:, q0:q1].reshape(bh, -1, 1)).exp_()
            w = ft.keep_weights(q0, q1, k0, k1, p)  # the forward's dropout mask, drawn again
            # dV_j += (P * keep / (1 - p))^T dO (the rows of all G heads of a group sum into their kv head).
            dv_acc.baddbmm_((p if w is None else p * w).transpose(1, 2), dot)
            dp = torch.bmm(dot, vt.transpose(1, 2))
            if w is not None:
                dp.mul_(w)
            # dS = P * (dP - delta), in place over P (P is no longer needed).
            ds = p.mul_(dp.sub_(delta[:, q0:q1].reshape(bh, -1, 1)))
            if dbias is not None:  # the bias is added after the softcap: its gradient is dS before the tanh's
                dbias[:, q0:q1, :, k0:k1] = ds.view(bh, q1 - q0, g, k1 - k0)
            if t is not None:
                ds.mul_(1 - t * t)  # through the softcap: d/dx c tanh(x / c) = 1 - tanh^2
            # dQ_i += dS K_j and dK_j += dS^T Q_i; the scale is applied once at the end.
            dq[:, q0:q1] += torch.bmm(ds, kt).view(bh, q1 - q0, g, d)
            dk_acc.baddbmm_(ds.transpose(1, 2), qt)
        dk[:, k0:k1] = dk_acc
        dvv[:, k0:k1] = dv_acc
    dsinks = None
    if ft.sinks is not None:
        # The sink's share of row i is exp(sink - LSE_i); d sum(O dO) / d sink = -share * delta.
        dsinks = -((ft.sinks[:, None, :] - lse).exp() * delta).sum(dim=1)
    return dq.mul_(ft.scale), dk.mul_(ft.scale), dvv, dsinks, dbias


def _per_group(x, b, hkv, dtype):
    """(Hq,) or (B, Hq) per-head values -> (B*Hkv, G) in the grouped layout."""
    if x is None:
        return None
    return x.to(dtype).expand(b, -1).reshape(b * hkv, -1)


class TiledAttention(torch.autograd.Function):
    """O, LSE = attention(q, k, v); backward recomputes P tile by tile from the saved LSE."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, slopes, cfg, mask=None, bias=None):
        b, hkv = q.shape[0], k.shape[1]
        cdt = _compute_dtype(q.dtype)
        qg = _grouped(q.to(cdt), hkv)
        kg = k.to(cdt).reshape(b * hkv, *k.shape[2:])
        vg = v.to(cdt).reshape(b * hkv, *v.shape[2:])
        ft = _Features(sq=q.shape[2], sk=k.shape[2], g=q.shape[1] // hkv, slopes=_per_group(slopes, b, hkv, cdt),
                       sinks=_per_group(sinks, b, hkv, cdt), **cfg["features"],
                       mask=None if mask is None else _grouped(mask.expand(b, q.shape[1], -1, -1), hkv),
                       bias=None if bias is None else _grouped(bias.to(cdt).expand(b, q.shape[1], -1, -1), hkv))
        og, lse = _forward(qg, kg, vg, ft, **cfg["blocks"])
        # The high-precision O and LSE are what the backward needs (delta and P); both are O(S).
        ctx.save_for_backward(q, k, v, og, lse)
        ctx.ft, ctx.cfg, ctx.sinks_meta = ft, cfg, None if sinks is None else (sinks.shape, sinks.dtype)
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
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
        dq, dk, dv, dsinks, dbias = _backward(qg, kg, vg, og, lse, dog, ctx.ft, **ctx.cfg["blocks"])
        if dsinks is not None:  # (B*Hkv, G) -> summed over the batch -> (Hq,)
            shape, dtype = ctx.sinks_meta
            dsinks = dsinks.view(b, -1).sum(dim=0).reshape(shape).to(dtype)
        if dbias is not None:  # (B*Hkv, Sq, G, Sk) -> (B, Hq, Sq, Sk), summed over the broadcast dims
            shape, dtype = ctx.bias_meta
            dbias = _ungrouped(dbias, b, hkv)
            dims = [i for i in (0, 1) if shape[i] == 1]
            dbias = (dbias.sum(dim=dims, keepdim=True) if dims else dbias).to(dtype)  # sum(dim=[]) sums all
        return (_ungrouped(dq, b, hkv).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype),
                dsinks, None, None, None, dbias)


def _check_devices(q, k, v):
    for label, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{WHO}: {label} must be a torch.Tensor, got {type(x).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{WHO}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{WHO}: unsupported device {q.device}; supported: cpu, cuda")


def dropout_mask(q, k, v, p, seed):
    """The keep mask (B, Hq, Sq, Sk) torch-tiled draws for dropout_p=p, dropout_seed=seed."""
    return counter_rng.keep_mask(q.shape[0], q.shape[1], q.shape[2], k.shape[2], p, seed, q.device)


@implementation(name=WHO, causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cpu", "cuda"),
                backward=True, gqa=True, lse=True, framework="torch", blocks="any",
                window=True, softcap=True, alibi=True, sinks=True, dropout=True, dropout_mask=dropout_mask,
                mask=True, bias=True, layouts=tuple(MEMORY), cuda_graphs=True)
def attention(q, k, v, *, causal=False, scale=None, block_q=256, block_k=256, window=(-1, -1), softcap=0.0,
              alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=0, attn_mask=None, attn_bias=None):
    """Tiled FlashAttention. Returns O in the input dtype and LSE (float32 for fp16/bf16 inputs);
    differentiable in q, k, v and sinks.

    causal: False, True (= "bottom_right"), "bottom_right" or "top_left" (docs/design.md).
    scale: None means 1/sqrt(D); any float, 0.0 included, is used as given.
    block_q, block_k: tile sizes; any int >= 1 (large tiles are faster, memory is O(block_q * block_k)).
    window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, attn_mask, attn_bias: docs/features.md.
    """
    _check_devices(q, k, v)
    check_inputs(q, k, v, dtypes=DTYPES, who=WHO)
    check_blocks(block_q, block_k, who=WHO)
    window = check_features(q, who=WHO, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                            dropout_p=dropout_p, attn_mask=attn_mask, sk=k.shape[2], attn_bias=attn_bias)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    cfg = {"blocks": dict(block_q=block_q, block_k=block_k),
           "features": dict(align=alignment(causal), scale=scale, window=window, softcap=float(softcap),
                            dropout_p=float(dropout_p), seed=int(dropout_seed))}
    return TiledAttention.apply(q, k, v, sinks, alibi_slopes, cfg, attn_mask, attn_bias)


# Its tiles are its own, as a packed kernel's are: tile bugs are torch-tiled's, drawn there. On CPU its
# run is opt-in (pytest -m properties --impl torch-tiled-varlen): it repeats torch-tiled's dense
# properties, and CI checks the varlen properties on mutants/varlen.py's correct build; the gpu lane
# runs it whole.
@implementation(name="torch-tiled-varlen", causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cpu", "cuda"),
                backward=True, gqa=True, lse=True, framework="torch", varlen=True,
                window=True, softcap=True, alibi=True, sinks=True,
                tags=() if torch.cuda.is_available() else ("slow",))
def varlen_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                     window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """torch-tiled over a packed batch (flashcheck/contract/packed.py), one sequence at a time:
    q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> o (Tq, Hq, Dv), lse (Hq, Tq).

    A query row of a sequence with no key gives O = 0 and LSE = -inf; alibi_slopes may be (Hq,) or
    one row per sequence (B, Hq)."""
    _check_devices(q, k, v)
    cu_q, cu_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=DTYPES,
                              who="torch-tiled-varlen")
    n, hq, dv = len(cu_q) - 1, q.shape[1], v.shape[-1]
    if alibi_slopes is not None and alibi_slopes.ndim == 2 and alibi_slopes.shape[0] != n:
        raise ValueError(f"torch-tiled-varlen: alibi_slopes must have shape ({hq},) or ({n}, {hq}), "
                         f"got {tuple(alibi_slopes.shape)}")
    os_, lses = [], []
    for b in range(n):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        rows = cu_q[b + 1] - cu_q[b]
        if rows == 0:
            continue
        if cu_k[b + 1] == cu_k[b]:  # no key: every row is empty (0 * q keeps q in the graph)
            os_.append(q.new_zeros((rows, hq, dv)) + 0 * q[qs, :, :1].sum())
            lses.append(torch.full((hq, rows), NEG_INF, dtype=_compute_dtype(q.dtype), device=q.device))
            continue
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.ndim == 2 else alibi_slopes
        o, lse = attention(*(x[s].transpose(0, 1).unsqueeze(0).contiguous() for x, s in ((q, qs), (k, ks), (v, ks))),
                           causal=causal, scale=scale, window=window,
                           softcap=softcap, alibi_slopes=slopes, sinks=sinks)
        os_.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(os_, 0), torch.cat(lses, 1)
