"""The plug-in contract: what an implementation declares about itself, and how it is loaded.

An implementation is a function decorated with ``@implementation(...)``. The decorator
records what the function can do (an ``Implementation``), registers it by name and hands
the function back unchanged, so a kernel module stays importable without the suite.
"""
from __future__ import annotations

import re
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from flashcheck.contract.memory import DEFAULT as DEFAULT_LAYOUTS, MEMORY
from flashcheck.oracle.rounding import DTYPES, PRECISIONS
from flashcheck.strategies import feature_table

ALIGNMENTS = ("bottom_right", "top_left")
DEVICES = ("cpu", "cuda")
FRAMEWORKS = ("torch", "numpy")

REGISTRY: dict[str, "Implementation"] = {}


class ContractError(ValueError):
    """A plug-in's declaration or location is malformed."""


@dataclass(frozen=True)
class KnownIssue:
    """A failure already found and reported upstream: the strategies steer around it, and a
    test checks that ``witness`` (AttentionCase fields) still reproduces it, so a fix is noticed."""

    text: str
    applies: Callable  # AttentionCase -> bool
    witness: dict
    failure: str  # a regex the witness's failure message must match, e.g. "got nan"


@dataclass(frozen=True, repr=False)
class Implementation:
    """What one implementation declares it can do; the strategies draw only inside it."""

    name: str
    fn: Callable
    causal: tuple[str, ...] = ("bottom_right",)  # alignments it implements; () = no causal
    dtypes: tuple[str, ...] = ("float32",)
    devices: tuple[str, ...] = ("cpu",)
    backward: bool | Callable = False  # torch: autograd; numpy: a callable (see README)
    gqa: bool = True
    lse: bool = False
    framework: str = "torch"
    blocks: tuple[int, ...] | str | None = None  # None, "any" (every int >= 1) or allowed sizes
    # fixed (block_q, block_k) tiles the kernel does not take as arguments: lengths are drawn
    # around their multiples, where partial-tile bugs live
    tiles: tuple[int, int] | None = None
    head_dims: tuple[int, int] | frozenset[int] = (1, 256)  # inclusive range (lo, hi), or the allowed sizes
    equal_head_dims: bool = False  # only Dv == D
    seq_multiple: int = 1  # Sq and Sk must be multiples of this
    max_seq: int | None = None
    equal_lengths: bool = False  # only Sq == Sk
    masked_rows: bool = True  # a query row that sees no key gives O = 0 (and LSE = -inf)
    tags: tuple[str, ...] = field(default=())  # extra pytest markers, e.g. "interpreter"
    known_issues: tuple[KnownIssue, ...] = ()
    precision: str = "fused"  # the rounding model the oracle holds it to (flashcheck/oracle/rounding.py)
    # The feature matrix (docs/features.md): each declared feature adds its keyword
    # arguments to every call (window=, softcap=, alibi_slopes=, sinks=, dropout_p= and
    # dropout_seed=); undeclared ones are never drawn for this implementation.
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False
    dropout: bool = False
    dropout_mask: Callable | None = None  # (q, k, v, p, seed) -> bool (B, Hq, Sq, Sk), True = kept
    mask: bool = False  # takes attn_mask=: bool, broadcastable from (B or 1, Hq or 1, Sq, Sk), True = may attend
    bias: bool = False  # takes attn_bias=: float, (B or 1, Hq or 1, Sq, Sk), added to the scaled scores; its
    # gradient (attn_bias.grad, the broadcast dimensions summed) is checked with backward=True
    # What real kernels needed to say about themselves (README, "The plug-in contract"):
    causal_only: bool = False  # no non-causal mode: every case is drawn causal
    min_seq: int = 1  # Sq and Sk are at least this
    supports: Callable | None = None  # case -> True, or False / a reason string when it cannot run it
    scale_arg: bool = True  # False: the function takes no scale= and always uses 1/sqrt(D)
    deterministic: bool = False  # repeated calls on one input are bitwise identical (checked)
    # Launch context (flashcheck/contract/launch.py); every CUDA kernel is called on a side stream.
    cuda_graphs: bool = False  # capturable in a CUDA graph, and its replay reads the inputs' new values
    compile: bool = False  # torch.compile(fullgraph=False) of the call gives the eager results
    layouts: tuple[str, ...] = DEFAULT_LAYOUTS  # how its torch inputs may lie (contract/memory.py); add "unaligned"
    # where it takes pointers and row strides off 16-byte alignment
    # Layouts (docs/features.md): a kernel that declares one is called only in it.
    varlen: bool = False  # packed sequences: f(q (Tq, Hq, D), k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, ...)
    # with varlen: another sequence's NaN never reaches a sequence; with kvcache: NaN in the cache past a
    # sequence's length, or in a block no sequence uses, never reaches a result. False declares a kernel
    # that gives a hidden key probability 0 and still multiplies it in (a document mask over tiles two
    # sequences share, a block mask over a partial page: 0 * NaN = NaN); those entries are then large
    # finite values instead, which must still never reach a result
    isolates_nan: bool = True
    kvcache: bool = False  # decoding against a cache: f(q, k_cache, v_cache, *, cache_seqlens, ...), forward only
    kv_append: bool = False  # with kvcache: takes k_new=, v_new=, written into the cache in place
    paged: bool = False  # with kvcache: k_cache (num_blocks, Hkv, page_size, D) and block_table=
    page_sizes: tuple[int, ...] | None = None  # with paged: the page sizes it takes (None: any)
    # with paged: False declares a kernel that takes only paged caches (block_table always given); the
    # suite then puts every cache on pages, a contiguous one as pages in order
    contiguous_cache: bool = True
    splits: bool = False  # with kvcache: takes num_splits= (split-KV); the result must not depend on it
    # takes an optional out= (None: it allocates O itself): the O tensor to write into (the shape and dtype it
    # returns), handed over as a view inside a buffer with guard bands on both sides; nothing past it may
    # change, and out is what comes back
    out: bool = False

    def __post_init__(self):
        _validate(self)

    def __repr__(self):
        return f"<implementation {self.name}>"

    def _repr_pretty_(self, printer, cycle):  # Hypothesis prints failing arguments through this
        printer.text(repr(self))

    def causal_arg(self, alignment: str | None):
        """The value passed as ``causal=``: a bool, or the alignment when it has several."""
        if alignment is None:
            return False
        return True if len(self.causal) == 1 else alignment

    @property
    def has_backward(self) -> bool:
        return bool(self.backward)

    def head_dim_ok(self, d: int) -> bool:
        if isinstance(self.head_dims, frozenset):
            return d in self.head_dims
        lo, hi = self.head_dims
        return lo <= d <= hi

    def nearest_head_dim(self, d: int) -> int:
        """The allowed head dim closest to ``d`` (the smaller on a tie)."""
        if isinstance(self.head_dims, frozenset):
            return min(self.head_dims, key=lambda a: (abs(a - d), a))
        lo, hi = self.head_dims
        return min(max(d, lo), hi)

    def unsupported(self, case) -> str | None:
        """Why ``supports`` refuses ``case``, or None when it runs it (or declares no ``supports``)."""
        if self.supports is None:
            return None
        verdict = self.supports(case)
        if isinstance(verdict, str):
            return verdict or f"{self.name}: supports() refuses this case"
        return None if verdict else f"{self.name}: supports() returned {verdict!r} for this case"


