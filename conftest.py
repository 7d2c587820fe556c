"""Wires implementations into the property tests.

Every test that takes an ``impl`` argument runs once per selected implementation:
the built-ins, or those named by ``--impl`` / FLASHCHECK_IMPL. A test marked
``@pytest.mark.requires("lse")`` (etc.) is skipped, with the reason, for an
implementation that does not declare that capability.
"""
import os

import pytest
from hypothesis import settings
from hypothesis.errors import FailedHealthCheck, FlakyFailure, Unsatisfiable

from impls.call import cuda_available

# Without CUDA, Triton kernels still run, slowly, in Triton's CPU interpreter; it must be
# switched on before triton is imported. TRITON_INTERPRET=0 opts out.
if "TRITON_INTERPRET" not in os.environ and not cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"

import strategies.profiles  # noqa: E402,F401  (registers and loads the Hypothesis profiles)
import repro  # noqa: E402
from impls import ContractError, builtins, load, spec_of  # noqa: E402
from strategies import AttentionCase  # noqa: E402
from strategies.case import CASE_PATTERN  # noqa: E402
from strategies import draw as fs_draw  # noqa: E402
from impls.call import device_for  # noqa: E402
from impls import capabilities  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--impl", action="append", default=[], metavar="FILE.py:function",
                     help="test this implementation instead of the built-ins (repeatable; "
                          "also FLASHCHECK_IMPL, comma-separated)")


def pytest_configure(config):
    chosen = config.getoption("hypothesis_profile", None)
    if chosen:  # Hypothesis's plugin loads it too, but maybe after this hook: the lane depends on it
        settings.load_profile(chosen)
    specs = config.getoption("--impl") or [s.strip() for s in os.environ.get("FLASHCHECK_IMPL", "").split(",")
                                           if s.strip()]
    try:
        impls = [load(s) for s in specs] if specs else builtins()
    except ContractError as exc:
        raise pytest.UsageError(str(exc)) from exc
    if not specs and fs_draw.limits() is fs_draw.LIMITS["gpu"]:
        # the gpu profile's long sequences are for device kernels; CPU ones have their own lane
        impls = [i for i in impls if "cuda" in i.devices]
    config.flashcheck_impls = impls


def _marks(impl, needs):
    marks = [getattr(pytest.mark, tag) for tag in impl.tags]
    if "cpu" not in impl.devices:
        marks.append(pytest.mark.gpu)
    if device_for(impl) is None:
        marks.append(pytest.mark.skip(reason=f"{impl.name} runs on {', '.join(impl.devices)}; none here"))
    marks += [pytest.mark.skip(reason=why) for why in capabilities.missing(impl, needs)]
    return marks


def pytest_generate_tests(metafunc):
    if "impl" not in metafunc.fixturenames:
        return
    needs = [n for m in metafunc.definition.iter_markers("requires") for n in m.args]
    impls = metafunc.config.flashcheck_impls
    metafunc.parametrize("impl", [pytest.param(i, id=i.name, marks=_marks(i, needs)) for i in impls])


def pytest_collection_modifyitems(config, items):
    # Numeric verdicts first: a kernel without input validation must not stop an -x run
    # before any property about its numbers has run.
    items.sort(key=lambda item: item.get_closest_marker("input_validation") is not None)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA, which this machine lacks")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """Say what Hypothesis's own errors mean for a kernel, and report @example pins not run as written."""
    impl = getattr(getattr(pyfuncitem, "callspec", None), "params", {}).get("impl")
    try:
        return (yield)
    except (FailedHealthCheck, Unsatisfiable) as exc:
        if impl is None or not (isinstance(exc, Unsatisfiable) or "filter_too_much" in str(exc)):
            raise
        # Every case drawn for this property fell outside what the implementation declares.
        pytest.skip(f"{impl.name}: no case this property draws fits its declarations ({capabilities.declared(impl)})"
                    + (f"; last refusal: {fs_draw.LAST_REFUSAL[0]}" if fs_draw.LAST_REFUSAL[0] else ""))
    except FlakyFailure as exc:
        last = fs_draw.LAST_FITTED[0]
        if impl is None or last is None:
            raise
        from properties import helpers as ph

        raise AssertionError(ph.nondeterminism(impl, last[1], first=(exc.exceptions or [None])[0])) from exc
    finally:
        if fs_draw.PIN_REPORTS:
            pyfuncitem.warn(fs_draw.PinNotAsWritten(f"{impl.name if impl else ''}: " + "; ".join(fs_draw.PIN_REPORTS)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failing property, write a standalone reproducer of the shrunk case."""
    outcome = yield
    report = outcome.get_result()
    impl = getattr(getattr(item, "callspec", None), "params", {}).get("impl")
    if report.when != "call" or not report.failed or impl is None:
        return
    message = str(call.excinfo.value) if call.excinfo else ""
    # The failing case is the one the assertion names; Hypothesis may have run others since.
    named = CASE_PATTERN.search(message)
    last = fs_draw.LAST_FITTED[0]
    case = eval(named.group(0), {"AttentionCase": AttentionCase}) if named else last and last[1]
    if case is None:
        return
    try:
        where = repro.write(case, spec_of(impl), item.nodeid, message)
    except Exception as exc:  # a reproducer is a courtesy: never mask the real failure
        report.sections.append(("flashcheck reproducer", f"could not be written: {exc}"))
        return
    report.sections.append(("flashcheck reproducer", f"written to {where}\nreplay: python -m repro {where} "
                            f"[--impl FILE.py:function]"))


def pytest_runtest_setup(item):
    fs_draw.LAST_FITTED[0] = fs_draw.LAST_REFUSAL[0] = None
    pins = getattr(getattr(item, "function", None), "hypothesis_explicit_examples", ())
    fs_draw.PINS[0] = frozenset(v for pin in pins for v in pin.kwargs.values() if isinstance(v, AttentionCase))
    fs_draw.PIN_REPORTS.clear()
