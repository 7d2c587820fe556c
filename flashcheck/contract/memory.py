"""How the suite lays a torch kernel's inputs out in memory (``AttentionCase.memory``).

The values of q, k, v and dO never depend on it; only the strides and the storage around them
do. Kernels that read through raw pointers with assumed strides (flash_attn_func users pass
BSHD tensors transposed to BHSD; GQA callers expand K/V; slices of fused QKV buffers carry a
storage offset and a row stride wider than D) compute the wrong thing, or read the margins,
which hold NaN. A kernel declares the layouts it takes with ``layouts=`` (default: every one but
"unaligned", which a kernel adds where it takes any pointer alignment).
The gradients a kernel returns are checked by value only: their strides are its own business.
"""
from __future__ import annotations

import functools

import numpy as np

MEMORY = {
    "contiguous": "fresh contiguous (B, H, S, D) tensors",
    "bshd": "(B, S, H, D) tensors viewed as (B, H, S, D), as flash_attn_func users transpose them",
    "padded": "each row a slice of a wider row and each head's rows a slice of a taller block: NaN after every row "
              "and 16 NaN rows after every head's last (a row stride past D, 16-byte aligned, a head stride past S)",
    "offset": "views starting 48 bytes into their storage, NaN before them (a storage offset, 16-byte aligned)",
    "broadcast": "a batch or head count of 1 with stride 0, as expand() leaves it (GQA's K/V heads, one batch entry)",
    "unaligned": "views 61 elements into their storage with rows of D + 3 elements: pointers and row strides "
                 "off 16-byte alignment",
}
# Drawn unless a kernel narrows them. Views into real buffers (a fused QKV projection, a slice of a
# cache) keep the 16-byte alignment of the allocator, and vectorized CUDA kernels (FlashAttention,
# cuDNN, JAX's DLPack import) rely on it: a misaligned pointer is an error that kills the process's
# CUDA context. So "unaligned" is drawn only for a kernel that declares it takes any alignment.
DEFAULT = tuple(k for k in MEMORY if k != "unaligned")
ALIGN = 16  # bytes
ODD_OFFSET, ODD_PAD = 61, 3  # elements, for "unaligned"


ROWS_PAST = 16  # NaN rows after each head's last in "padded": a whole tile read past S meets NaN


def _in_storage(torch, t, offset: int, row: int, rows_past: int = 0):
    """``t`` (..., S, D) as a view ``offset`` elements into a NaN storage whose rows hold ``row`` >= D
    elements, with ``rows_past`` more rows after each S."""
    *lead, s, d = t.shape
    base = torch.full((offset + int(np.prod(lead)) * (s + rows_past) * row,), float("nan"), device=t.device,
                      dtype=t.dtype)
    view = base[offset:].view(*lead, s + rows_past, row)[..., :s, :d]
    view.copy_(t)
    return view


def lay(torch, x: np.ndarray, kind: str, *, device, dtype):
    """``x`` as a ``dtype`` tensor on ``device``, laid out as MEMORY[kind] says (a leaf: requires_grad_ works)."""
    if kind not in MEMORY:
        raise ValueError(f"memory layout {kind!r}: expected one of {tuple(MEMORY)}")
    t = torch.tensor(x).to(device=device, dtype=dtype)  # a copy: nothing shares the caller's array
    per = max(1, ALIGN // t.element_size())  # elements in 16 bytes
    if kind == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "padded":
        return _in_storage(torch, t, 0, -(-t.shape[-1] // per) * per + per, ROWS_PAST)
    if kind == "offset":
        return _in_storage(torch, t, 3 * per, t.shape[-1])
    if kind == "unaligned":
        return _in_storage(torch, t, ODD_OFFSET, t.shape[-1] + ODD_PAD)
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


def poisoned(torch):
    """A context in which torch.empty, empty_like, empty_strided and Tensor.new_empty return
    floating tensors filled with NaN. Memory a kernel allocates is uninitialized: often zeros on
    a fresh page, which happen to be the right O of a row that sees no key, so a kernel that never
    writes such rows (or a tail tile, or its LSE) passes by luck; NaN there fails it. A correct
    kernel writes every entry it returns."""
    return _poisoned_mode(torch)()


@functools.lru_cache(maxsize=1)
def _poisoned_mode(torch):
    """The mode's class, made once: torch.compile guards on the active mode's type, so a class per
    call would compile a new graph per call."""
    from torch.overrides import TorchFunctionMode

    empties = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}

    class Poisoned(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in empties and out.is_floating_point():
                with torch.no_grad():
                    out.fill_(float("nan"))
            return out

    return Poisoned


SMALL_BLOCK = 1 << 20  # the CUDA caching allocator serves requests up to 1 MiB from 2 MiB segments


def prime_cuda_cache(torch, device, nbytes: int) -> None:
    """On CUDA, what a kernel allocates itself (in C++ too, where no torch function mode sees it) comes
    from the caching allocator's free blocks: recycled memory, often zeros or an earlier call's values.
    Before a call every cached segment that is wholly free is released; the free blocks of segments
    that live tensors still hold, then fresh blocks of both pools (eight small requests, and one of 2
    ``nbytes``), are filled with 0xFF bytes, NaN in every float type, and freed back to the cache, so
    the kernel's outputs and workspaces start as NaN unless it writes them. Not while a CUDA graph is
    captured."""
    if torch.device(device).type != "cuda" or torch.cuda.is_current_stream_capturing():
        return
    torch.cuda.empty_cache()
    blocks = [torch.empty(size, dtype=torch.uint8, device=device) for size in _free_blocks(torch, device)]
    blocks += [torch.empty(SMALL_BLOCK, dtype=torch.uint8, device=device) for _ in range(8)]
    blocks.append(torch.empty(max(2 * nbytes, 2 * SMALL_BLOCK), dtype=torch.uint8, device=device))
    for b in blocks:
        b.fill_(255)
    del blocks


def _free_blocks(torch, device) -> list[int]:
    """Sizes of the free blocks in segments that live tensors hold, largest first. The allocator
    serves a request from the smallest free block that fits: asked for these sizes in this order, it
    hands back exactly these blocks (a small request in a hole left by a freed tensor, as the lane's
    processes met it after a few hundred tests, would otherwise get whatever that tensor held)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    sizes = [b["size"] for seg in torch.cuda.memory_snapshot() if seg["device"] == index
             for b in seg["blocks"] if b["state"] == "inactive"]
    return sorted(sizes, reverse=True)
