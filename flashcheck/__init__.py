"""flashcheck: property-based verification and differential testing for FlashAttention kernels.

A kernel module needs only this import, the same in a checkout and in an install:

    from flashcheck import implementation, KnownIssue

The installed package maps the repository's top-level folders into one namespace
(pyproject.toml): impls/ -> flashcheck.impls, strategies/ -> flashcheck.strategies,
properties/ -> flashcheck.properties, so nothing generic like ``impls`` or ``oracle``
lands in site-packages beside a kernel repository's own modules.
"""
from pathlib import Path as _Path

_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "impls" / "__init__.py").is_file() and (_CHECKOUT / "pyproject.toml").is_file():
    # A checkout used in place (pytest.ini's pythonpath = .): its top-level folders are this
    # package's subpackages, exactly as an install lays them out.
    __path__.append(str(_CHECKOUT))

__version__ = "0.2.0"
__all__ = ["AttentionCase", "ContractError", "Implementation", "KnownIssue", "implementation", "load"]
_FROM = {"AttentionCase": "flashcheck.strategies", **{n: "flashcheck.impls" for n in __all__[1:]}}


def __getattr__(name):
    # The names load on first use: the pytest plugin imports this package in every pytest run on a
    # machine where flashcheck is installed, and a run that is not about flashcheck pays for nothing.
    if name in _FROM:
        import importlib

        value = getattr(importlib.import_module(_FROM[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashcheck' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
