"""How the suite lays a torch kernel's inputs out in memory (``AttentionCase.memory``).

The values of q, k, v and dO never depend on it; only the strides and the storage around them
do. Kernels that read through raw pointers with assumed strides (flash_attn_func users pass
BSHD tensors transposed to BHSD; GQA callers expand K/V; slices of fused QKV buffers carry a
storage offset and a row stride wider than D) compute the wrong thing, or read the margins,
which hold NaN. A kernel declares the layouts it takes with ``layouts=`` (default: every one).
The gradients a kernel returns are checked by value only: their strides are its own business.
"""
from __future__ import annotations

import numpy as np

MEMORY = {
    "contiguous": "fresh contiguous (B, H, S, D) tensors",
    "bshd": "(B, S, H, D) tensors viewed as (B, H, S, D), as flash_attn_func users transpose them",
    "padded": "each row a slice of a wider row whose last 3 entries are NaN (last-dimension stride D + 3)",
    "offset": "views starting 61 elements into their storage, NaN before them (a storage offset)",
    "broadcast": "a batch or head count of 1 with stride 0, as expand() leaves it (GQA's K/V heads, one batch entry)",
}
PAD, OFFSET = 3, 61


def lay(torch, x: np.ndarray, kind: str, *, device, dtype):
    """``x`` as a ``dtype`` tensor on ``device``, laid out as MEMORY[kind] says (a leaf: requires_grad_ works)."""
    if kind not in MEMORY:
        raise ValueError(f"memory layout {kind!r}: expected one of {tuple(MEMORY)}")
    t = torch.tensor(x).to(device=device, dtype=dtype)  # a copy: nothing shares the caller's array
    if kind == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "padded":
        base = torch.full((*t.shape[:-1], t.shape[-1] + PAD), float("nan"), device=device, dtype=dtype)
        base[..., :t.shape[-1]] = t
        return base[..., :t.shape[-1]]
    if kind == "offset":
        flat = torch.full((OFFSET + t.numel(),), float("nan"), device=device, dtype=dtype)
        flat[OFFSET:] = t.reshape(-1)
        return flat[OFFSET:].view(t.shape)
    if kind == "broadcast":
        return t.as_strided(t.shape, [0 if n == 1 and i < 2 else s for i, (n, s) in enumerate(zip(t.shape, t.stride()))])
    return t


class LayoutRefused(RuntimeError):
    """A kernel raised on inputs laid out other than contiguously: the message says what to declare."""


def refused(impl, case, exc: BaseException) -> str:
    """The line for a kernel that raised on a layout other than contiguous."""
    others = tuple(k for k in impl.layouts if k != case.memory)
    return (f"{impl.name} raised {type(exc).__name__}({str(exc).strip()[:200]!r}) on inputs laid out as "
            f"memory={case.memory!r} ({MEMORY[case.memory]}); if it cannot take them, declare "
            f"layouts={others!r} in @implementation(...) and the suite lays its inputs out only those ways")
