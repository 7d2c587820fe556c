"""A failing kernel property, told in about 10 lines.

    my-attn: test_output_matches_dense_float64 failed (o)
      case = AttentionCase(sk=2, d=2, dv=2, seed=1)  # shrunk, fitted to my-attn
      o[0, 0, 0, 1]: expected 0.148903, got -0.0861904 (error 0.235, relative error 1.58, allowed 1.94e-15)
      wrong o by query row (X wrong, . right): X
      wrong in batch 0 of 1, heads 0 of 1, 2 of 2 value dims
      replay: flashcheck replay /home/me/kernel/reproducers/test_output_matches_dense_float64-my-attn-a2510ecd
      full message: .../failure.txt

The case comes first, as code, exactly as the property saw it; then the worst entry; then
where the wrong entries are (query rows for O, LSE and dQ; keys for dK and dV; ``|`` marks
the implementation's tiles when it declares blocks or tiles); then the command that replays it.
The entries are those the oracle judged (``oracle.Mismatch`` carries them and its case): nothing
is parsed back from the message and the kernel is not called again.
The whole message and traceback go to failure.txt in the reproducer folder, with a
heatmap of the error (error.png) where matplotlib is installed.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from hypothesis.errors import UnsatisfiedAssumption

from flashcheck import devices
from flashcheck.contract import call
from flashcheck.oracle import TRUTH, Entries, Mismatch
from flashcheck.strategies import AttentionCase

MAP_WIDTH = 96  # characters of a row/key map before positions are grouped

try:
    BaseExceptionGroup
except NameError:  # Python 3.10: Hypothesis depends on the backport there
    from exceptiongroup import BaseExceptionGroup


def case_code(case: AttentionCase, impl) -> str:
    """The case as code (its repr leaves out fields at their defaults). Block sizes are always
    shown for a kernel that takes them or declares fixed tiles, even at their defaults (a tile
    bug needs them), and never for one that has neither."""
    if impl.blocks is not None or impl.tiles is not None:
        return case.code(always=("block_q", "block_k"))
    plain = AttentionCase()
    return repr(case.replace(block_q=plain.block_q, block_k=plain.block_k))


def plain_numbers(text: str) -> str:
    """``np.float64(0.25)`` as ``0.25``: messages built from NumPy scalars' reprs read as plain numbers."""
    return re.sub(r"\bnp\.(?:float|int|uint|bool)\w*\(([^()]*)\)", r"\1", text)


