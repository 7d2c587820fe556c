"""A plug-in for torch's own packed-batch attention, ``torch.nn.attention.varlen.varlen_attn``
(FlashAttention-2's varlen kernel, torch >= 2.10, CUDA only):

    pytest -m properties --impl examples/torch_varlen_attn.py:attention

Its layout is the varlen contract's: q (Tq, Hq, D), k and v (Tk, Hkv, D), int32 cumulative offsets,
the longest lengths as ints, the LSE as (Hq, Tq). Its keywords changed between torch releases
(2.9: is_causal=; 2.10: scale= and window_size=; 2.12: enable_gqa=, seqused_k=, block_table=,
num_splits=), so this plug-in reads the signature of the torch it runs on and declares only what
that torch takes. Causal is FlashAttention's: bottom-right, and a window's right edge of 0.
FlashAttention-2 takes fp16 and bf16, head dims that are multiples of 8 up to 256, and Dv == D.
"""
import inspect

import torch

from flashcheck import implementation

try:
    from torch.nn.attention.varlen import AuxRequest, varlen_attn
except ImportError:  # torch < 2.9: the plug-in loads, and a call says what is missing
    AuxRequest = varlen_attn = None

TAKES = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()


def _keywords(q, k, causal, scale, window):
    kw = {}
    if "scale" in TAKES:
        kw["scale"] = scale
    left, right = window
    if causal:  # bottom-right causal is a window whose right edge is the diagonal
        right = 0 if right < 0 else min(right, 0)
    if "window_size" in TAKES:
        kw["window_size"] = (left, right)
    else:
        kw["is_causal"] = causal
    if "enable_gqa" in TAKES:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    return kw


def _fits(case):
    return case.d == case.dv or "FlashAttention-2 takes Dv == D only"


@implementation(name="torch-varlen-attn", varlen=True, causal=("bottom_right",), dtypes=("float16", "bfloat16"),
                devices=("cuda",), lse=True, backward=True,
                gqa="enable_gqa" in TAKES, window="window_size" in TAKES, scale_arg="scale" in TAKES,
                head_dims=range(8, 257, 8), supports=_fits)
def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
              window=(-1, -1)):
    if varlen_attn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.9 has it)")
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       return_aux=AuxRequest(lse=True), **_keywords(q, k, causal, scale, window))
