"""Deliberately broken KV-cache kernels in torch: one bug per switch, each a class the bug survey
found in shipped decoding kernels (docs/mutants.md).

The kernel appends the new keys, gathers each sequence's keys through its block table, and
attends them in float32 (float64 for float64) split into ``num_splits`` ranges merged by their
LSEs. ``bug=None`` is the correct kernel; it runs through the same harness and must pass. Each
mutant is a plug-in, ``mutants/kvcache.py:<name>``.
"""
from __future__ import annotations

import math

import torch

from flashcheck.contract import implementation
from flashcheck.contract.checks import check_kvcache

BUGS = {
    "reads_past_cache_seqlens": "each sequence reads one position past its cache_seqlens",
    "causal_from_the_cache_start": "the causal diagonal aligned to the cache's first position (top-left), not its last",
    "appends_one_slot_late": "k_new / v_new written from cache_seqlens + 1, and read from there",
    "page_table_off_by_one": "the pages after the first read from the next entry of the block table",
    "partial_last_page_dropped": "a sequence's last page is read only when it is full",
    "splits_merged_without_rescale": "split results averaged by their key counts, not rescaled by their LSEs",
}
DTYPES = ("float32", "float64")


def _positions(bug, b, n, page, table):
    t = torch.arange(n)
    if table is None:
        return torch.full((n,), b), t
    blocks = t // page
    if bug == "page_table_off_by_one":
        blocks = torch.where(blocks > 0, (blocks + 1).clamp(max=len(table[b]) - 1), blocks)
    return torch.tensor(table[b])[blocks], t % page


def _kernel(bug):
    def attention(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None, causal=False,
                  scale=None, num_splits=1):
        lengths, table, page = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                             dtypes=DTYPES, who="mutant")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        b, hq, sq = q.shape[:3]
        o = torch.zeros(b, hq, sq, v_cache.shape[-1], dtype=q.dtype)
        lse = torch.full((b, hq, sq), float("-inf"), dtype=q.dtype)
        room = page * (len(table[0]) if table is not None else 1)  # positions a sequence can hold
        for i, n in enumerate(lengths):
            if k_new is not None:
                start = n + (bug == "appends_one_slot_late")
                where, at = _positions(bug, i, min(start + sq, room), page, table)
                keep = slice(start, start + sq)
                for cache, new in ((k_cache, k_new), (v_cache, v_new)):
                    cache[where[keep], :, at[keep]] = new[i, :, :len(where[keep])].transpose(0, 1)
                n = start + sq if bug == "appends_one_slot_late" else n + sq
            n_read = n + 1 if bug == "reads_past_cache_seqlens" else n
            if bug == "partial_last_page_dropped" and table is not None:
                n_read = n // page * page
            n_read = min(n_read, room)
            where, at = _positions(bug, i, n_read, page, table)
            k, v = k_cache[where, :, at].transpose(0, 1), v_cache[where, :, at].transpose(0, 1)
            if n_read == 0:
                continue
            g = hq // k.shape[0]
            k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
            s = scale * q[i] @ k.transpose(-1, -2)  # (Hq, Sq, n)
            if causal:
                row = torch.arange(sq)[:, None]
                col = torch.arange(n_read)[None, :]
                diag = 0 if bug == "causal_from_the_cache_start" else n - sq
                s = s.masked_fill(col > row + diag, float("-inf"))
            edges = [n_read * j // num_splits for j in range(num_splits + 1)]
            parts = []
            for a, e in zip(edges, edges[1:]):
                if e == a:
                    continue
                part = s[..., a:e]
                m = part.amax(-1, keepdim=True)
                m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
                p = torch.exp(part - m)
                denom = p.sum(-1, keepdim=True)
                parts.append((p @ v[:, a:e] / denom.clamp_min(torch.finfo(denom.dtype).tiny),
                              torch.log(denom) + m, e - a))
            if bug == "splits_merged_without_rescale":
                oi = sum(po * w for po, _, w in parts) / n_read
                li = torch.logsumexp(torch.cat([pl for _, pl, _ in parts], -1), -1, keepdim=True)
            else:
                li = torch.logsumexp(torch.cat([pl for _, pl, _ in parts], -1), -1, keepdim=True)
                finite = torch.isfinite(li)
                oi = sum(po * torch.where(finite, torch.exp(pl - torch.where(finite, li, 0.0)), 0.0)
                         for po, pl, _ in parts)
            o[i], lse[i] = oi, li[..., 0]
        return o, lse

    return attention


def _register(name, bug):
    return implementation(name=name, causal="bottom_right", dtypes=DTYPES, devices=("cpu",), gqa=True, lse=True,
                          kvcache=True, kv_append=True, paged=True, splits=True, register=False)(_kernel(bug))


correct = _register("kvcache-correct", None)
for _bug in BUGS:
    globals()[_bug] = _register(f"kvcache-{_bug}", _bug)
