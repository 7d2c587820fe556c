"""Compile the backward's kernels ahead of their launches, all at once, in threads.

Triton compiles a kernel when it is first launched with a new set of compile-time values (dtype,
block sizes, flags, the 16-divisibility of the integers and pointers). The backward launches three
kernels in turn (preprocess, dK/dV, dQ), so a new shape used to compile them one after the other,
each after the forward's own compile. Most of a compile is spent in MLIR, LLVM and ptxas, which
release the GIL: compiled in threads, they overlap each other and the forward's.

Triton parses a kernel's source (``ast.parse``) on every compile. Before Python 3.13 the AST
constructor keeps its recursion depth per interpreter, not per call, so two threads inside it at once
(a garbage collection running a finalizer is enough to switch threads there) can raise
"SystemError: AST constructor recursion depth mismatch" from a correct kernel's launch: once compiles
run in threads, Triton's parse takes a lock (``serialize_parse``), and without one to lock nothing
is compiled ahead.

``ahead(key, launches, device)`` starts the compiles of a call's launches (a function giving them as
(kernel, grid, [BLOCK_M, BLOCK_N, warps, stages], args, keyword arguments)), once per key, and returns
their futures; ``wait(futures)``
blocks until they are done. A compile that fails here is left for the launch itself to meet (and
report, or lower its tiles on, as it always did): ahead of time it is only a guess at the launch.
"""
from __future__ import annotations

import concurrent.futures
import threading

import torch

THREADS = 3  # the backward's three kernels
_POOL: list = []
_SEEN: set = set()
_LOCK = threading.Lock()
PARSE_LOCK = threading.Lock()


def serialize_parse() -> bool:
    """Make Triton's JITFunction.parse take PARSE_LOCK (once per process); False where this Triton has
    no such method to wrap."""
    from triton.runtime.jit import JITFunction

    parse = getattr(JITFunction, "parse", None)
    if parse is None:
        return False
    if getattr(parse, "serialized", False):
        return True

    def locked(self):
        with PARSE_LOCK:
            return parse(self)

    locked.serialized = True
    JITFunction.parse = locked
    return True


def blocks(cfg) -> dict:
    """BLOCK_M (and BLOCK_N, where the kernel has one) of a launch configuration."""
    bm, bn = cfg[0], cfg[1]
    return dict(BLOCK_M=bm) if bn is None else dict(BLOCK_M=bm, BLOCK_N=bn)


def _compile(device, kernel, grid_fn, cfg, args, kwargs):
    bm, bn, warps, stages = cfg
    with torch.cuda.device(device):  # a thread starts on device 0; the launch compiles for its own
        kernel.warmup(*args, grid=grid_fn(bm, bn), num_warps=warps, num_stages=stages, **blocks(cfg), **kwargs)


def ahead(key, launches, device) -> list:
    """Futures of the compiles of ``launches()``, the first time ``key`` is seen in this process (else none)."""
    with _LOCK:
        if key in _SEEN:
            return []
        _SEEN.add(key)
        if not _POOL:
            if not serialize_parse():
                return []  # compiled at the launches, one at a time
            _POOL.append(concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="triton-compile"))
    return [_POOL[0].submit(_compile, device, kernel, grid_fn, list(cfg), args, kwargs)
            for kernel, grid_fn, cfg, args, kwargs in launches()]


def wait(futures) -> None:
    """Until every compile is done; their errors are the launches' to meet."""
    concurrent.futures.wait(futures)
