"""What the running test told the strategies, and what they found: one object per test.

The pytest plugin opens a ``Test`` around each test (``begin`` in setup, ``end`` in teardown);
the strategies read it (the implementation drawn for, the test's pins, its time budget) and
write to it (the latest fitted case, the latest refusal, the pins not run as written), and the
plugin and the report read those afterwards. It lives in a context variable, as Hypothesis keeps
its own per-test state; outside a test there is a fresh one with nothing set.
"""
from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass, field


@dataclass
class Test:
    impl: object = None  # the implementation the test draws for: lengths go around its declared tiles
    pins: frozenset = frozenset()  # the test's @example cases
    coverage: frozenset = frozenset()  # those written to cover a (dtype, regime) pair: refitting is their job
    budget: float | None = None  # seconds of generated cases, counted from the first one (pins never spend it)
    generated_from: float | None = None  # time.monotonic() of the first generated case fitted
    failed: bool = False  # a case raised: Hypothesis now replays and shrinks it, which the budget never refuses
    first_pass: object = False  # True in the plugin's first pass (flashcheck/firstpass.py), then the pin it ran
    last_fitted: tuple | None = None  # (impl, case) of the latest fit: the case a failure report shows
    last_layout: object = None  # the packed batch (strategies/varlen.py) the latest fitted case belongs to
    last_refusal: str | None = None  # why the latest case was rejected: shown when no case fits at all
    pin_reports: list[str] = field(default_factory=list)  # pins refitted or not run, reported after the test
    no_reproducer: str | None = None  # why a failure of this test writes no reproducer (its inputs are not case.inputs())


class BudgetSpent(BaseException):
    """Raised when a property's time budget is spent: it ends the property at once, and the plugin
    passes it (every case before it passed). A BaseException, as KeyboardInterrupt is, so that
    Hypothesis stops rather than shrinks. Refusing each later draw instead had Hypothesis draw
    hundreds of cases to throw away (its limit is 458 + 100 per valid example) before it gave up:
    seconds per property, in a lane of hundreds of properties."""


_CURRENT: contextvars.ContextVar[Test] = contextvars.ContextVar("flashcheck_test")


def current() -> Test:
    try:
        return _CURRENT.get()
    except LookupError:
        test = Test()
        _CURRENT.set(test)
        return test


def begin(**fields) -> Test:
    """A fresh Test for the test about to run (the previous one's findings are gone)."""
    test = Test(**fields)
    _CURRENT.set(test)
    return test


def end() -> None:
    _CURRENT.set(Test())


def watch_failures(fn):
    """Mark the current Test ``failed`` when a case of the Hypothesis test ``fn`` raises; returns
    the undo. Once a case fails, Hypothesis replays and shrinks it: a time budget that refused
    those calls turned a real failure into Hypothesis's "flaky" verdict, reported as nondeterminism."""
    hyp = getattr(fn, "hypothesis", None)
    inner = getattr(hyp, "inner_test", None)
    if inner is None:
        return lambda: None
    from hypothesis.errors import UnsatisfiedAssumption

    @functools.wraps(inner)
    def watched(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except (UnsatisfiedAssumption, BudgetSpent):  # a refused draw, or the end of the budget: not a failure
            raise
        except BaseException:
            current().failed = True
            raise

    hyp.inner_test = watched

    def undo():
        hyp.inner_test = inner

    return undo
