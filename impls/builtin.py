"""Imports every built-in implementation that can load here; each module registers itself.

A module whose import fails (no torch, no triton, or a bug of ours) is left out rather
than failing collection, and so is an SDPA backend whose probe call fails; each one left
out is recorded in UNAVAILABLE with the error, and the suite reports it as a skip
(tests/test_plugins.py), so nothing vanishes without a line saying why.
"""
import importlib

MODULES = (
    ("flashcheck.impls.numpy_ref", ["numpy-dense", "numpy-tiled"]),
    ("flashcheck.impls.torch_tiled", ["torch-tiled", "torch-tiled-varlen"]),
    ("flashcheck.impls.torch_cache", ["torch-tiled-kvcache"]),
    ("flashcheck.impls.triton_fused", ["triton-fused"]),
    ("flashcheck.impls.triton_varlen", ["triton-fused-varlen"]),
    ("flashcheck.impls.triton_decode", ["triton-decode"]),
    ("flashcheck.impls.sdpa", ["sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"]),
    ("flashcheck.impls.flex", ["flex"]),
    ("flashcheck.impls.flex_varlen", ["flex-varlen"]),
    ("flashcheck.impls.flex_paged", ["flex-paged"]),
    ("flashcheck.impls.jax_attn", ["jax-xla", "jax-cudnn", "jax-pallas"]),
)


def load_modules(modules=MODULES):
    """Import each module; return (names that may have registered, {name: why it is unavailable})."""
    names, unavailable = [], {}
    for module, provides in modules:
        try:
            loaded = importlib.import_module(module)
        except ImportError as exc:
            unavailable.update({n: f"importing {module} failed: {type(exc).__name__}: {exc}" for n in provides})
            continue
        names.extend(provides)
        unavailable.update(getattr(loaded, "UNAVAILABLE", {}))  # e.g. an SDPA backend whose probe failed
    return names, unavailable


NAMES, UNAVAILABLE = load_modules()
