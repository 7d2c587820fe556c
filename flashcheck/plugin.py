"""The pytest plugin (entry point ``pytest11``): ``--impl`` and the kernel properties, from any directory.

- ``--impl SPEC`` (repeatable; or FLASHCHECK_IMPL, comma-separated) names the implementations
  to test. Their run collects flashcheck's kernel properties (properties/, every test of which
  takes ``impl``) wherever pytest runs, and only those; the suite's own tests (tests/, mutants/,
  marker ``selftest``) are left out.
- Without ``--impl``, in a flashcheck checkout, the built-in implementations run, and so do the
  self-tests. Anywhere else the plugin stays out of the way.
- Each test taking ``impl`` runs once per implementation; a test marked
  ``@pytest.mark.requires("lse")`` (etc.) is skipped, with the reason, where the capability
  is not declared (flashcheck.contract.capabilities). A property none of whose drawn cases fits
  the declarations is skipped with them; one input that gave two verdicts (Hypothesis's
  FlakyFailure) is reported as nondeterminism, or as an error that did not recur when the first
  call raised or failed to compile (properties/helpers.py); an ``@example`` pin refitted to the
  declarations, or not run on them, is a PinNotAsWritten warning (in a plug-in run, only for the
  pins of the user's own tests: the suite's pins are refitted to every kernel by design).
- ``-n N`` in the gpu profile schedules with xdist's "worksteal" unless ``--dist`` is given.
- Numeric properties run before the ``input_validation`` ones, so a kernel that validates
  nothing does not stop an ``-x`` run before its numbers were checked. In a plug-in run, those
  that fail on a first case (flashcheck.firstpass) run before the others.
- FLASHCHECK_PROPERTY_SECONDS gives each property a time budget for its generated cases, counted
  from the first one, after its pins (a night sized by time).
- A failing kernel property prints a short report (flashcheck.report) and writes a reproducer.
- Nothing tested is a failure: an implementation for a device this machine lacks stops the
  run at once, and a run whose every kernel property was skipped fails; ``--allow-skip`` opts out.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import flashcheck
from flashcheck import timing  # pytest and the standard library only: numpy, torch and Hypothesis load
                               # when a run is about flashcheck, never in a stranger's pytest run

MARKERS = (
    "properties: Hypothesis property tests (the main suite: pytest -m properties)",
    "input_validation: bad input is refused with a named error (also part of -m properties; runs after the "
    "numeric properties)",
    "selftest: the suite's own tests (strategies, loader, references); never run on a plug-in",
    "gpu: needs CUDA; skipped without it (tox -e gpu)",
    "interpreter: Triton kernels under TRITON_INTERPRET=1 on CPU",
    "requires(*capabilities): the declared capabilities a property needs (lse, backward, blocks, ...)",
    "slow: long runs, opt-in",
    "bench: pytest-benchmark timings, opt-in",
    "mutants: runs the suite against deliberately broken implementations",
)
FIRST = ["test_forward.py", "test_backward.py"]  # a failure of the output itself is the easiest to read
SLOW_CALL = 0.25  # seconds per kernel call past which a run is worth a warning (~40 examples per property)


class State:
    """What the plugin decided at configure time, kept on the config."""

    def __init__(self, impls, kernel_mode, allow_skip, suite_dirs):
        self.impls = impls
        self.kernel_mode = kernel_mode  # implementations named by --impl / FLASHCHECK_IMPL
        self.allow_skip = allow_skip
        self.suite_dirs = suite_dirs  # where flashcheck's own tests live
        self.ran: dict[str, int] = {}  # implementation -> kernel properties that ran (not skipped)
        self.skipped: dict[str, str] = {}  # implementation -> the first skip reason
        self.slow_warned: set[str] = set()
        self.verdict = ""  # the one line that failed the run for testing nothing


def _properties_dir() -> Path:
    import flashcheck.properties

    return Path(flashcheck.properties.__file__).resolve().parent


def _checkout(path: Path) -> Path | None:
    """The flashcheck checkout ``path`` is in (or None): a folder with flashcheck/, impls/, properties/."""
    for folder in (path, *path.parents):
        if all((folder / sub / "__init__.py").is_file() for sub in ("flashcheck", "impls", "properties")):
            return folder
    return None


def _specs(config) -> list[str]:
    return config.getoption("--impl") or [s.strip() for s in os.environ.get("FLASHCHECK_IMPL", "").split(",")
                                          if s.strip()]


def pytest_addoption(parser):
    group = parser.getgroup("flashcheck")
    group.addoption("--impl", action="append", default=[], metavar="FILE.py:function",
                    help="run flashcheck's kernel properties on this implementation (repeatable; also "
                         "FLASHCHECK_IMPL, comma-separated; or a built-in's name)")
    group.addoption("--allow-skip", action="store_true", default=False,
                    help="flashcheck: accept a run in which no kernel property ran (e.g. a CUDA-only "
                         "kernel on a CPU machine) instead of failing it")


@pytest.hookimpl(tryfirst=True)  # before Hypothesis's plugin loads the profile, so a bad name gets one line
def pytest_configure(config):
    given_order = timing.order_log(None)
    if given_order:  # an earlier run's timing log: the longest tests first, in any run
        config.pluginmanager.register(timing.Order(given_order), "flashcheck-order")
    specs = _specs(config)
    checkout = _checkout(Path(str(config.rootpath)).resolve())
    if not specs and checkout is None:
        config.flashcheck_idle = True  # a pytest run that is not about flashcheck, unless it finds nothing
        return
    from flashcheck import devices

    devices.pin_workers(config)  # before anything in a worker initializes CUDA
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    # Hypothesis imports libcst to write a patch for a failing example; its deprecations are noise here
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:libcst.*")
    here = Path(flashcheck.__file__).resolve().parent.parent
    if checkout is not None and checkout != here and not specs:
        raise pytest.UsageError(f"this flashcheck checkout ({checkout}) is not the flashcheck pytest imports "
                                f"({here}); run pip install -e . in the checkout")
    _switch_triton_interpreter()
    _cache_autotuning()
    _share_compiles()
    profile = _load_profile(config)
    devices.steal_work(config, profile)
    walls = None if given_order else timing.order_log(profile)
    if walls:  # no log of its own: the last lane's walls
        config.pluginmanager.register(timing.Order(walls), "flashcheck-order")
    if os.environ.get("FLASHCHECK_PROPERTY_SECONDS"):
        _seconds(os.environ["FLASHCHECK_PROPERTY_SECONDS"])  # a bad value stops the run before it starts
    from flashcheck.contract import ContractError, builtins, load
    from flashcheck.contract.call import device_for
    from flashcheck.strategies import buckets, draw as fs_draw

    try:
        buckets.choose_seed(config.getoption("hypothesis_seed", None))  # before xdist starts its workers
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    timing.register(config, profile)
    devices.share_cores(config)
    try:
        impls = [load(s) for s in specs] if specs else builtins()
    except ContractError as exc:
        raise pytest.UsageError(str(exc)) from exc
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in sys.modules:
        from flashcheck.impls import interpreter

        interpreter.pick_autotuned_configs()  # an autotuned plug-in runs there, every tile in turn
    allow_skip = config.getoption("--allow-skip")
    if specs and not allow_skip:
        for impl in impls:
            if device_for(impl) is None:
                raise pytest.UsageError(
                    f"{impl.name} declares devices={impl.devices!r} and none is present here (no CUDA): "
                    "nothing would be tested; run it where its device is, declare 'cpu' too if it runs "
                    "there, or pass --allow-skip")
    if not specs and fs_draw.limits() is fs_draw.LIMITS["gpu"]:
        # the gpu profile's long sequences are for device kernels; CPU ones have their own lane
        impls = [i for i in impls if "cuda" in i.devices]
    suite = [_properties_dir()] + ([checkout] if checkout else [])
    config.flashcheck = State(impls, bool(specs), allow_skip, suite)
    if specs:
        _keep_hypothesis_files_in(Path.cwd() / ".flashcheck")
        _collect_kernel_properties(config)


def _collect_kernel_properties(config):
    """Run the kernel properties wherever pytest was started. Without paths on the command line
    they replace the default (the current directory, or an ini's testpaths), which may hold a
    virtualenv that pytest would not look into; given paths are kept and the properties added."""
    props = str(_properties_dir())
    if any(str(Path(a.split("::")[0]).resolve()).startswith(props) for a in config.args):
        return
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(props)
    else:
        config.args[:] = [props]


def _cache_autotuning():
    """Triton's autotuner times every configuration of a kernel for every new key, in every process:
    most of an autotuned plug-in's time in the gpu lane. Its disk cache (beside the compiled kernels,
    keyed by the kernel's source, the configurations and the key) lets xdist's workers and the next
    run reuse the choice. Read when ``@triton.autotune`` runs, so set before any plug-in is loaded;
    TRITON_CACHE_AUTOTUNING=0 keeps the benchmarks. The interpreter times nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def _share_compiles():
    """One compile of each Triton kernel across the lane's processes (flashcheck/compile_share.py), read
    by Triton when it compiles; not under the interpreter, without flock (Windows), or where the run
    names a cache manager of its own (TRITON_CACHE_MANAGER)."""
    if os.environ.get("TRITON_INTERPRET") != "1" and sys.platform != "win32":
        os.environ.setdefault("TRITON_CACHE_MANAGER", "flashcheck.compile_share:SharedCompiles")


def _switch_triton_interpreter():
    """Without CUDA, Triton kernels still run, slowly, in Triton's CPU interpreter; it must be
    switched on before triton is imported. TRITON_INTERPRET=0 opts out."""
    from flashcheck.contract.call import cuda_available

    if "TRITON_INTERPRET" not in os.environ and not cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _load_profile(config):
    from flashcheck.contract.call import cuda_available
    from flashcheck.strategies import profiles

    name = config.getoption("hypothesis_profile", None) or profiles.default_profile()
    try:
        profiles.load(name)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    if name in ("gpu", "gpu-scale") and not cuda_available() and not config.getoption("--allow-skip"):
        raise pytest.UsageError(f"the {name} profile is for CUDA runners and this machine has no CUDA "
                                "(torch.cuda.is_available() is False); pass --allow-skip to run it anyway")
    return name


def _keep_hypothesis_files_in(home: Path):
    """A kernel run leaves one folder, .flashcheck/, in the kernel's repository: Hypothesis's own
    files (its constants cache) go there instead of .hypothesis/, and git ignores the folder."""
    from hypothesis.configuration import set_hypothesis_home_dir

    home.mkdir(exist_ok=True)
    if not (home / ".gitignore").exists():
        (home / ".gitignore").write_text("# written by flashcheck: saved examples and caches, not sources\n*\n")
    set_hypothesis_home_dir(home / "hypothesis")


def pytest_sessionstart(session):
    """Finish the Hypothesis profile once Hypothesis's own plugin has loaded it (after ours):
    saved failures per implementation (flashcheck.database), one failure reported per property
    (the smallest, not a group of every distinct bug met), and no pins under
    FLASHCHECK_SKIP_EXAMPLES."""
    if _state(session.config) is None:
        return
    from hypothesis import Phase, settings

    from flashcheck.database import PerImplementation

    current = settings.default
    name = getattr(settings, "get_current_profile_name", lambda: "profile")()
    changes = dict(report_multiple_bugs=False,
                   # the ci profile keeps no database: derandomized, nothing saved or replayed
                   database=None if current.database is None else PerImplementation.default())
    if os.environ.get("FLASHCHECK_SKIP_EXAMPLES"):
        changes["phases"] = [p for p in current.phases if p is not Phase.explicit]
    if os.environ.get("FLASHCHECK_NO_SHRINK"):  # the first failing case is the answer (a kill, not a minimum)
        changes["phases"] = [p for p in changes.get("phases", current.phases) if p is not Phase.shrink]
    # registered again under its own name: the strategies size cases by the profile's name
    settings.register_profile(name, current, **changes)
    settings.load_profile(name)


def _state(config) -> State | None:
    return getattr(config, "flashcheck", None)


def _marks(impl, needs):
    from flashcheck.contract import capabilities
    from flashcheck.contract.call import device_for

    marks = [getattr(pytest.mark, tag) for tag in impl.tags]
    if "cpu" not in impl.devices:
        marks.append(pytest.mark.gpu)
    if device_for(impl) is None:
        marks.append(pytest.mark.skip(reason=f"{impl.name} runs on {', '.join(impl.devices)}; none here"))
    marks += [pytest.mark.skip(reason=why) for why in capabilities.missing(impl, needs)]
    return marks


def pytest_generate_tests(metafunc):
    state = _state(metafunc.config)
    if state is None or "impl" not in metafunc.fixturenames:
        return
    needs = [n for m in metafunc.definition.iter_markers("requires") for n in m.args]
    metafunc.parametrize("impl", [pytest.param(i, id=i.name, marks=_marks(i, needs)) for i in state.impls])


def _in_suite(item, state) -> bool:
    path = str(Path(str(item.path)).resolve())
    return any(path.startswith(str(d)) for d in state.suite_dirs)


def _is_property(item) -> bool:
    """properties/ holds what runs on a kernel; the suite's own tests live in tests/ (and mutants/)."""
    return Path(str(item.path)).resolve().parent == _properties_dir()


def pytest_pycollect_makemodule(module_path, parent):
    """A kernel property file is imported by its one name, flashcheck.properties.<file>: in a
    checkout, pytest would otherwise name it after the folder (properties.<file>), a second module
    made from the same file, with its own copy of every global."""
    if Path(str(module_path)).resolve().parent == _properties_dir():
        return _KernelProperties.from_parent(parent, path=module_path)
    return None


def pytest_collect_directory(path, parent):
    """properties/ itself is imported by its one name too (pytest imports a package's __init__.py
    for its setup_module)."""
    if Path(str(path)).resolve() == _properties_dir():
        return _KernelPropertiesPackage.from_parent(parent, path=path)
    return None


class _KernelPropertiesPackage(pytest.Package):
    def setup(self):
        import importlib

        importlib.import_module("flashcheck.properties")  # it holds no setup_module to run


class _KernelProperties(pytest.Module):
    def _getobj(self):
        import importlib

        module = importlib.import_module(f"flashcheck.properties.{self.path.stem}")
        self.config.pluginmanager.consider_module(module)
        return module


@pytest.hookimpl(tryfirst=True)  # before -m selects, so that -m selftest sees the marker
def pytest_collection_modifyitems(config, items):
    state = _state(config)
    if state is None:
        return
    from flashcheck.contract.call import cuda_available

    strays = [it.nodeid for it in items if _is_property(it) and "impl" not in getattr(it, "fixturenames", ())]
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)}: a test in properties/ runs on a kernel and takes impl; "
                                "the suite's own tests live in tests/")
    selftests = [it for it in items if _in_suite(it, state) and not _is_property(it)]
    for item in selftests:
        item.add_marker(pytest.mark.selftest)
    if state.kernel_mode:  # a plug-in run: kernel properties only, the plainest first
        drop = set(map(id, selftests))
        config.hook.pytest_deselected(items=selftests)
        items[:] = [it for it in items if id(it) not in drop]
        items.sort(key=lambda it: FIRST.index(it.path.name) if it.path.name in FIRST else len(FIRST))
    # Numeric verdicts first: a kernel without input validation must not stop an -x run
    # before any property about its numbers has run (a stable sort keeps the order above).
    items.sort(key=lambda it: it.get_closest_marker("input_validation") is not None)
    if not cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA, which this machine lacks")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    from flashcheck import devices

    return devices.auto_workers(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """A plug-in run first tries one case of every property, and runs those that fail on it first
    (flashcheck.firstpass); the run proper is pytest's own loop. A run over xdist's workers, or
    with FLASHCHECK_FIRST_PASS=0, keeps pytest's order."""
    state = _state(session.config)
    distributed = hasattr(session.config, "workerinput") or session.config.getoption("dist", "no") != "no"
    if state is None or not state.kernel_mode or distributed or session.testsfailed or \
            session.config.option.collectonly or os.environ.get("FLASHCHECK_FIRST_PASS") == "0":
        return None
    from flashcheck import firstpass

    line = firstpass.run(session, _impl_of, pytest_runtest_setup, pytest_runtest_teardown)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line("")
        reporter.write_line(line, yellow=True)
    return None


def pytest_runtest_setup(item):
    from flashcheck.database import PerImplementation, key_of
    from flashcheck.strategies import AttentionCase, context

    test = getattr(item, "function", None)
    pins = getattr(test, "hypothesis_explicit_examples", ())
    impl = _impl_of(item)
    seconds = os.environ.get("FLASHCHECK_PROPERTY_SECONDS")
    context.begin(impl=impl, pins=frozenset(v for pin in pins for v in pin.kwargs.values()
                                            if isinstance(v, AttentionCase)),
                  coverage=getattr(test, "flashcheck_coverage", frozenset()),
                  budget=_seconds(seconds) if seconds and impl is not None else None)
    item.flashcheck_unwatch = context.watch_failures(getattr(item, "obj", None))
    PerImplementation.current = key_of(impl) if impl is not None and _state(item.config) else None


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise pytest.UsageError(f"FLASHCHECK_PROPERTY_SECONDS={text!r}: expected a number of seconds > 0")
    return seconds


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test's reports: a lost CUDA context ends this process's run (flashcheck/devices.py)."""
    try:
        return (yield)
    finally:
        if not getattr(item.config, "flashcheck_idle", False):
            from flashcheck import devices

            devices.stop_if_lost(item)


def pytest_runtest_teardown(item):
    from flashcheck.database import PerImplementation
    from flashcheck.strategies import context

    PerImplementation.current = None
    getattr(item, "flashcheck_unwatch", lambda: None)()
    context.end()


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """Say what Hypothesis's own errors mean for a kernel, and report @example pins not run as written."""
    from hypothesis.errors import FailedHealthCheck, FlakyFailure, Unsatisfiable

    from flashcheck.strategies import context, draw as fs_draw

    impl = _impl_of(pyfuncitem) if _state(pyfuncitem.config) is not None else None
    test = context.current()
    try:
        return (yield)
    except context.BudgetSpent:
        return None  # the budget ended the property after its pins and generated cases, all passed
    except (FailedHealthCheck, Unsatisfiable) as exc:
        if impl is None or not (isinstance(exc, Unsatisfiable) or "filter_too_much" in str(exc)):
            raise
        from flashcheck.contract import capabilities

        # Every case drawn for this property fell outside what the implementation declares.
        pytest.skip(f"{impl.name}: no case this property draws fits its declarations ({capabilities.declared(impl)})"
                    + (f"; last refusal: {test.last_refusal}" if test.last_refusal else ""))
    except FlakyFailure as exc:
        last = test.last_fitted
        if impl is None or last is None:
            raise
        from flashcheck import report

        raise AssertionError(report.nondeterminism(impl, last[1], first=(exc.exceptions or [None])[0])) from exc
    finally:
        if test.pin_reports and _pins_are_news(pyfuncitem):
            pyfuncitem.warn(fs_draw.PinNotAsWritten(f"{impl.name if impl else ''}: " + "; ".join(test.pin_reports)))


def _pins_are_news(item) -> bool:
    """A pin not run as written is news to whoever wrote it: the suite's own pins are refitted to
    every kernel by design, so a plug-in run reports only the pins of the user's own tests."""
    state = _state(item.config)
    own = Path(str(item.path)).resolve().parent == _properties_dir()
    return not (state is not None and state.kernel_mode and own)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A pinned @example that fails is shrunk further here, so the report shows the smallest case."""
    try:
        return (yield)
    except BaseException as exc:
        impl = _impl_of(item)
        if impl is not None and _state(item.config) is not None and isinstance(exc, Exception):
            from flashcheck import pins

            item.flashcheck_pin = pins.shrink_failing_pin(item, impl, exc)
        raise


def _impl_of(item):
    return getattr(getattr(item, "callspec", None), "params", {}).get("impl")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failing kernel property: a reproducer, and a report a kernel author reads in 10 lines."""
    rep = yield
    state, impl = _state(item.config), _impl_of(item)
    if state is None or impl is None:
        return rep
    if rep.skipped:
        state.skipped.setdefault(impl.name, rep.longrepr[-1].removeprefix("Skipped: ")
                                 if isinstance(rep.longrepr, tuple) else "skipped")
    if rep.when != "call":
        return rep
    if not rep.skipped:
        state.ran[impl.name] = state.ran.get(impl.name, 0) + 1
    if state.kernel_mode:
        _warn_if_slow(item, impl, state)
    if not rep.failed or call.excinfo is None:
        return rep
    from flashcheck import report
    from flashcheck.contract import origin_of

    failure = report.Failure.of(item, impl, call.excinfo.value, getattr(item, "flashcheck_pin", None))

    where = None
    from flashcheck.strategies import context

    skip = context.current().no_reproducer
    if skip is not None and failure.case is not None:
        rep.sections.append(("flashcheck reproducer", f"none: {skip}"))
    try:
        if failure.case is not None and skip is None:  # a property about one case (not a malformed-input check)
            from flashcheck import repro

            where = repro.write(failure.case, origin_of(impl), item.nodeid, failure.full_message, who=impl.name)
            report.heatmap(failure, where / "error.png")
    except Exception as exc:  # a reproducer is a courtesy: never mask the real failure
        rep.sections.append(("flashcheck reproducer", f"could not be written: {type(exc).__name__}: {exc}"))
    if item.config.option.tbstyle in ("auto", "short"):  # --tb=long/native keep pytest's full report
        rep.longrepr = report.Text(failure.render(where))
    elif where is not None:
        rep.sections.append(("flashcheck reproducer", f"replay: flashcheck replay {where}"))
    return rep


def slow_warning(name: str, calls: int, seconds: float) -> str | None:
    """One line for a kernel slow enough that a run will take minutes (None when it is not)."""
    if calls < 3 or seconds / calls < SLOW_CALL:
        return None
    per = seconds / calls
    return (f"flashcheck: {name} takes {per:.2f} s per call here; a property makes 25-80 calls, so expect "
            f"~{per * 50:.0f} s per property (FLASHCHECK_PROFILE=ci draws 25 examples, the default 40)")


def _warn_if_slow(item, impl, state):
    from flashcheck.contract.call import SECONDS

    line = slow_warning(impl.name, *SECONDS.get(impl.name, (0, 0.0)))
    if impl.name in state.slow_warned or line is None:
        return
    state.slow_warned.add(impl.name)
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(line, yellow=True)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Nothing tested is not a pass: fail the run when no kernel property ran for an implementation."""
    state = _state(session.config)
    if state is None or not state.kernel_mode or state.allow_skip or exitstatus not in (0, 1):
        return
    idle = [i for i in state.impls if not state.ran.get(i.name) and i.name in state.skipped]
    if idle:
        first = idle[0]
        state.verdict = (f"flashcheck: every kernel property was skipped for {first.name} "
                         f"({state.skipped[first.name]}); "
                         "nothing was tested. Pass --allow-skip to accept that.")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = _state(config)
    if state is not None and state.verdict:
        terminalreporter.write_line(state.verdict, red=True, bold=True)
    if getattr(config, "flashcheck_idle", False) and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        # outside a flashcheck checkout the kernel properties run only on a kernel named with --impl
        terminalreporter.write_line("flashcheck: no --impl given, so no kernel property ran; test your kernel with "
                                    "pytest --impl FILE.py:function -m properties (or flashcheck check "
                                    "FILE.py:function)", yellow=True)