def _as_tuple(value, what: str, allowed: tuple[str, ...], name: str) -> tuple[str, ...]:
    values = (value,) if isinstance(value, str) else tuple(value)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ContractError(f"implementation {name!r}: unknown {what} {bad}; expected some of {allowed}")
    return values


def _head_dims(value, name: str):
    """(lo, hi) stays an inclusive range; a range() or a set of sizes becomes the set it holds."""
    if isinstance(value, range) and value.step == 1 and len(value):
        value = (value.start, value.stop - 1)
    elif isinstance(value, (range, set, frozenset, list)):
        value = frozenset(value)
    if isinstance(value, frozenset):
        if value and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in value):
            return value
    elif isinstance(value, tuple) and len(value) == 2 and all(isinstance(d, int) for d in value):
        if 1 <= value[0] <= value[1]:
            return value
    raise ContractError(f"implementation {name!r}: head_dims must be (lo, hi) with 1 <= lo <= hi, a range, "
                        f"or a set of sizes >= 1, got {value!r}")


def _validate(i: Implementation) -> None:
    """Check a declaration and bring it to its canonical form (tuples, sets, bools), in place:
    a bad one stops with a line naming the field, where the decorator is written."""
    name = i.name

    def put(field_name, value):
        object.__setattr__(i, field_name, value)  # the record is frozen once this returns

    if not isinstance(name, str) or not name:
        raise ContractError(f"implementation name must be a non-empty string, got {name!r}")
    put("causal", () if i.causal is None or i.causal is False
        else _as_tuple(i.causal, "causal alignment", ALIGNMENTS, name))
    put("dtypes", _as_tuple(i.dtypes, "dtype", DTYPES, name))
    put("devices", _as_tuple(i.devices, "device", DEVICES, name))
    put("layouts", _as_tuple(i.layouts, "memory layout", tuple(MEMORY), name))
    if not i.layouts:
        raise ContractError(f"implementation {name!r}: layouts must name at least one of {tuple(MEMORY)}")
    if i.framework not in FRAMEWORKS:
        raise ContractError(f"implementation {name!r}: framework must be one of {FRAMEWORKS}, got {i.framework!r}")
    if i.framework == "numpy" and i.backward is True:
        raise ContractError(f"implementation {name!r}: a numpy implementation declares backward as a "
                            "callable bwd(q, k, v, o, lse, do, *, causal, scale) -> (dq, dk, dv)")
    if i.framework == "numpy" and i.devices != ("cpu",):
        raise ContractError(f"implementation {name!r}: numpy implementations run on cpu only")
    blocks = i.blocks
    sizes_ok = isinstance(blocks, tuple) and blocks and all(isinstance(b, int) and b >= 1 for b in blocks)
    if not (sizes_ok or blocks in (None, "any")):
        raise ContractError(f"implementation {name!r}: blocks must be None, 'any' or a tuple of ints >= 1, "
                            f"got {blocks!r}")
    if i.tiles is not None:
        if not (isinstance(i.tiles, tuple) and len(i.tiles) == 2
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in i.tiles)):
            raise ContractError(f"implementation {name!r}: tiles must be (block_q, block_k), two ints >= 1, "
                                f"got {i.tiles!r}")
        if blocks is not None:
            raise ContractError(f"implementation {name!r}: declare blocks= (the kernel takes block_q=/block_k=) "
                                f"or tiles= (fixed tiles it does not take), not both")
    put("head_dims", _head_dims(i.head_dims, name))
    m, lo, hi = i.seq_multiple, i.min_seq, i.max_seq
    if not isinstance(m, int) or m < 1:
        raise ContractError(f"implementation {name!r}: seq_multiple must be an int >= 1, got {m!r}")
    if not isinstance(lo, int) or isinstance(lo, bool) or lo < 1 or lo > (hi or lo):
        raise ContractError(f"implementation {name!r}: min_seq must be an int >= 1 and <= max_seq, got {lo!r}")
    if hi is not None and hi // m * m < max(lo, m):
        raise ContractError(f"implementation {name!r}: no length is a multiple of seq_multiple={m} "
                            f"between min_seq={lo} and max_seq={hi}")
    if i.causal_only and not i.causal:
        raise ContractError(f"implementation {name!r}: causal_only=True needs a causal alignment, got causal=None")
    put("known_issues", tuple(i.known_issues))
    for issue in i.known_issues:
        if not isinstance(issue, KnownIssue):
            raise ContractError(f"implementation {name!r}: known_issues holds {issue!r}, not a KnownIssue")
        try:
            re.compile(issue.failure)
        except (re.error, TypeError) as exc:
            raise ContractError(f"implementation {name!r}: known issue {issue.text!r}: failure must be a regex "
                                f"of the failure message, got {issue.failure!r} ({exc})") from exc
    if i.supports is not None and not callable(i.supports):
        raise ContractError(f"implementation {name!r}: supports must be a callable case -> bool | str, "
                            f"got {i.supports!r}")
    if i.precision not in PRECISIONS:
        raise ContractError(f"implementation {name!r}: precision must be one of {PRECISIONS}, got {i.precision!r}")
    for feature in feature_table.NAMES:
        if not isinstance(getattr(i, feature), bool):
            raise ContractError(f"implementation {name!r}: {feature} must be True or False, "
                                f"got {getattr(i, feature)!r}")
    if i.dropout_mask is not None and not (i.dropout and callable(i.dropout_mask)):
        raise ContractError(f"implementation {name!r}: dropout_mask must be a callable (q, k, v, p, seed) -> "
                            "bool mask, declared together with dropout=True")
    put("tags", tuple(i.tags))
    if i.varlen and i.framework != "torch":
        raise ContractError(f"implementation {name!r}: varlen=True needs framework='torch' (cu_seqlens are int32 "
                            "tensors on q's device)")
    _validate_cache(i, put)
    for tensor in ("mask", "bias"):
        if getattr(i, tensor) and (i.varlen or i.kvcache):
            raise ContractError(f"implementation {name!r}: {tensor}=True is a dense-layout feature: attn_{tensor} is "
                                "(B or 1, Hq or 1, Sq, Sk); declare it on the dense kernel, not with varlen or kvcache")
    for flag in ("causal_only", "scale_arg", "deterministic", "cuda_graphs", "compile", "varlen", "kvcache",
                 "kv_append", "paged", "splits", "isolates_nan", "out", "contiguous_cache"):
        put(flag, bool(getattr(i, flag)))
    if i.out and (i.kvcache or i.framework != "torch"):
        raise ContractError(f"implementation {name!r}: out=True is checked for torch kernels of the dense and "
                            "packed layouts (not kvcache, not numpy)")
    if not i.isolates_nan and not (i.varlen or i.kvcache):
        raise ContractError(f"implementation {i.name!r}: isolates_nan=False speaks of other sequences of a packed "
                            "batch or the unused entries of a KV cache: it goes with varlen=True or kvcache=True")


