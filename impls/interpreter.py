"""Triton's interpreter (TRITON_INTERPRET=1), without its cost per device-function call.

The interpreter swaps triton.language's builtins for NumPy ones when a kernel launches, and swaps
them back when it returns. It also re-runs that swap on every call of a @triton.jit helper inside
the kernel (triton 3.9: ``InterpretedFunction.__call__`` calls ``_patch_lang``), walking
``inspect.getmembers`` of tl, tl.tensor and tl.math each time. Our kernels call helpers in every
tile, and on a 2-core CI machine that walk was 70 of the 205 s a Triton mutant's kill spent in
kernels (cProfile, mutants/triton.py:softcap_before_scale). During a launch the modules a helper
sees are the ones the launch already swapped, so the helper's swap changes nothing: ``quicken``
skips it then, and only then. Where triton's interpreter does not look as expected, it does nothing.
Measured on that machine: a 256 x 256 forward at 16 x 16 tiles 3.2 -> 2.0 s; the four slowest Triton
mutant kills 167 -> 97, 126 -> 73, 95 -> 57 and 55 -> 43 s.

The interpreter also has nothing to time for ``@triton.autotune``: benchmarking asks for a GPU
driver, so a kernel with several configurations stops at its first call ("0 active drivers").
``pick_autotuned_configs`` replaces the timing with a fixed choice per autotuning key (below).
"""
from __future__ import annotations

import threading
import zlib

_active = threading.local()  # per thread: is a launch starting, and what its swap covered


class _Nothing:
    def restore(self) -> None:
        pass


def _languages(fn, tl) -> set[int]:
    """The triton.language modules a function sees, as the interpreter's ``_patch_lang`` picks them."""
    return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}


def quicken() -> bool:
    """Install the skip (once; idempotent). True where it is installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if getattr(original, "quickened", False):
        return True
    if original is None or executor is None or not hasattr(getattr(interpreter, "_LangPatchScope", None), "restore"):
        return False  # another interpreter design: leave it as it is
    launcher = executor.__call__

    def launch(self, *args, **kwargs):
        _active.starting, _active.languages = True, None
        try:
            return launcher(self, *args, **kwargs)
        finally:
            _active.starting, _active.languages = False, None

    def patch_lang(fn):
        seen = getattr(_active, "languages", None)
        if seen is not None and _languages(fn, tl) <= seen:
            return _Nothing()  # a helper inside a launch: everything it would swap is swapped
        scope = original(fn)
        if getattr(_active, "starting", False):  # the launch's own swap, undone when it returns
            _active.starting, _active.languages = False, _languages(fn, tl)
        elif seen is not None:  # a helper seeing one more module (tl's own, seeing tl.core): the
            seen |= _languages(fn, tl)  # interpreter drops its scope, so that swap lasts the launch
        return scope

    patch_lang.quickened = True
    patch_lang.original, launch.original = original, launcher  # a test compares against them
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch
    return True


def pick_autotuned_configs() -> bool:
    """Let ``@triton.autotune`` kernels run under the interpreter (once; idempotent; True where
    installed). For each autotuning key (the key arguments and the tensors' dtypes, as Triton forms
    it) the configuration picked is, of those the kernel's own pruning keeps, the one whose hash with
    the key is smallest: the same key gets the same configuration in every process and replay, and
    a run's many shapes reach every configuration, where on a GPU the fastest would hide the others
    (a wrong tile the autotuner never picks passes there: docs/findings.md). Nothing is timed, so
    no configuration runs but the one picked."""
    try:
        from triton.runtime import autotuner
    except ImportError:
        return False
    tuner = getattr(autotuner, "Autotuner", None)
    if tuner is None or not hasattr(tuner, "_bench"):
        return False  # another autotuner design: leave it as it is
    if getattr(tuner._bench, "picked", False):
        return True

    def bench(self, *args, config, **kwargs):
        rank = zlib.crc32(repr((_tuning_key(self, kwargs), str(config))).encode())
        return [float(rank)] * 3  # Triton keeps the smallest: one "timing" per quantile it asks for

    bench.picked, bench.original = True, tuner._bench
    tuner._bench = bench
    return True


def _tuning_key(tuner, kwargs) -> tuple:
    """The key Triton's autotuner caches its choice under, from the arguments ``run`` recorded."""
    named = {**(getattr(tuner, "nargs", None) or {}), **kwargs}
    args = {k: v for k, v in named.items() if k in getattr(tuner, "arg_names", ())}
    key = [_plain(args[k]) for k in getattr(tuner, "keys", ()) if k in args]
    return tuple(key + [str(v.dtype) for v in args.values() if hasattr(v, "dtype")])


def _plain(x):
    return (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else x
