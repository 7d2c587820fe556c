"""The implementations under test: the built-ins (impls/builtin.py lists them) and what they share.

The plug-in contract they are written against lives in flashcheck.contract; its names are
also importable from here, as plug-ins written before the contract had its own room do.
"""
from flashcheck.contract import (  # noqa: F401
    REGISTRY,
    ContractError,
    Implementation,
    KnownIssue,
    builtins,
    implementation,
    load,
    origin_of,
)