def _validate_cache(i: Implementation, put) -> None:
    """The KV-cache layout's declarations (docs/features.md, "KV caches")."""
    name = i.name
    for flag in ("kv_append", "paged", "splits"):
        if getattr(i, flag) and not i.kvcache:
            raise ContractError(f"implementation {name!r}: {flag}=True goes with kvcache=True")
    if i.page_sizes is not None:
        sizes = (i.page_sizes,) if isinstance(i.page_sizes, int) else tuple(i.page_sizes)
        if not i.paged or not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                               for n in sizes):
            raise ContractError(f"implementation {name!r}: page_sizes must be ints >= 1, declared with paged=True, "
                                f"got {i.page_sizes!r}")
        put("page_sizes", tuple(sorted(set(sizes))))
    if not i.contiguous_cache and not i.paged:
        raise ContractError(f"implementation {name!r}: contiguous_cache=False declares a paged-only cache: it goes "
                            "with paged=True")
    if not i.kvcache:
        return
    if i.framework != "torch" or i.varlen:
        raise ContractError(f"implementation {name!r}: kvcache=True needs framework='torch' and no varlen "
                            "(cache_seqlens are int32 tensors on q's device)")
    if i.backward or i.dropout:
        raise ContractError(f"implementation {name!r}: a kvcache kernel is checked forward only: declare "
                            "backward=False and dropout=False (declare the same kernel's training path apart)")
    if set(i.causal) - {"bottom_right"}:
        raise ContractError(f"implementation {name!r}: a kvcache kernel's queries are the cache's last "
                            f"positions: causal must be 'bottom_right' or None, got {i.causal!r}")


