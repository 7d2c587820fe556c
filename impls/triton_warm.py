"""Compile the backward's kernels ahead of their launches, all at once, in threads.

Triton compiles a kernel when it is first launched with a new set of compile-time values (dtype,
block sizes, flags, the 16-divisibility of the integers and pointers). The backward launches two
kernels in turn (dQ, dK/dV), so a new shape used to compile them one after the other,
each after the forward's own compile. Most of a compile is spent in MLIR, LLVM and ptxas, which
release the GIL: compiled in threads, they overlap each other and the forward's.

Triton parses a kernel's source (``ast.parse``) on every compile. Before Python 3.13 the AST
constructor keeps its recursion depth per interpreter, not per call, so two threads inside it at once
(a garbage collection running a finalizer is enough to switch threads there) raise "SystemError: AST
constructor recursion depth mismatch", from a correct kernel's launch or from pytest's own parse in
the main thread. So once compiles run in threads, Triton builds each function's tree once, under a
lock, and copies it after that (``serialize_parse``), and the trees a compile will need are built in
the caller's thread before it starts (``preparse``). Without a parse to wrap, nothing is compiled ahead.

``ahead(key, launches, device)`` starts the compiles of a call's launches (a function giving them as
(kernel, grid, [BLOCK_M, BLOCK_N, warps, stages], args, keyword arguments)), once per key, and returns
their futures; ``wait(futures)`` blocks until they are done. A compile that fails here is left for
the launch itself to meet (and report, or lower its tiles on, as it always did): ahead of time it is
only a guess at the launch.
"""
from __future__ import annotations

import concurrent.futures
import copy
import sys
import threading

import torch

THREADS = 2  # the backward's two kernels
_POOL: list = []
_SEEN: set = set()
_LOCK = threading.Lock()
PARSE_LOCK = threading.Lock()


def serialize_parse() -> bool:
    """Make Triton's JITFunction.parse build each function's tree once, under PARSE_LOCK, and hand out
    copies of it after that (once per process); False where this Triton has no such method to wrap."""
    from triton.runtime.jit import JITFunction

    parse = getattr(JITFunction, "parse", None)
    if parse is None:
        return False
    if getattr(parse, "serialized", False):
        return True

    def build(self):  # this function's tree, parsed once
        src = getattr(self, "src", None)
        with PARSE_LOCK:
            built = self.__dict__.get("_flashcheck_tree")
            if built is None or built[0] != src:
                built = self.__dict__["_flashcheck_tree"] = (src, parse(self))
        return built[1]

    def once(self):
        return copy.deepcopy(build(self))  # a copy builds no AST from source: it cannot race a parse

    once.serialized, once.build = True, build
    JITFunction.parse = once
    return True


def preparse(kernels) -> None:
    """Parse, in the calling thread, ``kernels`` and every Triton function their compiles may parse (the
    functions of their modules and of triton.language): compile threads then only copy trees. A parse
    in a compile thread could still meet one of the main thread's own (pytest's, Hypothesis's), which
    no lock of ours sees."""
    from triton.runtime.jit import JITFunction

    build = getattr(JITFunction.parse, "build", None)
    for kernel in kernels:
        if build is None or not isinstance(kernel, JITFunction) or kernel.__dict__.get("_flashcheck_preparsed"):
            continue
        kernel.__dict__["_flashcheck_preparsed"] = True
        spaces = [getattr(getattr(kernel, "fn", None), "__globals__", {})]
        spaces += [vars(m) for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m]
        for fn in {id(f): f for space in spaces for f in list(space.values()) if isinstance(f, JITFunction)}.values():
            try:
                build(fn)
            except Exception:  # a function that does not parse alone is its compile's to report
                pass


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
        todo = launches()
        preparse([launch[0] for launch in todo])
    return [_POOL[0].submit(_compile, device, kernel, grid_fn, list(cfg), args, kwargs)
            for kernel, grid_fn, cfg, args, kwargs in todo]


def wait(futures) -> None:
    """Until every compile is done; their errors are the launches' to meet."""
    concurrent.futures.wait(futures)
