"""Fast first failures: one case of every property before any generated example.

A plug-in run (``--impl``) walks its properties one after another, each through 25-80
examples, so a bug that only one late property sees (a window off by one, a run-dependent
tile order) would show only after every earlier property had passed: minutes. Before the run
proper, each numeric property runs quietly on its hand-written ``@example`` pins (the boundary
cases, small and cheap) and the first of its coverage pins, or on one generated case when it
has no pins; the properties that fail there go first in the run proper, where they fail again
with the usual shrunk report. Then the run goes on to the others.

The input-validation properties keep their place at the end (plugin.py says why), and a
run spread over workers (pytest-xdist) is left in its order.
"""
from __future__ import annotations

import contextlib
import io
import time
import warnings

import pytest

NO_VERDICT = ()  # filled on first use: the exceptions that mean "nothing was tested", not "failed"


def _no_verdict():
    global NO_VERDICT
    if not NO_VERDICT:
        from hypothesis.errors import FailedHealthCheck, Unsatisfiable, UnsatisfiedAssumption

        NO_VERDICT = (Unsatisfiable, FailedHealthCheck, UnsatisfiedAssumption, pytest.skip.Exception)
    return NO_VERDICT


def _skipped(item) -> bool:
    if item.get_closest_marker("skip") is not None:
        return True
    try:
        from _pytest.skipping import evaluate_skip_marks  # skipif conditions, as pytest reads them

        return evaluate_skip_marks(item) is not None
    except Exception:  # noqa: BLE001  (a private helper that moved: run it, pytest will skip it later)
        return False


def candidates(items, impl_of) -> list:
    """The items a first pass runs: a kernel property, not skipped, that takes nothing but ``impl``."""
    return [it for it in items if impl_of(it) is not None and hasattr(getattr(it, "obj", None), "hypothesis")
            and it.get_closest_marker("input_validation") is None and set(it.fixturenames) <= {"impl"}
            and not _skipped(it)]


def fails_at_once(item, impl, setup, teardown) -> bool:
    """Does the property fail on its pins (one coverage pin of them) or, without pins, on one generated case?"""
    from flashcheck.strategies import context

    setup(item)
    test = context.current()
    test.first_pass = True
    try:
        with one_example(item.obj, pinned=bool(test.pins)), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            item.obj(impl=impl)
    except (_Unchanged, *_no_verdict()):
        return False
    except Exception:  # noqa: BLE001  (any failure, of the kernel or of the property, runs that property first)
        return True
    finally:
        teardown(item)
    return False


SETTINGS = "_hypothesis_internal_use_settings"  # where @given keeps a test's settings, read at each call


@contextlib.contextmanager
def one_example(test, pinned: bool):
    """The test's own settings with no shrinking and no database, and either its pins only (fit()
    lets one coverage pin through) or, for a property without pins (or a run without them), one
    generated example."""
    from hypothesis import Phase, settings

    own = getattr(test, SETTINGS, None)
    if own is None:  # a Hypothesis that keeps them elsewhere: the first pass has nothing to change
        raise _Unchanged
    phase = Phase.explicit if pinned and Phase.explicit in own.phases else Phase.generate  # pins may be off
    setattr(test, SETTINGS, settings(own, max_examples=1, database=None, derandomize=True, phases=[phase]))
    try:
        yield
    finally:
        setattr(test, SETTINGS, own)


class _Unchanged(Exception):
    pass


def run(session, impl_of, setup, teardown) -> str:
    """Reorder ``session.items`` so that the properties failing on their first case come first;
    return the line that says what the first pass found."""
    start = time.perf_counter()
    failing = []
    stop = session.config.option.maxfail  # under -x the run ends at its first failure: so does this pass
    for item in candidates(session.items, impl_of):
        if fails_at_once(item, impl_of(item), setup, teardown):
            failing.append(item)
            if stop and len(failing) >= stop:
                break
    if not failing:
        return ""
    first = set(map(id, failing))
    session.items.sort(key=lambda it: id(it) not in first)  # stable: the failing ones, in their order
    names = ", ".join(it.name for it in failing[:4]) + (", ..." if len(failing) > 4 else "")
    return (f"flashcheck: {len(failing)} propert{'y' if len(failing) == 1 else 'ies'} failed on a first case "
            f"({time.perf_counter() - start:.0f} s for one case of each) and run first: {names}")