DECLARABLE = tuple(f for f in Implementation.__dataclass_fields__ if f != "fn")


def _unset(*args, **kwargs):
    raise ContractError("an implementation record used before its function was decorated")


def implementation(*, register: bool = True, **declared):
    """Declare an attention function to the suite. See README, "The plug-in contract".

    The keywords are Implementation's fields, whose defaults are written there alone; the
    declaration is checked here, where the decorator is written, before the function exists."""
    unknown = sorted(set(declared) - set(DECLARABLE))
    if unknown:
        raise ContractError(f"implementation {declared.get('name')!r}: unknown declaration "
                            f"{', '.join(unknown)}; expected some of {', '.join(DECLARABLE)}")
    if "name" not in declared:
        raise ContractError("implementation needs a name: @implementation(name=..., ...)")
    record = Implementation(fn=_unset, **declared)

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise ContractError(f"implementation {record.name!r}: decorated object is not callable")
        bound = dataclasses.replace(record, fn=fn)
        from flashcheck.contract.capabilities import check_witnesses

        check_witnesses(bound)  # needs the whole record: supports() and applies() judge the witness
        fn.__flashcheck__ = bound
        if register:
            REGISTRY[bound.name] = bound
        return fn

    return decorate


from flashcheck.contract.loading import ORIGINS, builtins, load, origin_of  # noqa: E402,F401  (needs the names above)
