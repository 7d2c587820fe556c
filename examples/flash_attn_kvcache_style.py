"""A plug-in for a flash_attn_with_kvcache-style decoding kernel: a KV cache, paged or not, with
new keys appended in place.

    pytest -m properties --impl examples/flash_attn_kvcache_style.py:attention

The kvcache contract is (B, H, S, D), as the dense one; flash_attn takes (B, S, H, D), so the
wrapper hands it transposed views. They share memory with the suite's tensors, so the keys
flash_attn writes into its cache land in the suite's cache, where the appending property looks
for them. A paged cache (num_blocks, Hkv, page_size, D) transposes to flash_attn's
(num_blocks, page_size, Hkv, D).

So that this file runs on a laptop, ``flash_attn_with_kvcache`` below is a stand-in with
flash_attn's signature: each sequence through torch SDPA's math backend. With the real package,
import it instead:

    from flash_attn import flash_attn_with_kvcache

and declare dtypes=("float16", "bfloat16"), devices=("cuda",), the page sizes it takes
(page_sizes=(256,) for FlashAttention-2's paged cache), and splits=True with num_splits= passed on.
"""
import torch
import torch.nn.functional as F

from flashcheck import implementation
from flashcheck.contract.checks import check_kvcache


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=False):
    """Stand-in: q (B, Sq, Hq, D); k_cache (B, S_max, Hkv, D) or, paged, (num_blocks, page, Hkv, D)."""
    b, sq = q.shape[:2]
    out = q.new_zeros((b, sq, q.shape[2], v_cache.shape[-1]))
    for i in range(b):
        n = int(cache_seqlens[i])
        if block_table is not None:  # position t of sequence i: block block_table[i, t // page], slot t % page
            page = k_cache.shape[1]
            rows = torch.arange(n + (sq if k is not None else 0))
            where = (block_table[i].long()[rows // page], rows % page)
        else:
            rows = torch.arange(n + (sq if k is not None else 0))
            where = (torch.full_like(rows, i), rows)
        if k is not None:  # append in place, then attend to the old keys and the new ones
            k_cache[where[0][n:], where[1][n:]] = k[i]
            v_cache[where[0][n:], where[1][n:]] = v[i]
            n += sq
        if n == 0:
            continue
        ks, vs = k_cache[where].transpose(0, 1)[None], v_cache[where].transpose(0, 1)[None]  # (1, Hkv, n, D)
        qs = q[i].transpose(0, 1)[None]
        mask = torch.ones(sq, n, dtype=torch.bool).tril(n - sq) if causal else None  # bottom-right
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        if mask is not None:  # a row that sees no key: SDPA's math gives NaN there, flash_attn 0
            o = torch.where(mask.any(-1)[None, None, :, None], o, torch.zeros_like(o))
        out[i] = o[0].transpose(0, 1)
    return out


@implementation(name="flash-attn-kvcache-style", causal="bottom_right", dtypes=("float32", "float64"),
                devices=("cpu",), gqa=True, kvcache=True, kv_append=True, paged=True)
def attention(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None, causal=False,
              scale=None):
    # flash_attn checks shapes and dtypes but trusts cache_seqlens; the suite's checks name a bad one
    check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, dtypes=("float32", "float64"),
                  who="flash-attn-kvcache-style")
    t = lambda x: None if x is None else x.transpose(1, 2)  # noqa: E731  (views: writes reach the suite's cache)
    o = flash_attn_with_kvcache(t(q), t(k_cache), t(v_cache), k=t(k_new), v=t(v_new), cache_seqlens=cache_seqlens,
                                block_table=block_table, softmax_scale=scale, causal=causal)
    return o.transpose(1, 2)
