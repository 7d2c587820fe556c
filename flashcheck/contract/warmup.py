"""Compiling ahead (``warm=``): a kernel is handed the calls a bucketed run will make, before they come.

In a bucketed run (strategies/buckets.py) every case takes its shape and memory layout from a set
fixed when the run starts; only values, scales, regimes, dtypes, causal modes and features vary. A
kernel that compiles per shape (Triton: per set of compile-time values) otherwise compiles between
examples, one kernel at a time, and a property's first examples spend most of their time waiting on
the compiler. A kernel that declares ``warm=`` is called, once per process and before the first
example of a bucketed case, ``warm(q, k, v, **kwargs)`` for every shape of the set in every dtype it
declares, without a mask and with each causal alignment it declares: the arguments a plain call of
that shape takes, laid out as the run lays them, zeros. Where it declares a backward, every call is
then made again with inputs that require grad. It must return at once, run nothing on the device, and compile in its own threads; a call
that comes while its compile is still queued or running should take it over rather than compile it
again (impls/triton_warm.py does both for triton-fused).

Processes that share a compile cache (xdist's workers, the bench's halves) start at different
points of the list, so that they compile different kernels first and find the others on disk.

Off unless FLASHCHECK_WARM=1. Compiling ahead pays where cores are idle; it compiles kernels no
example will ask for, and in the gpu lane (eight workers on sixteen cores, each running the oracle
in two threads) the cores are not idle: on a model of the lane's compiles with two cores per
process it made triton-fused's half of the properties 1.6x slower (docs/gpu-lane.md).
"""
from __future__ import annotations

import os
import warnings

import numpy as np

from flashcheck.contract import call, memory

ENV = "FLASHCHECK_WARM"  # 1: hand the calls over; off by default (below)
_WARMED: set = set()


def cases(impl, shapes, layout_of) -> list:
    """The plain cases of ``shapes`` (strategies/buckets.Shape) that ``impl`` runs: each in every dtype
    and causal mode it declares, fitted to its declaration, none inside a known issue; in the run's
    order (plainest shape first)."""
    from flashcheck.strategies import draw as fs_draw
    from flashcheck.strategies.case import AttentionCase

    modes = ([] if impl.causal_only else [None]) + list(impl.causal)
    found = []
    for shape in shapes:
        for dtype in impl.dtypes:
            for causal in modes:
                try:
                    c, _ = fs_draw.supported(impl, AttentionCase(**shape.fields, causal=causal, dtype=dtype,
                                                                 memory=layout_of(shape)))
                except ValueError:  # a shape the case refuses once fitted
                    continue
                if c is not None and c not in found and not any(i.applies(c) for i in impl.known_issues):
                    found.append(c)
    return found


def _start() -> int:
    """Where this process starts in the list: xdist's worker number, else its pid."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker[:2] == "gw" and worker[2:].isdigit() else os.getpid()


def once(impl, shapes, layout_of) -> int:
    """Hand ``impl.warm`` the calls of ``shapes``, the first time this process meets them; the number of
    calls handed over (0 when it declares no ``warm``, runs no dense torch call, or has them already)."""
    key = (getattr(impl, "name", None), id(impl), shapes)
    if os.environ.get(ENV) != "1" or getattr(impl, "warm", None) is None or key in _WARMED or impl.framework != "torch" or impl.varlen or impl.kvcache:
        return 0
    _WARMED.add(key)
    device = call.device_for(impl)
    todo = cases(impl, shapes, layout_of) if device is not None else []
    if not todo:
        return 0
    import torch

    first = _start() % len(todo)
    todo = todo[first:] + todo[:first]
    # every forward first, then (inputs that require grad) every backward: the properties that run
    # first call forwards alone, and a backward's compiles are more and longer
    for grad in (False, True) if impl.has_backward else (False,):
        for c in todo:
            dt = getattr(torch, c.dtype)
            q, k, v = (memory.lay(torch, np.zeros(s), c.memory, device=device, dtype=dt).requires_grad_(grad)
                       for s in ((c.batch, c.hq, c.sq, c.d), (c.batch, c.hkv, c.sk, c.d), (c.batch, c.hkv, c.sk, c.dv)))
            kw = call.kwargs_for(impl, c, tensor=lambda a: torch.from_numpy(a).to(device))
            try:
                impl.warm(q, k, v, **kw)
            except Exception as exc:  # compiling ahead only saves time: the calls themselves meet any error
                warnings.warn(f"{impl.name}: warm() raised {type(exc).__name__}: {exc} on {c}; nothing more is "
                              "compiled ahead in this process", RuntimeWarning, stacklevel=2)
                return len(todo)
    return len(todo)
