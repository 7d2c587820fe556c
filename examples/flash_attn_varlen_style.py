"""A plug-in for a flash_attn_varlen_func-style kernel: packed sequences, one line of mapping.

    pytest -m properties --impl examples/flash_attn_varlen_style.py:attention

The varlen contract takes flash_attn_varlen_func's own layout and names: q (Tq, Hq, D),
k (Tk, Hkv, D), v (Tk, Hkv, Dv), int32 cu_seqlens_q / cu_seqlens_k of B + 1 offsets, and
max_seqlen_q / max_seqlen_k. scale= is softmax_scale=, window= is window_size=. It returns
o (Tq, Hq, Dv), and with lse=True also the LSE as (Hq, Tq), which is how flash_attn_varlen_func
returns its softmax_lse when asked (return_attn_probs=True gives (out, softmax_lse, S_dmask)).

So that this file runs on a laptop, ``flash_attn_varlen_func`` below is a stand-in with flash_attn's
signature: each sequence through torch SDPA's math backend. With the real package, import it instead:

    from flash_attn import flash_attn_varlen_func

and declare dtypes=("float16", "bfloat16"), devices=("cuda",), lse=True (taking softmax_lse).
"""
import torch
import torch.nn.functional as F

from flashcheck import implementation
from flashcheck.contract.checks import check_varlen


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Stand-in: each sequence alone, bottom-right causal as flash_attn aligns it."""
    outs = []
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
        if q1 == q0:
            continue
        if k1 == k0:  # a sequence without keys: its rows attend to nothing
            outs.append(q.new_zeros((q1 - q0, q.shape[1], v.shape[-1])) + 0 * q[q0:q1, :, :1])
            continue
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        sq, sk = q1 - q0, k1 - k0
        mask = None
        if causal:  # bottom-right: query i sees key j <= i + Sk - Sq
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        if mask is not None:  # a row that sees no key: SDPA's math gives NaN there, flash_attn 0
            o = torch.where(mask.any(-1)[None, None, :, None], o, torch.zeros_like(o))
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, 0)


@implementation(name="flash-attn-varlen-style", causal="bottom_right", dtypes=("float32", "float64"),
                devices=("cpu",), backward=True, gqa=True, varlen=True)
def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None):
    # flash_attn checks shapes but trusts the offsets; the suite's checks name a malformed one
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=("float32", "float64"),
                 who="flash-attn-varlen-style")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=scale, causal=causal)
