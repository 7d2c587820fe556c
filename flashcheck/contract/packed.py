"""Packed variable-length batches (``varlen=True``): the layout, and how the suite calls it.

A packed batch holds B sequences back to back along one token axis, as ``flash_attn_varlen_func``
takes them: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv); sequence b owns query tokens
cu_seqlens_q[b] to cu_seqlens_q[b + 1] and key tokens cu_seqlens_k[b] to cu_seqlens_k[b + 1].
Each sequence is plain attention over its own keys (docs/features.md). The kernel returns
o (Tq, Hq, Dv), or (o, lse) with lse (Hq, Tq).

A dense case is run on such a kernel as B sequences of equal length, so that every dense
property reaches it; properties/test_varlen.py draws ragged batches of its own.
"""
from __future__ import annotations

import numpy as np

from flashcheck.contract import call


def offsets(lengths) -> np.ndarray:
    """cu_seqlens: 0, then the running sum of the lengths."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)


def pack(x: np.ndarray) -> np.ndarray:
    """(B, H, S, D) -> (B * S, H, D): the batch's sequences back to back."""
    b, h, s, d = x.shape
    return np.ascontiguousarray(np.swapaxes(x, 1, 2).reshape(b * s, h, d))


def unpack(x: np.ndarray, b: int, s: int) -> np.ndarray:
    """(B * S, H, D) -> (B, H, S, D), for B sequences of one length S."""
    return np.swapaxes(x.reshape(b, s, *x.shape[1:]), 1, 2)


def layout_kw(lengths_q, lengths_k):
    """The keywords a varlen kernel takes besides q, k, v: int32 offsets on q's device, and the
    longest sequence on each side."""
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)

    def build(torch, device):
        return dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                    cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
                    max_seqlen_q=int(max(lengths_q, default=0)), max_seqlen_k=int(max(lengths_k, default=0)))

    return build


def run_packed(impl, case, q, k, v, do, lengths_q, lengths_k, *, device=None, path=None) -> call.Result:
    """Call a varlen kernel on packed float64 arrays (case gives dtype, heads, scale and features);
    the results stay packed: o (Tq, Hq, Dv), lse (Hq, Tq), dq like q, dk like k, dv like v."""
    tq, hq = q.shape[:2]
    if sum(lengths_q) != tq or sum(lengths_k) != k.shape[0]:
        raise ValueError(f"lengths sum to {sum(lengths_q)} queries and {sum(lengths_k)} keys; "
                         f"the packed tensors hold {tq} and {k.shape[0]}")
    shapes = {"o": ((tq, hq, v.shape[-1]), "(Tq, Hq, Dv)"), "lse": ((hq, tq), "(Hq, Tq)")}
    return call.run_torch(impl, case, q, k, v, do, device=device or call.device_for(impl), path=path,
                          shapes=shapes, layout_kw=layout_kw(lengths_q, lengths_k))


def run_dense(impl, case, q, k, v, do=None, *, device=None, path=None) -> call.Result:
    """A dense batch, run as B sequences of equal length, its results unpacked to the dense layout."""
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    res = run_packed(impl, case, pack(q), pack(k), pack(v), None if do is None else pack(do),
                     [sq] * b, [sk] * b, device=device, path=path)
    res.o = unpack(res.o, b, sq)
    if res.lse is not None:  # (Hq, B * Sq) -> (B, Hq, Sq)
        res.lse = np.swapaxes(res.lse.reshape(-1, b, sq), 0, 1)
    for name, s in (("dq", sq), ("dk", sk), ("dv", sk)):
        if getattr(res, name) is not None:
            setattr(res, name, unpack(getattr(res, name), b, s))
    res.inputs_after = tuple(unpack(x, b, s) for x, s in zip(res.inputs_after, (sq, sk, sk)))
    return res
