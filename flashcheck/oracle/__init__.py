"""The oracle, in one package: the rule that says how far a result may lie from the truth
(rule.py), the dense float64 truth (reference.py), the places where correct kernels round
(rounding.py) and the bounds those roundings give (bounds.py).

``from flashcheck import oracle`` gives the rule's names (compare, truth, allowed, ...). They
load on first use: rounding.py's vocabulary (the dtypes, the results, the precisions) is read by
AttentionCase itself, which the rule reads in turn, so importing it must not start the rule.
"""


def __getattr__(name):
    import importlib

    rule = importlib.import_module("flashcheck.oracle.rule")  # not "from . import": that asks this hook again
    try:
        value = getattr(rule, name)
    except AttributeError:
        raise AttributeError(f"module 'flashcheck.oracle' has no attribute {name!r}") from None
    globals()[name] = value
    return value
