"""Hypothesis strategies for attention problems. Import as ``from flashcheck import strategies as fs``.

The names load on first use: the contract and the oracle read the case (case.py) and the
feature table (feature_table.py), which need neither Hypothesis nor the strategies.
"""
import importlib

_FROM = {"AttentionCase": "case", "EPS": "case", "OVERFLOW_LOG": "case", "REGIMES": "case", "quantize": "case",
         "LIMITS": "draw", "cases": "draw", "fit": "draw", "limits": "draw", "FEATURES": "features"}
__all__ = sorted(_FROM)


def __getattr__(name):
    if name in _FROM:
        value = getattr(importlib.import_module(f"flashcheck.strategies.{_FROM[name]}"), name)
    else:
        try:  # a submodule: fs.draw, fs.buckets, ...
            value = importlib.import_module(f"flashcheck.strategies.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"flashcheck.strategies.{name}":
                raise
            raise AttributeError(f"module 'flashcheck.strategies' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
