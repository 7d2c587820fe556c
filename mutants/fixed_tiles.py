"""Broken torch kernels whose tiles are fixed inside them, as most fused kernels' are.

A kernel that does not take ``block_q``/``block_k`` hides its tile boundaries from the
strategies unless it declares them: ``tiles=(block_q, block_k)``. Each mutant here declares
its tiles and has one bug that lives at a boundary of them (or on the inference path, which a
kernel with a backward is called on too). ``correct`` is the same kernel without a bug: it must
pass everything, at the lengths its declared tiles make the strategies draw. Each is a plug-in,
``mutants/fixed_tiles.py:<name>``, exactly as a user's kernel would be.
"""
from __future__ import annotations

import math

import torch

from flashcheck import implementation
from flashcheck.contract.checks import check_inputs

BUGS = {
    "lone_last_key_dropped": "a last key tile holding one key dropped (Sk % 48 == 1), 32x48 tiles",
    "partial_tile_nan": "NaN from -inf * 0 in the padding mask of a partial key tile, 128x96 tiles",
    "q_scaled_in_place": "the scale folded into q in place when q needs no gradient (inference path)",
}
TILES = {None: (32, 48), "lone_last_key_dropped": (32, 48), "partial_tile_nan": (128, 96),
         "q_scaled_in_place": (32, 48)}


def _key_tiles(sk: int, width: int, bug) -> range:
    count = -(-sk // width)
    if bug == "lone_last_key_dropped":
        count = sk // width + (sk % width > 1)  # "a tile of one key is not worth a launch"
    return range(0, count * width, width)


def forward(q, k, v, *, causal=False, scale=None, bug=None):
    b, hq, hkv, sq, sk, d, dv = check_inputs(q, k, v, dtypes=("float32", "float64"), who="mutant")
    scale = 1 / math.sqrt(d) if scale is None else scale
    if bug == "q_scaled_in_place" and not q.requires_grad:
        q, scale = q.mul_(scale), 1.0  # saves one multiply per score, and writes into the caller's q
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    block_q, block_k = TILES[bug]
    width = block_k if sk > block_k else sk  # a short sequence gets a tile of its own length
    rows_out, lse_out = [], []
    for q0 in range(0, sq, block_q):
        qt = q[:, :, q0:q0 + block_q]
        rows = torch.arange(q0, q0 + qt.shape[2])[:, None]
        m = torch.full(qt.shape[:3] + (1,), -math.inf, dtype=q.dtype)
        l = torch.zeros_like(m)
        acc = torch.zeros(qt.shape[:3] + (dv,), dtype=q.dtype)
        for k0 in _key_tiles(sk, width, bug):
            cols = torch.arange(k0, k0 + width)[None, :]
            kt, vt = k[:, :, k0:k0 + width], v[:, :, k0:k0 + width]
            pad = width - kt.shape[2]  # every tile is full width: the last one is padded
            kt = torch.nn.functional.pad(kt, (0, 0, 0, pad))
            vt = torch.nn.functional.pad(vt, (0, 0, 0, pad))
            s = scale * qt @ kt.transpose(-1, -2)
            outside = cols >= sk
            if bug == "partial_tile_nan" and pad:
                s = s + outside.to(s.dtype) * -math.inf  # 0 * -inf is NaN on every key that is there
            else:
                s = s.masked_fill(outside, -math.inf)
            if causal:
                s = s.masked_fill(cols > rows + sk - sq, -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            base = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = torch.exp(s - base)
            fade = torch.exp(m - base)
            l = fade * l + p.sum(-1, keepdim=True)
            acc = fade * acc + p @ vt
            m = m_new
        empty = l == 0  # a row that sees no key: O = 0, LSE = -inf (a NaN stays a NaN)
        safe = torch.where(empty, 1.0, l)
        rows_out.append(torch.where(empty, 0.0, acc / safe))
        lse_out.append(torch.where(empty, -math.inf, m + torch.log(safe))[..., 0])
    return torch.cat(rows_out, 2), torch.cat(lse_out, 2)


def make(bug: str | None):
    """The kernel with one bug switched on, declared as a plug-in with its tiles."""
    def attention(q, k, v, *, causal=False, scale=None):
        return forward(q, k, v, causal=causal, scale=scale, bug=bug)

    return implementation(name=f"mutant-{bug}" if bug else "fixed-tiles", causal="bottom_right",
                          dtypes=("float32", "float64"), backward=True, gqa=True, lse=True, tiles=TILES[bug],
                          register=False)(attention)


correct = make(None)
globals().update({bug: make(bug) for bug in BUGS})
