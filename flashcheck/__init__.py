"""flashcheck: property-based verification and differential testing for FlashAttention kernels.

A kernel module needs only this import, the same in a checkout and in an install:

    from flashcheck import implementation, KnownIssue

The repository's top-level folders impls/, strategies/ and properties/ are linked into this
package (flashcheck/impls -> ../impls, ...), so each of their files has one module name,
flashcheck.impls.<file>, in a checkout and in an install, and nothing generic like ``impls``
lands in site-packages beside a kernel repository's own modules.
"""
__version__ = "0.2.0"
__all__ = ["AttentionCase", "ContractError", "Implementation", "KnownIssue", "implementation", "load",
           "merge_attention_states"]
_FROM = {"AttentionCase": "flashcheck.strategies", "merge_attention_states": "flashcheck.merge",
         **{n: "flashcheck.contract" for n in __all__[1:6]}}


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
