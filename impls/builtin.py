"""Imports every built-in implementation that can load here; each module registers itself.

A module whose framework is missing (no torch, no triton) is left out rather than
failing collection: the suite then runs what this machine can run.
"""
import importlib

NAMES = []
for module, names in (
    ("flashcheck.impls.numpy_ref", ["numpy-dense", "numpy-tiled"]),
    ("flashcheck.impls.torch_tiled", ["torch-tiled"]),
    ("flashcheck.impls.triton_fused", ["triton-fused"]),
    ("flashcheck.impls.sdpa", ["sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"]),
):
    try:
        importlib.import_module(module)
    except ImportError:
        continue
    NAMES.extend(names)