def _first_error(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _pin_code(pin, impl) -> str:
    """A pinned case, or a pinned packed or cached batch with its template as code."""
    if isinstance(pin, AttentionCase):
        return case_code(pin, impl)
    return repr(pin).replace(repr(pin.case), case_code(pin.case, impl), 1)


@dataclass
class Failure:
    impl: object
    test: str
    case: AttentionCase | None
    error: BaseException
    full_message: str
    pin: object = None  # the pinned @example's case (or packed batch) the case was shrunk from
    entries: Entries | None = None  # what the oracle found, entry by entry, in the comparison that failed
    params: str = ""  # the test's other parameters (e.g. which malformed input)
    layout: object = None  # the packed or cached batch the case is one sequence of (strategies/varlen.py, kvcache.py)

    @classmethod
    def of(cls, item, impl, exc: BaseException, pin=None) -> "Failure":
        from flashcheck.strategies import context

        error = _first_error(pin.error if pin is not None else exc)
        full = "".join(traceback.format_exception(exc))
        if pin is not None:
            full += f"\nshrunk from the pinned example {pin.pin!r} to {pin.case!r}:\n"
            full += "".join(traceback.format_exception(pin.error))
        full = plain_numbers(full)
        # the oracle's own verdict carries its case and entries; any other failure is about the case
        # the property drew and fitted last
        last = context.current().last_fitted
        mismatch = error if isinstance(error, Mismatch) else None
        case = mismatch.case if mismatch is not None else last[1] if last is not None and last[0] is impl else None
        params = "-".join(str(v) for k, v in getattr(getattr(item, "callspec", None), "params", {}).items()
                          if k != "impl" and isinstance(v, (str, int, float)))
        return cls(impl, item.name.split("[")[0], case, error, full, pin.pin if pin is not None else None,
                   entries=mismatch.entries if mismatch is not None else None, params=params,
                   layout=context.current().last_layout)

    def render(self, where) -> str:
        impl, err = self.impl, self.error
        which = f" ({self.entries.name})" if self.entries is not None else ""
        lines = [f"{impl.name}: {self.test} failed{which}"]
        if self.case is None and self.params:
            lines[0] += f" [{self.params}]"
        if self.case is not None:
            origin = "shrunk"
            if self.pin is not None:
                batch = not isinstance(self.pin, AttentionCase) and self.layout is not None  # a packed or cached pin
                pinned, now = _pin_code(self.pin, impl), _pin_code(self.layout if batch else self.case, impl)
                origin = ("a pinned example, already minimal" if pinned == now
                          else f"shrunk from the pinned example {pinned}")
            lines.append(f"  case = {case_code(self.case, impl)}  # {origin}, fitted to {impl.name}")
        if devices.ran_on():
            lines.append(f"  ran on {devices.ran_on()}; the reproducer replays on any device")
        if self.layout is not None:
            kind = type(self.layout).__name__  # Packed (strategies/varlen.py) or Cached (strategies/kvcache.py)
            rest = repr(self.layout).split(", lengths=", 1)[1]
            lines.append(f"  {kind.lower()} = {kind}({case_code(self.layout.case, impl)}, lengths={rest}"
                         "  # the batch it was called in: sequence b is the template at its lengths, seed + b")
        if self.entries is not None:
            lines += _describe(self.entries, self.case, impl)
        else:
            text = plain_numbers(str(err)).strip().splitlines()
            head = text[0] if text else ""
            # a property's verdict: an assertion, or pytest's own (pytest.raises' "DID NOT RAISE", whose
            # class says it lives in builtins)
            own = isinstance(err, (AssertionError, pytest_failed())) or type(err).__module__.startswith(
                ("_pytest", "pytest"))
            what = head if own else (f"flashcheck itself raised {type(err).__name__}: {head} (a bug in the suite, "
                                     f"not a verdict on {impl.name})" if suite_raised(err)
                                     else f"{impl.name} raised {type(err).__name__}: {head}")
            lines.append(f"  {what[:400]}")
            if own and len(text) > 1 and not text[1].strip().startswith("case:"):
                lines.append(f"  {text[1].strip()[:200]}")
        if where is not None:
            lines.append(f"  replay: flashcheck replay {where}")
            extra = ", error.png" if (where / "error.png").is_file() else ""
            lines.append(f"  full message and traceback: {where / 'failure.txt'}{extra}")
        return "\n".join(lines)


class Text:
    """A failure as pytest prints it: the short report, and its first line for the summary line."""

    def __init__(self, text: str):
        self.text = text
        self.reprcrash = SimpleNamespace(message=text.splitlines()[0], path="", lineno=0)

    def toterminal(self, out) -> None:
        for line in self.text.splitlines():
            out.line(line)

    def __str__(self):
        return self.text


def pytest_failed() -> type:
    import pytest

    return pytest.fail.Exception


def suite_raised(exc: BaseException) -> bool:
    """Whether the suite's own code raised ``exc`` rather than the kernel: the innermost frame of
    its traceback outside installed packages and the standard library is the suite's, and not the
    call of the kernel (flashcheck/contract/call.py, which a kernel installed as a package raises through)."""
    import sysconfig

    import flashcheck
    from flashcheck import impls, properties, strategies

    kernels = Path(impls.__file__).resolve().parent
    mine = [Path(m.__file__).resolve().parent for m in (flashcheck, properties, strategies)]
    installed = [Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "purelib", "platlib")]
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if path == Path(call.__file__).resolve() or path.is_relative_to(kernels):
            return False  # raised in, or through, the call of the kernel: the built-ins are kernels too
        if any(path.is_relative_to(d) for d in mine):
            return True
        if not any(path.is_relative_to(d) for d in installed):
            return False  # the kernel's own file (a plug-in)
    return False


def _fmt(x, digits: int = 6) -> str:
    return f"{float(x):.{digits}g}"


def _describe(e, case, impl) -> list[str]:
    ratio = np.where(e.wrong, np.where(np.isfinite(e.err), e.err / np.maximum(e.limit, 1e-300), np.inf), -1.0)
    idx = tuple(int(i) for i in np.unravel_index(np.argmax(ratio), ratio.shape))
    digits = 6 if _fmt(e.want[idx]) != _fmt(e.got[idx]) else 17  # a rounding-sized error needs every digit
    # the error relative to the entry too: a case shrunk to a tiny scale has tiny errors that are
    # nonetheless whole, not rounding
    relative = (f", relative error {e.err[idx] / abs(e.want[idx]):.3g}"
                if np.isfinite(e.err[idx]) and e.want[idx] != 0 and np.isfinite(e.want[idx]) else "")
    against = "" if e.against == TRUTH else f" ({e.against})"
    lines = [f"  {e.name}[{', '.join(map(str, idx))}]: expected {_fmt(e.want[idx], digits)}{against}, "
             f"got {_fmt(e.got[idx], digits)} "
             f"(error {e.err[idx]:.3g}{relative}, allowed {e.limit[idx]:.3g}); {int(e.wrong.sum())} of "
             f"{e.wrong.size} entries wrong"]
    if e.wrong.ndim < 3:  # the sinks' gradient: one entry per query head
        return lines + [f"  wrong for query heads {_list(np.flatnonzero(e.wrong))} of {e.wrong.size}"]
    keys = e.name in ("dk", "dv")
    per_pos = e.wrong.any(axis=tuple(a for a in range(e.wrong.ndim) if a != 2))
    block = (case.block_k if keys else case.block_q) if impl.blocks is not None or impl.tiles else None
    what = "key" if keys else "query row"
    lines.append(f"  wrong {e.name} by {what} {_legend(len(per_pos), block)}: {_map(per_pos, block)}")
    heads = np.flatnonzero(e.wrong.any(axis=tuple(a for a in range(e.wrong.ndim) if a != 1)))
    batch = np.flatnonzero(e.wrong.any(axis=tuple(a for a in range(e.wrong.ndim) if a != 0)))
    where = [f"batch {_list(batch)} of {e.wrong.shape[0]}", f"{'kv ' if keys else ''}heads {_list(heads)} of "
             f"{e.wrong.shape[1]}"]
    if e.wrong.ndim == 4:
        dims = int(e.wrong.any(axis=(0, 1, 2)).sum())
        where.append(f"{dims} of {e.wrong.shape[3]} {'value' if e.name in ('o', 'dv') else 'head'} dims")
    if case.causal is not None:
        shift = f" {'+' if case.offset >= 0 else '-'} {abs(case.offset)}" if case.offset else ""
        where.append(f"causal {case.causal} (query i sees keys j <= i{shift})")
    lines.append(f"  wrong in {', '.join(where)}")
    return lines


