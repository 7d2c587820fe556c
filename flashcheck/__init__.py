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

from flashcheck.impls import ContractError, Implementation, KnownIssue, implementation, load  # noqa: E402
from flashcheck.strategies import AttentionCase  # noqa: E402

__version__ = "0.2.0"
__all__ = ["AttentionCase", "ContractError", "Implementation", "KnownIssue", "implementation", "load"]
