"""FlexAttention over a packed batch (flashcheck/contract/packed.py): the built-in "flex-varlen".

The batch runs as one sequence (B = 1) under a document mask built from cu_seqlens, through
impls/flex.py's own call (its score_mod path, its compile discipline on CUDA, its sinks).
"""
from __future__ import annotations

import torch

from flashcheck.contract import implementation
from flashcheck.contract.checks import alignment, check_features, check_varlen
from flashcheck.impls import flex
from flashcheck.impls.flex import (_CUDA, DTYPES, _check_tensors, _compute_dtype, _pad, _padded_heads, _run,
                                   _scores, _ungrouped_where_no_choices)

VARLEN = "flex-varlen"


def _packed_rows(cu_q, cu_k, align, window, device):
    """A packed batch as one sequence of Tq queries against Tk keys. Per query token (Tq,): its
    sequence, the packed index of its bottom-right diagonal key (key i + Sk_b - Sq_b of its own
    sequence), the keys it may see as one band lo..hi (inclusive) of packed key indices (its
    sequence's keys, cut by the causal mask and the window), and whether its sequence has no keys.
    An empty row gets lo > hi: flex gives it O = 0 and LSE = -inf, as any row its mask empties."""
    lengths = torch.tensor([b - a for a, b in zip(cu_q, cu_q[1:])])
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    i = torch.arange(len(seq))
    first, end = torch.tensor(cu_k[:-1])[seq], torch.tensor(cu_k[1:])[seq]
    diag = i + end - torch.tensor(cu_q[1:])[seq]
    lo, hi = first, end - 1
    if align == "bottom_right":
        hi = torch.minimum(hi, diag)
    elif align == "top_left":  # key i - (the sequence's first query) of the sequence's keys
        hi = torch.minimum(hi, i - torch.tensor(cu_q[:-1])[seq] + first)
    left, right = window
    if left >= 0:
        lo = torch.maximum(lo, diag - left)
    if right >= 0:
        hi = torch.minimum(hi, diag + right)
    diag, lo, hi = (x.to(device=device, dtype=torch.int32) for x in (diag, lo, hi))
    return seq.to(device), diag, lo, hi, (first == end).to(device)


def _packed_slopes(slopes, n, hq, q):
    """alibi_slopes (Hq,) or one row per sequence (n, Hq), float32 on q's device, or None."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32:
        got = getattr(slopes, "dtype", type(slopes).__name__)
        raise TypeError(f"{VARLEN}: alibi_slopes must be a float32 tensor, got {got}")
    if tuple(slopes.shape) not in ((hq,), (n, hq)):
        raise ValueError(f"{VARLEN}: alibi_slopes must have shape ({hq},) or ({n}, {hq}) (one row per sequence), "
                         f"got {tuple(slopes.shape)}")
    if slopes.device != q.device:
        raise ValueError(f"{VARLEN}: alibi_slopes is on {slopes.device}, q on {q.device}")
    return slopes.expand(n, hq)


def varlen_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                     window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """FlexAttention over a packed batch: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> o (Tq, Hq, Dv),
    lse (Hq, Tq). The batch is one sequence (B = 1) under a document mask built from cu_seqlens; the
    causal mask, the window and ALiBi's distances are each sequence's own. A query row of a sequence
    without keys gives O = 0 and LSE = -inf (with sinks too)."""
    _check_tensors(q, k, v, VARLEN)
    cu_q, cu_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=DTYPES,
                              who=VARLEN)
    n, hq, d = len(cu_q) - 1, q.shape[1], q.shape[2]
    q1, k1, v1 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
    window = check_features(q1, who=VARLEN, window=window, softcap=softcap, sinks=sinks) or (-1, -1)
    slopes = _packed_slopes(alibi_slopes, n, hq, q)
    seq, diag, lo, hi, keyless = _packed_rows(cu_q, cu_k, alignment(causal), window, q.device)

    def band(b, h, i, j):  # captured tensors, not ints: one compiled graph per (Tq, Tk), whatever the offsets
        return (j >= lo[i]) & (j <= hi[i])

    cdt = _compute_dtype(q)
    # One score_mod for every call: the softcap and ALiBi are always in it, off as a softcap flag of
    # False and slopes of 0 (s - 0 |i - j| is s, bit for bit), so a feature combination is not a graph
    # of its own. Dynamic shapes (below) and this leave a graph per dtype and head grouping: one gpu
    # lane compiled for ~600 s with a graph per feature combination.
    per_token = (slopes.to(cdt)[seq] if slopes is not None  # (Tq, Hq): each query token's sequence's row
                 else torch.zeros(q.shape[0], hq, dtype=cdt, device=q.device))

    def alibi(b, h, i, j):
        return per_token[i, h] * (diag[i] - j).abs()

    scale = d ** -0.5 if scale is None else float(scale)
    # flex.GQA_NO_VALID_CHOICES hits every packed batch of Tq such tokens, whatever its sequences (the
    # issue's own per-case predicate cannot see Tq)
    k1, v1 = _ungrouped_where_no_choices(q.shape[0], hq, k1, v1)
    if flex.PAD:  # heads padded to a multiple of 4 where compiled, as impls/flex.py says why
        q1, k1, v1 = _padded_heads(q1, k1, v1, batch=False)
        per_token = _pad(per_token.T, q1.shape[1], per_token.shape[0], 0.0).T
        sinks = None if sinks is None else _pad(sinks[None], 1, q1.shape[1], 0.0)[0]
    # Dynamic shapes: Tq and Tk change with every batch drawn (one static graph per batch spent ~800 s
    # of compiling in one gpu lane on an H200).
    o, lse = _run(q1, k1, v1, _scores(scale, float(softcap), q.device, cdt, alibi, always_capped=True), band,
                  (None, None), sinks, dynamic=True)
    o, lse = o[:, :hq], lse[:, :hq]
    if sinks is not None:  # a sequence without keys has no softmax for its sink to join (the contract's -inf)
        lse = lse.masked_fill(keyless, float("-inf"))
    return o[0].transpose(0, 1), lse[0]


# Its dense properties repeat flex's (each dense case is B equal sequences), so on CPU, where eager
# flex costs ~0.1 s a call, its run is opt-in like flex's; tests/test_flex.py pins packed batches.
# Sinks as flex's: merged through the LSE, declared only where no backward differentiates it.
# What a document mask cannot do: keep another sequence's NaN or inf values out of a sequence. A
# hidden key gets probability 0, and 0 * NaN = NaN in P V (eager flex multiplies the whole P by V,
# a fused kernel every key block two sequences share): isolates_nan=False, so the NaN property
# poisons the other sequences with large finite values; tests/test_flex.py pins the NaN leak.
implementation(name=VARLEN, causal=("bottom_right", "top_left"), dtypes=DTYPES,
               devices=("cuda",) if _CUDA else ("cpu",), backward=_CUDA, gqa=True, lse=True, varlen=True,
               isolates_nan=False,
               window=True, softcap=True, alibi=True, sinks=not _CUDA, head_dims=(16, 128) if _CUDA else (1, 256),
               tags=() if _CUDA else ("slow",))(varlen_attention)
