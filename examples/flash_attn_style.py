"""A plug-in for a flash_attn_func-style kernel with the whole feature matrix: only a transpose.

    pytest -m properties --impl examples/flash_attn_style.py:attention

flash_attn_func takes (B, S, H, D) tensors; the suite passes (B, H, S, D). Everything else
maps one to one: window= is window_size=, softcap=, alibi_slopes= and dropout_p= keep their
names, scale= is softmax_scale=. flash_attn draws its dropout mask from torch's generator, so
dropout_seed seeds it (flash_attn saves that RNG state for its backward). flash_attn_func has
no sinks argument; forks that do (FlashAttention-3's and vLLM's) take them as a per-head float32
tensor, as here; drop sinks=True from the declaration if yours lacks them.

So that this file runs on a laptop, ``flash_attn_func`` below is a stand-in with flash_attn's
signature built on the suite's torch-tiled kernel; with the real package, import it instead:

    from flash_attn import flash_attn_func

and declare dtypes=("float16", "bfloat16"), devices=("cuda",).
"""
import torch

from flashcheck import implementation
from flashcheck.impls import torch_tiled


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None):
    """Stand-in with flash_attn_func's signature and layout: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D)."""
    seed = int(torch.randint(2**62, (1,)).item()) if dropout_p > 0 else 0  # from torch's RNG, as flash_attn does
    o, _ = torch_tiled.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                 scale=softmax_scale, window=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 sinks=sinks, dropout_p=dropout_p, dropout_seed=seed)
    return o.transpose(1, 2)


@implementation(name="flash-attn-style", causal="bottom_right", dtypes=("float32", "float64"), devices=("cpu",),
                backward=True, gqa=True, lse=False,
                window=True, softcap=True, alibi=True, sinks=True, dropout=True)
def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
              dropout_p=0.0, dropout_seed=0):
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, H, S, D) <-> (B, S, H, D)
    with torch.random.fork_rng(devices=[q.device] if q.is_cuda else []):  # leave the caller's RNG alone
        torch.manual_seed(dropout_seed)
        o = flash_attn_func(t(q), t(k), t(v), dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                            window_size=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    return t(o)