def _list(ix) -> str:
    ix = [int(i) for i in ix]
    return ", ".join(map(str, ix[:8])) + (", ..." if len(ix) > 8 else "")


def _legend(n: int, block: int | None) -> str:
    parts = ["X wrong, . right"]
    if block and block < n:
        parts.append(f"| every {block}")
    group = -(-n // MAP_WIDTH)
    if group > 1:
        parts.append(f"one mark per {group}")
    return f"({'; '.join(parts)})"


def _map(per_pos: np.ndarray, block: int | None) -> str:
    n = len(per_pos)
    group = -(-n // MAP_WIDTH)
    marks = ["X" if per_pos[i:i + group].any() else "." for i in range(0, n, group)]
    if block and block < n and group == 1:
        marks = ["|" + m if i and i % block == 0 else m for i, m in enumerate(marks)]
    return "".join(marks)


def heatmap(failure: Failure, path) -> bool:
    """error / allowed over the worst (batch, head) slice, as a PNG, where matplotlib is installed."""
    e = failure.entries
    if e is None or e.err.ndim != 4:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    score = np.where(e.wrong, 1.0, 0.0).sum(axis=(2, 3))
    b, h = np.unravel_index(np.argmax(score), score.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log10(np.where(np.isfinite(e.err[b, h]), e.err[b, h], 1e300) / np.maximum(e.limit[b, h], 1e-300))
    fig, ax = plt.subplots(figsize=(6, 4))
    im = ax.imshow(np.clip(ratio, -3, 6), cmap="magma", aspect="auto", interpolation="nearest")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("value dim" if e.name in ("o", "dv") else "head dim")
    ax.set_ylabel("key" if e.name in ("dk", "dv") else "query row")
    ax.set_title(f"{failure.impl.name} {e.name}: log10(error / allowed), batch {b}, head {h}\n"
                 f"{case_code(failure.case, failure.impl)}", fontsize=8)
    fig.colorbar(im, ax=ax, label="> 0: wrong")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


COMPILERS = ("torch._dynamo", "torch._inductor", "triton.compiler")  # modules whose errors are compile failures


def compile_failure(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is a compiler's: torch.compile's (dynamo,
    inductor) or Triton's, or any error whose type calls itself one (CompilationError, ...)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        kind = type(exc)
        if "Compil" in kind.__name__ or kind.__module__.startswith(COMPILERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _error_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def nondeterminism(impl, case, first: BaseException | None = None) -> str:
    """What to tell a user when one input gave different verdicts (Hypothesis's FlakyFailure):
    the case, the largest difference between repeated calls, and how the failing call failed.
    A first call that raised (rather than returned a wrong answer) is said as such: an error that
    does not recur, or a compile that failed once, is no race."""
    while isinstance(first, BaseExceptionGroup) and first.exceptions:
        first = first.exceptions[0]
    if isinstance(first, UnsatisfiedAssumption):  # the suite's own reject(), not the kernel's error
        first = None
    # a check of the suite that failed because the kernel raised (a CUDA graph capture) says the kernel's error
    cause = first.__cause__ if isinstance(first, AssertionError) else None
    raised = cause if cause is not None and not isinstance(cause, AssertionError) else first
    if raised is not None and not isinstance(raised, AssertionError):
        compiling = compile_failure(raised)
        what = "failed to compile" if compiling else f"raised {type(raised).__name__}"
        why = ("; the retry may have run other code than the first call compiled (a cache, or an eager "
               "fall-back)" if compiling else "")
        return (f"{impl.name} {what} on the first call and returned on the retry: an error that did not recur, "
                f"not different results{why}\n  the error: {_error_line(first)}\n  case: {case!r}")
    lines = call.repeat_differences(impl, case, calls=3)
    head = (f"{impl.name}: the same input gave different results on repeated calls "
            f"(a race or nondeterminism in the kernel)")
    if lines:
        head += ":\n  " + "\n  ".join(lines)
    else:
        head += "; three more calls on the case below agreed bit for bit, so it is intermittent"
    if first is not None:
        head += "\n  the call that failed: " + (str(first).strip().splitlines() or [type(first).__name__])[0]
    return head + f"\n  case: {case!r}"
