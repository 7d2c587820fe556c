"""The built-in implementations, by module: each module registers its own on import.

``NAMES`` and ``UNAVAILABLE`` import every module, the first time either is read; ``load(name)``
imports only the module that provides one name, as ``--impl NAME`` needs (importing JAX and probing
every SDPA backend costs a pytest process seconds of start-up on a GPU machine).

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


def module_of(name: str):
    """The (module, names) entry of MODULES that provides ``name``, or None."""
    return next((entry for entry in MODULES if name in entry[1]), None)


def load(name: str):
    """Import the module that provides ``name``; return (whether it registered, why not or None)."""
    entry = module_of(name)
    if entry is None:
        return False, None
    names, unavailable = load_modules([entry])
    return name in names and name not in unavailable, unavailable.get(name)


def __getattr__(attr):  # NAMES and UNAVAILABLE, computed once, when first read
    if attr in ("NAMES", "UNAVAILABLE"):
        globals()["NAMES"], globals()["UNAVAILABLE"] = load_modules()
        return globals()[attr]
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
