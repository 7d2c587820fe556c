"""Which properties an implementation can run, from its declarations, and why not when it cannot.

A property names what it needs with ``@pytest.mark.requires(...)``; ``missing`` gives the
reason it is skipped for an implementation that cannot provide it. The reasons are worded
for a kernel author reading a skip line: what was declared, and what the property needs.
"""
from __future__ import annotations

from flashcheck.contract import Implementation
from flashcheck.strategies import feature_table


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
    from flashcheck.oracle import reference

    if i.fn is reference.dense_forward:
        return (f"{i.name} is the oracle's own code: comparing it with the truth is a tautology "
                "(tests/test_reference.py checks it against independent computations)")
    return None


def _cuda(i: Implementation) -> str | None:
    from flashcheck.contract.call import cuda_available

    if not cuda_available():
        return "no CUDA device here: a CUDA-only property (the gpu lane runs it)"
    if "cuda" not in i.devices:
        return f"{i.name} does not declare devices=(..., 'cuda')"
    if i.framework != "torch":
        return f"{i.name} is not a torch kernel: streams and graphs are torch's here"
    return None


CAPABILITIES = {
    "lse": lambda i: None if i.lse else f"{i.name} does not declare lse",
    "backward": lambda i: None if i.has_backward else f"{i.name} does not declare backward",
    "blocks": lambda i: None if i.blocks is not None else f"{i.name} does not declare blocks",
    "causal": lambda i: None if i.causal else f"{i.name} has no causal mode",
    "non_causal": lambda i: f"{i.name} is causal_only: it has no non-causal mode" if i.causal_only else None,
    "deterministic": lambda i: None if i.deterministic else f"{i.name} does not declare deterministic=True",
    "cuda": _cuda,
    "cuda_graphs": lambda i: None if i.cuda_graphs else f"{i.name} does not declare cuda_graphs=True",
    "compile": lambda i: None if i.compile else f"{i.name} does not declare compile=True",
    "masked_rows": _masked_rows,
    "masked": _masked,
    "independent": _independent,
    "float64": lambda i: None if "float64" in i.dtypes else f"{i.name} does not declare float64",
    "varlen": lambda i: None if i.varlen else f"{i.name} does not declare varlen=True (packed sequences)",
    "kvcache": lambda i: None if i.kvcache else f"{i.name} does not declare kvcache=True (a KV cache)",
    "kv_append": lambda i: None if i.kv_append else f"{i.name} does not declare kv_append=True (k_new, v_new)",
    "paged": lambda i: None if i.paged else f"{i.name} does not declare paged=True (a block table)",
    "splits": lambda i: None if i.splits else f"{i.name} does not declare splits=True (num_splits)",
    # tests that call the kernel directly with malformed dense tensors; a layout has its own
    "dense": lambda i: f"{i.name} takes packed sequences (varlen=True), and this property calls dense (B, H, S, D) "
    "tensors directly (properties/test_varlen.py has the packed layout's own)" if i.varlen else f"{i.name} takes a "
    "KV cache (kvcache=True), and this property calls dense (B, H, S, D) tensors directly "
    "(properties/test_kvcache.py has the cache's own)" if i.kvcache else None,
    # the feature matrix (docs/features.md)
    **{f: (lambda f: lambda i: None if getattr(i, f) else f"{i.name} does not declare {f}=True")(f)
       for f in feature_table.NAMES},
    "features": lambda i: None if any(getattr(i, f) for f in feature_table.DETERMINISTIC)
    else f"{i.name} declares none of {', '.join(feature_table.DETERMINISTIC)}",
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


def witness_case(impl: Implementation, issue):
    """The case a known issue's witness names, judged by the implementation's own precision (and, for
    a kernel with fixed ``tiles``, shown with them, as the strategies show its cases)."""
    from flashcheck.strategies.case import AttentionCase

    tiles = getattr(impl, "tiles", None)
    own = dict(precision=impl.precision, **(dict(block_q=tiles[0], block_k=tiles[1]) if tiles else {}))
    return AttentionCase(**{**own, **issue.witness})


def _witness_fields(case, impl: Implementation) -> list[str]:
    """Each way ``case`` lies outside ``impl``'s declarations, named by the declaration. These are
    the limits strategies.draw.within fits a drawn case to (tests/test_plugins.py holds the
    two to the same verdict)."""
    i, out = impl, []
    if case.dtype not in i.dtypes:
        out.append(f"dtype {case.dtype!r} is not in dtypes={i.dtypes!r}")
    if case.causal is None and i.causal_only:
        out.append("causal is None, but it declares causal_only=True")
    if case.causal is not None and case.causal not in i.causal:
        out.append(f"causal {case.causal!r} is not in causal={i.causal!r}")
    if not i.gqa and case.hkv != case.hq:
        out.append(f"hkv={case.hkv} differs from hq={case.hq}, but it declares gqa=False")
    for dim in ("d", "dv"):
        if not i.head_dim_ok(getattr(case, dim)):
            shown = sorted(i.head_dims) if isinstance(i.head_dims, frozenset) else i.head_dims
            out.append(f"{dim}={getattr(case, dim)} is outside head_dims={shown!r}")
    if i.equal_head_dims and case.d != case.dv:
        out.append(f"d={case.d} and dv={case.dv} differ, but it declares equal_head_dims=True")
    for n in ("sq", "sk"):
        length = getattr(case, n)
        if length % i.seq_multiple:
            out.append(f"{n}={length} is not a multiple of seq_multiple={i.seq_multiple}")
        if length < i.min_seq:
            out.append(f"{n}={length} is below min_seq={i.min_seq}")
        if i.max_seq is not None and length > i.max_seq:
            out.append(f"{n}={length} is above max_seq={i.max_seq}")
    if i.equal_lengths and case.sq != case.sk:
        out.append(f"sq={case.sq} and sk={case.sk} differ, but it declares equal_lengths=True")
    if not i.masked_rows and not case.visible().any(axis=-1).all():
        out.append("a query row sees no key, but it declares masked_rows=False")
    tiles = getattr(i, "tiles", None)
    if tiles and (case.block_q, case.block_k) != tuple(tiles):
        out.append(f"block_q={case.block_q}, block_k={case.block_k} are not its tiles={tuple(tiles)!r}")
    if isinstance(i.blocks, tuple):
        out += [f"{b}={getattr(case, b)} is not in blocks={i.blocks!r}" for b in ("block_q", "block_k")
                if getattr(case, b) not in i.blocks]
    if not i.scale_arg and case.scale is not None:
        out.append(f"scale={case.scale!r}, but it declares scale_arg=False (it always uses 1/sqrt(D))")
    out += [f"{f} is on, but it does not declare {f}=True" for f in case.features if not getattr(i, f)]
    if case.precision != i.precision:
        out.append(f"precision={case.precision!r}, but it declares precision={i.precision!r}")
    return out


def check_witnesses(impl: Implementation) -> None:
    """Refuse a known issue whose witness the implementation could never be asked to run: a witness
    outside the declaration would be run as written, and its failure reported as "not as declared"."""
    from flashcheck.contract import ContractError
    from flashcheck.strategies.case import AttentionCase

    known = set(AttentionCase.__dataclass_fields__)
    for issue in impl.known_issues:
        where = f"implementation {impl.name!r}: known issue {issue.text!r}"
        if not isinstance(issue.witness, dict):
            raise ContractError(f"{where}: witness must be a dict of AttentionCase fields, got {issue.witness!r}")
        unknown = sorted(set(issue.witness) - known)
        if unknown:
            raise ContractError(f"{where}: its witness names {unknown}, which are not AttentionCase fields "
                                f"({', '.join(sorted(known))})")
        try:
            case = witness_case(impl, issue)
        except (TypeError, ValueError) as exc:
            raise ContractError(f"{where}: its witness is not a valid case: {exc}") from exc
        problems = _witness_fields(case, impl)
        refused = None if problems else impl.unsupported(case)
        if refused:
            problems.append(f"its supports() refuses it: {refused}")
        if not problems:
            try:
                applies = issue.applies(case)
            except Exception as exc:  # noqa: BLE001  (a predicate that cannot judge its own witness)
                raise ContractError(f"{where}: its applies() raised on its witness {case!r}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            if not applies:
                problems.append("the issue's own applies() is False there")
        if problems:
            raise ContractError(f"{where}: its witness {case!r} lies outside what {impl.name} declares: "
                                + "; ".join(problems))
