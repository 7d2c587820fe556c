"""torch-tiled against a KV cache (flashcheck/contract/cache.py): contiguous or paged, with the new
keys appended in place, and split-KV (flash-decoding) merged through the splits' LSEs.

Per sequence: append k_new / v_new at positions cache_seqlens[b] onwards (through the block
table when paged), gather the sequence's keys, cut them into ``num_splits`` contiguous ranges,
run torch-tiled's online softmax over each range alone, and merge the partial (O, LSE) pairs in
one combine step (flashcheck.merge.merge_splits), as flash-decoding does: merged two at a time,
64 splits rounded the LSE 63 times, up to 2.3x the oracle's bound. Sinks join once, as one more
state (O = 0, LSE = the sink), so that no split counts them twice. Forward only, as decoding kernels are.
"""
from __future__ import annotations

import math

import torch

from flashcheck.contract import implementation
from flashcheck.contract.checks import alignment, check_features, check_kvcache
from flashcheck.impls.torch_tiled import DTYPES, NEG_INF, _check_devices, _compute_dtype, _Features, _forward, \
    _grouped, _per_group, _ungrouped
from flashcheck.merge import merge_splits

WHO = "torch-tiled-kvcache"
TILE = 32  # key and query tiles: small, so that a split boundary falls inside a tile as often as on one


def _slots(b, n, page, table):
    """(index into the cache's first dimension, position inside it) of sequence b's first n positions."""
    t = torch.arange(n)
    if table is None:
        return torch.full((n,), b), t
    return torch.tensor(table[b])[t // page], t % page


def _append(cache, new, b, start, page, table):
    where, at = _slots(b, start + new.shape[2], page, table)
    cache[where[start:], :, at[start:]] = new[b].transpose(0, 1)


def _gather(cache, b, n, page, table):
    """(1, Hkv, n, E): sequence b's first n positions."""
    where, at = _slots(b, n, page, table)
    return cache[where, :, at].transpose(0, 1).unsqueeze(0)


def _bounds(n, splits):
    """num_splits contiguous key ranges covering 0..n (some empty when there are more splits than keys)."""
    edges = [n * i // splits for i in range(splits + 1)]
    return list(zip(edges, edges[1:]))


def _attend(q, k, v, *, scale, align, window, softcap, slopes, sinks, splits):
    """q (1, Hq, Sq, D) against k, v (1, Hkv, n, E): O (1, Hq, Sq, Dv) in the compute dtype, LSE (1, Hq, Sq)."""
    hkv, n, cdt = k.shape[1], k.shape[2], _compute_dtype(q.dtype)
    qg = _grouped(q.to(cdt), hkv)
    kg, vg = (x.to(cdt).reshape(hkv, n, -1) for x in (k, v))
    ft = _Features(sq=q.shape[2], sk=n, g=q.shape[1] // hkv, align=align, scale=scale, window=window,
                   softcap=softcap, slopes=_per_group(slopes, 1, hkv, cdt), sinks=None, dropout_p=0.0, seed=0)
    # each split alone, with its own max and sum; the combine step then rescales them all at once
    parts = [_forward(qg, kg, vg, ft, block_q=TILE, block_k=TILE, keys=keys) for keys in _bounds(n, splits)]
    os, lses = [p[0] for p in parts], [p[1] for p in parts]
    if sinks is not None:  # the sink: one more logit with no value, merged once
        lses.append(_per_group(sinks, 1, hkv, cdt)[:, None, :].expand_as(lses[0]))
        os.append(torch.zeros_like(os[0]))
    o, lse = merge_splits(torch.stack(os), torch.stack(lses))
    return _ungrouped(o, 1, hkv), _ungrouped(lse, 1, hkv)


@implementation(name=WHO, causal=("bottom_right",), dtypes=DTYPES, devices=("cpu", "cuda"), gqa=True, lse=True,
                kvcache=True, kv_append=True, paged=True, splits=True,
                window=True, softcap=True, alibi=True, sinks=True,
                tags=() if torch.cuda.is_available() else ("slow",))
def attention(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None, causal=False,
              scale=None, num_splits=1, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """q (B, Hq, Sq, D) against each sequence's first cache_seqlens[b] keys (and the Sq new ones,
    written into the cache first): O (B, Hq, Sq, Dv) in q's dtype, LSE (B, Hq, Sq) in float32
    (float64 for float64). A row that sees no key gives O = 0 and LSE = -inf."""
    _check_devices(q, k_cache, v_cache)
    lengths, table, page = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                         dtypes=DTYPES, who=WHO)
    window = check_features(q, who=WHO, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{WHO}: num_splits must be an int >= 1, got {num_splits!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    b, hq, sq = q.shape[:3]
    o = torch.zeros(b, hq, sq, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), NEG_INF, dtype=_compute_dtype(q.dtype), device=q.device)
    for i, n in enumerate(lengths):
        if k_new is not None:
            _append(k_cache, k_new, i, n, page, table)
            _append(v_cache, v_new, i, n, page, table)
            n += sq
        if n == 0:
            continue  # no key: O = 0, LSE = -inf
        slopes = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.ndim == 2 else alibi_slopes
        oi, li = _attend(q[i:i + 1], _gather(k_cache, i, n, page, table), _gather(v_cache, i, n, page, table),
                         scale=scale, align=alignment(causal), window=window, softcap=float(softcap), slopes=slopes,
                         sinks=sinks, splits=num_splits)
        o[i], lse[i] = oi[0].to(q.dtype), li[0]
    return o, lse
