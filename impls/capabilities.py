"""Which properties an implementation can run, from its declarations, and why not when it cannot.

A property names what it needs with ``@pytest.mark.requires(...)``; ``missing`` gives the
reason it is skipped for an implementation that cannot provide it. The reasons are worded
for a kernel author reading a skip line: what was declared, and what the property needs.
"""
from __future__ import annotations

from flashcheck.impls import Implementation


def _lengths_can_differ(i: Implementation) -> bool:
    if i.equal_lengths:
        return False
    if i.max_seq is None:
        return True
    m = i.seq_multiple
    return i.max_seq // m * m > -(-i.min_seq // m) * m


def _masked_rows(i: Implementation) -> str | None:
    if not i.masked_rows:
        return f"{i.name} declares masked_rows=False: no query row that sees no key is drawn"
    if "bottom_right" not in i.causal:
        return f"{i.name} has no bottom-right causal mode, the only one in which a query row sees no key"
    if not _lengths_can_differ(i):
        return f"{i.name} declares equal lengths: a row sees no key only when Sq > Sk"
    return None


def _masked_keys(i: Implementation) -> str | None:
    if "top_left" not in i.causal:
        return f"{i.name} has no top-left causal mode, the only one in which a key is seen by no query"
    if not _lengths_can_differ(i):
        return f"{i.name} declares equal lengths: a key is seen by no query only when Sk > Sq"
    return None


def _masked(i: Implementation) -> str | None:
    rows, keys = _masked_rows(i), _masked_keys(i)
    return f"no position is masked for {i.name}: {rows}; {keys}" if rows and keys else None


def _independent(i: Implementation) -> str | None:
    from flashcheck.impls import numpy_ref

    if i.fn is numpy_ref.dense_forward:
        return (f"{i.name} is the oracle's own code: comparing it with the truth is a tautology "
                "(properties/test_reference.py checks it against independent computations)")
    return None


CAPABILITIES = {
    "lse": lambda i: None if i.lse else f"{i.name} does not declare lse",
    "backward": lambda i: None if i.has_backward else f"{i.name} does not declare backward",
    "blocks": lambda i: None if i.blocks is not None else f"{i.name} does not declare blocks",
    "causal": lambda i: None if i.causal else f"{i.name} has no causal mode",
    "non_causal": lambda i: f"{i.name} is causal_only: it has no non-causal mode" if i.causal_only else None,
    "deterministic": lambda i: None if i.deterministic else f"{i.name} does not declare deterministic=True",
    "masked_rows": _masked_rows,
    "masked": _masked,
    "independent": _independent,
    "float64": lambda i: None if "float64" in i.dtypes else f"{i.name} does not declare float64",
    # the feature matrix (docs/features.md)
    **{f: (lambda f: lambda i: None if getattr(i, f) else f"{i.name} does not declare {f}=True")(f)
       for f in ("window", "softcap", "alibi", "sinks", "dropout")},
    "features": lambda i: None if (i.window or i.softcap or i.alibi or i.sinks)
    else f"{i.name} declares none of window, softcap, alibi, sinks",
    "dropout_mask": lambda i: None if i.dropout_mask is not None else f"{i.name} does not declare dropout_mask",
}


def missing(impl: Implementation, needs) -> list[str]:
    """The reasons ``impl`` cannot run a property that needs ``needs`` (empty when it can)."""
    unknown = [n for n in needs if n not in CAPABILITIES]
    if unknown:
        raise ValueError(f"@pytest.mark.requires: unknown capability {unknown}; known: {sorted(CAPABILITIES)}")
    return [why for why in (CAPABILITIES[n](impl) for n in needs) if why]


def declared(impl: Implementation) -> str:
    """The declarations that narrow what is drawn, for a skip line."""
    shown = []
    for name in ("causal", "causal_only", "dtypes", "head_dims", "equal_head_dims", "seq_multiple", "min_seq",
                 "max_seq", "equal_lengths", "masked_rows", "gqa", "blocks", "tiles", "scale_arg"):
        value = getattr(impl, name)
        default = Implementation.__dataclass_fields__[name].default
        if value != default:
            shown.append(f"{name}={sorted(value) if isinstance(value, frozenset) else value!r}")
    if impl.supports is not None:
        shown.append("supports=...")
    if impl.known_issues:
        shown.append(f"{len(impl.known_issues)} known issue(s)")
    return ", ".join(shown) or "the defaults"
