"""FlexAttention over a paged KV cache (flashcheck/contract/cache.py): the built-in "flex-paged".

This is the way torch's own paged attention for flex works (torch.nn.attention.experimental's
PagedAttention, private and experimental, so not imported here). The cache's blocks are laid end to
end as one physical sequence of num_blocks x page_size keys, which every batch entry shares. A
mask_mod maps each physical key back to its sequence's logical position through the inverse of the
block table. The block mask keeps flex's own 128 x 128 blocks, whatever the page size: compiled flex
tiles keys by 32 to 128 and refuses a column block its tile does not divide (an H200 run, torch 2.11:
"Q and KV block size must be divisible by BLOCK_M and BLOCK_N ... KV_BLOCK_SIZE=16"). A column block
then spans several pages, or part of one, and the mask_mod decides each key.

The new keys are written into the caller's cache in place before the call, as
flash_attn_with_kvcache does. Forward only, as decoding kernels are.

What a mask cannot do is keep NaN out. A hidden key gets probability 0, and 0 x NaN = NaN in P V.
Eager flex multiplies every physical key by its P; a fused kernel does so for the positions of a
sequence's last page past its length. So the kernel declares isolates_nan=False: the suite fills
unused cache entries with large finite values instead of NaN, and they must still never reach a
result. tests/test_flex.py pins the NaN leak.
"""
from __future__ import annotations

import torch

from flashcheck.contract import implementation
from flashcheck.contract.checks import alignment, check_kvcache
from flashcheck.impls import flex
from flashcheck.impls.flex import (_CUDA, DTYPES, _check_tensors, _compute_dtype, _flex, _scores,
                                   _ungrouped_where_no_choices)

WHO = "flex-paged"


def _append(cache, new, lengths, table, page):
    """k_new / v_new (B, Hkv, Sq, E) written at positions lengths[b] onwards of each sequence, in place."""
    for b, n in enumerate(lengths):
        t = torch.arange(n, n + new.shape[2])
        blocks = torch.tensor(table[b], device=cache.device)[t // page]
        cache[blocks, :, (t % page).to(cache.device)] = new[b].transpose(0, 1)


def _logical_pages(table, seen, n_blocks, page, device):
    """(B, num_blocks): which logical page of sequence b each physical block holds, or -1. Only a
    sequence's pages below its length count, so a table's unused entries name no block."""
    out = torch.full((len(table), n_blocks), -1, dtype=torch.int32)
    for b, row in enumerate(table):
        for i, block in enumerate(row[:-(-seen[b] // page)]):
            out[b, block] = i
    return out.to(device)


def attention(q, k_cache, v_cache, *, cache_seqlens, block_table=None, k_new=None, v_new=None, causal=False,
              scale=None):
    """q (B, Hq, Sq, D) against each sequence's keys in the paged cache (and the Sq new ones, written
    into it first): O (B, Hq, Sq, Dv) in q's dtype and LSE (B, Hq, Sq) in the compute dtype. Causal is
    bottom-right against the sequence's length; a row that sees no key gives O = 0 and LSE = -inf."""
    _check_tensors(q, k_cache, v_cache, WHO)
    if block_table is None:
        raise ValueError(f"{WHO}: takes a paged cache: block_table (B, max_blocks) is required")
    lengths, table, page = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                         dtypes=DTYPES, who=WHO)
    align = alignment(causal)
    if align == "top_left":
        raise ValueError(f"{WHO}: causal is bottom-right against each sequence's length; got causal='top_left'")
    b, hq, sq, d = q.shape
    n_blocks, hkv = k_cache.shape[:2]
    if k_new is not None:
        _append(k_cache, k_new, lengths, table, page)
        _append(v_cache, v_new, lengths, table, page)
    seen = [n + (sq if k_new is not None else 0) for n in lengths]
    logical = _logical_pages(table, seen, n_blocks, page, q.device)
    length = torch.tensor(seen, dtype=torch.int32, device=q.device)
    diag = length - sq  # the bottom-right diagonal: row i sees logical keys up to i + L_b - Sq

    def mask(bi, h, i, j):
        lp = logical[bi, j // page]
        pos = lp * page + j % page
        visible = (lp >= 0) & (pos < length[bi])
        return visible & (pos <= i + diag[bi]) if align else visible

    # the blocks end to end, (1, Hkv, num_blocks * page, E), shared by every batch entry (stride 0)
    kp, vp = (x.transpose(0, 1).reshape(1, hkv, n_blocks * page, x.shape[-1]).expand(b, -1, -1, -1)
              for x in (k_cache, v_cache))
    # the block mask is always there: GQA_NO_VALID_CHOICES hits every Sq < 128 < Sq G (an H200 lane, torch
    # 2.11: hq=12, hkv=3, sq=33 raised NoValidChoicesError), so there the kv heads are repeated
    kp, vp = _ungrouped_where_no_choices(sq, hq, kp, vp)
    block_mask = flex.create_block_mask(mask, b, None, sq, n_blocks * page, device=q.device)
    scale = d ** -0.5 if scale is None else float(scale)
    return _flex(q, kp, vp, True, score_mod=_scores(scale, 0.0, q.device, _compute_dtype(q)),
                 block_mask=block_mask, scale=1.0, enable_gqa=hq != kp.shape[1])


# Its dense properties repeat flex's (each dense case is a cache of B equal sequences), so on CPU, where
# eager flex costs ~0.1 s a call, its run is opt-in like flex's; tests/test_flex_paged.py pins caches.
implementation(name=WHO, causal=("bottom_right",), dtypes=DTYPES, devices=("cuda",) if _CUDA else ("cpu",),
               gqa=True, lse=True, kvcache=True, kv_append=True, paged=True, contiguous_cache=False,
               isolates_nan=False, head_dims=(16, 128) if _CUDA else (1, 256),
               tags=() if _CUDA else ("slow",))(attention)
