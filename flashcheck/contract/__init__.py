"""The plug-in contract: what an implementation declares about itself, and how it is loaded.

An implementation is a function decorated with ``@implementation(...)``. The decorator
records what the function can do (an ``Implementation``), registers it by name and hands
the function back unchanged, so a kernel module stays importable without the suite.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from flashcheck.oracle.rounding import DTYPES, PRECISIONS

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
    # What real kernels needed to say about themselves (README, "The plug-in contract"):
    causal_only: bool = False  # no non-causal mode: every case is drawn causal
    min_seq: int = 1  # Sq and Sk are at least this
    supports: Callable | None = None  # case -> True, or False / a reason string when it cannot run it
    scale_arg: bool = True  # False: the function takes no scale= and always uses 1/sqrt(D)
    deterministic: bool = False  # repeated calls on one input are bitwise identical (checked)

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


def implementation(*, name: str, causal="bottom_right", dtypes=("float32",), devices=("cpu",),
                   backward=False, gqa=True, lse=False, framework="torch", blocks=None, tiles=None,
                   head_dims=(1, 256), equal_head_dims=False, seq_multiple=1, max_seq=None, equal_lengths=False,
                   masked_rows=True, tags=(), known_issues=(), precision="fused",
                   causal_only=False, min_seq=1, supports=None, scale_arg=True, deterministic=False,
                   # the optional features: see Implementation
                   window=False, softcap=False, alibi=False, sinks=False, dropout=False, dropout_mask=None,
                   register=True):
    """Declare an attention function to the suite. See README, "The plug-in contract"."""
    if not isinstance(name, str) or not name:
        raise ContractError(f"implementation name must be a non-empty string, got {name!r}")
    if causal is None or causal is False:
        alignments: tuple[str, ...] = ()
    else:
        alignments = _as_tuple(causal, "causal alignment", ALIGNMENTS, name)
    dtypes = _as_tuple(dtypes, "dtype", DTYPES, name)
    devices = _as_tuple(devices, "device", DEVICES, name)
    if framework not in FRAMEWORKS:
        raise ContractError(f"implementation {name!r}: framework must be one of {FRAMEWORKS}, got {framework!r}")
    if framework == "numpy" and backward is True:
        raise ContractError(f"implementation {name!r}: a numpy implementation declares backward as a "
                            "callable bwd(q, k, v, o, lse, do, *, causal, scale) -> (dq, dk, dv)")
    if framework == "numpy" and devices != ("cpu",):
        raise ContractError(f"implementation {name!r}: numpy implementations run on cpu only")
    sizes_ok = isinstance(blocks, tuple) and blocks and all(isinstance(b, int) and b >= 1 for b in blocks)
    if not (sizes_ok or blocks in (None, "any")):
        raise ContractError(f"implementation {name!r}: blocks must be None, 'any' or a tuple of ints >= 1, "
                            f"got {blocks!r}")
    if tiles is not None:
        if not (isinstance(tiles, tuple) and len(tiles) == 2
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tiles)):
            raise ContractError(f"implementation {name!r}: tiles must be (block_q, block_k), two ints >= 1, "
                                f"got {tiles!r}")
        if blocks is not None:
            raise ContractError(f"implementation {name!r}: declare blocks= (the kernel takes block_q=/block_k=) "
                                f"or tiles= (fixed tiles it does not take), not both")
    head_dims = _head_dims(head_dims, name)
    if not isinstance(seq_multiple, int) or seq_multiple < 1:
        raise ContractError(f"implementation {name!r}: seq_multiple must be an int >= 1, got {seq_multiple!r}")
    if not isinstance(min_seq, int) or isinstance(min_seq, bool) or min_seq < 1 or min_seq > (max_seq or min_seq):
        raise ContractError(f"implementation {name!r}: min_seq must be an int >= 1 and <= max_seq, got {min_seq!r}")
    if max_seq is not None and max_seq // seq_multiple * seq_multiple < max(min_seq, seq_multiple):
        raise ContractError(f"implementation {name!r}: no length is a multiple of seq_multiple={seq_multiple} "
                            f"between min_seq={min_seq} and max_seq={max_seq}")
    if causal_only and not alignments:
        raise ContractError(f"implementation {name!r}: causal_only=True needs a causal alignment, got causal=None")
    for issue in known_issues:
        if not isinstance(issue, KnownIssue):
            raise ContractError(f"implementation {name!r}: known_issues holds {issue!r}, not a KnownIssue")
        try:
            re.compile(issue.failure)
        except (re.error, TypeError) as exc:
            raise ContractError(f"implementation {name!r}: known issue {issue.text!r}: failure must be a regex "
                                f"of the failure message, got {issue.failure!r} ({exc})") from exc
    if supports is not None and not callable(supports):
        raise ContractError(f"implementation {name!r}: supports must be a callable case -> bool | str, "
                            f"got {supports!r}")

    if precision not in PRECISIONS:
        raise ContractError(f"implementation {name!r}: precision must be one of {PRECISIONS}, got {precision!r}")
    features = dict(window=window, softcap=softcap, alibi=alibi, sinks=sinks, dropout=dropout)
    for feature, flag in features.items():
        if not isinstance(flag, bool):
            raise ContractError(f"implementation {name!r}: {feature} must be True or False, got {flag!r}")
    if dropout_mask is not None and not (dropout and callable(dropout_mask)):
        raise ContractError(f"implementation {name!r}: dropout_mask must be a callable (q, k, v, p, seed) -> "
                            "bool mask, declared together with dropout=True")

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise ContractError(f"implementation {name!r}: decorated object is not callable")
        record = Implementation(name=name, fn=fn, causal=alignments, dtypes=dtypes, devices=devices,
                                backward=backward, gqa=gqa, lse=lse, framework=framework, blocks=blocks,
                                tiles=tiles, head_dims=head_dims, equal_head_dims=equal_head_dims,
                                seq_multiple=seq_multiple, max_seq=max_seq,
                                equal_lengths=equal_lengths, masked_rows=masked_rows, tags=tuple(tags),
                                known_issues=tuple(known_issues), precision=precision,
                                causal_only=bool(causal_only), min_seq=min_seq, supports=supports,
                                scale_arg=bool(scale_arg), deterministic=bool(deterministic),
                                dropout_mask=dropout_mask, **features)
        from flashcheck.contract.capabilities import check_witnesses

        check_witnesses(record)  # needs the whole record: supports() and applies() judge the witness
        fn.__flashcheck__ = record
        if register:
            REGISTRY[name] = record
        return fn

    return decorate


from flashcheck.contract.loading import ORIGINS, builtins, load, origin_of  # noqa: E402,F401  (needs the names above)
