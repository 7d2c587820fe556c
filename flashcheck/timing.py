"""Where a run's time goes: wall time, compile time and examples per test, as a terminal summary.

Registered by the pytest plugin (flashcheck/plugin.py). Per test it measures:

- wall: the call phase, as pytest's own ``--durations`` does;
- jit: seconds in Triton's JIT compiling (or loading from its disk cache) kernels it had not
  yet built in this process, between Triton's ``jit_cache_hook`` and ``jit_post_compile_hook``
  (Triton >= 3.4; "-" where they do not exist or nothing ran on Triton's JIT);
- torch.compile: seconds dynamo and inductor spent compiling (``torch._dynamo.utils``);
- jax: seconds JAX spent tracing, lowering and compiling with XLA (its ``/jax/core/compile/``
  duration events, through ``jax.monitoring``);
- examples: test cases that ran to a verdict (Hypothesis's rejected draws left out), counted by
  wrapping the test's ``hypothesis.inner_test``, the hook Hypothesis offers plug-ins.

The table prints in the gpu profile, or wherever FLASHCHECK_TIMING=1 (FLASHCHECK_TIMING=0
silences it). FLASHCHECK_TIMING_LOG=PATH also appends one JSON line per finished example and
per finished test, from every xdist worker, so that a run stopped by a timeout still tells how
far it got and why a test failed (a failed test's line carries its message's "E " lines;
bench/gpu_lane_speed.py reads it). FLASHCHECK_ORDER_BY=PATH runs the tests longest first by the wall
times such a log recorded (``longest_first``); in the gpu profile, without one, by LANE_WALLS.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

ENV, LOG_ENV = "FLASHCHECK_TIMING", "FLASHCHECK_TIMING_LOG"
SHOWN = 15  # slowest tests in the table
_KEY = "flashcheck_timing"  # the user property a test's numbers travel in (through xdist too)


class Clock:
    """Compile seconds so far in this process: Triton's JIT (through its hooks) and torch.compile."""

    def __init__(self):
        self.jit_s = 0.0
        self.jit_n = 0
        self.hooked = False  # looked for Triton's hooks
        self.timing = False  # and found them: the jit column is measured
        self._started = None
        self._active: set = set()  # threads compiling now
        self._lock = threading.Lock()
        self.jax_s = 0.0
        self.jax_hooked = False

    def hook_triton(self):
        """Chain onto Triton's compile hooks once triton is imported (never importing it here)."""
        if self.hooked or "triton" not in sys.modules:
            return
        self.hooked = True
        runtime = getattr(getattr(sys.modules["triton"], "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return  # Triton < 3.4, or the interpreter's stub: the jit column stays "-"
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        # Compiles may run in several threads at once (impls/triton_warm.py): the column counts the
        # seconds during which at least one runs. A compile that raises never reports back; its
        # thread's next compile takes its place.
        def on_miss(*args, **kwargs):  # a kernel not built yet in this process: compile (or disk-load) starts
            with self._lock:
                if not self._active:
                    self._started = time.perf_counter()
                self._active.add(threading.get_ident())
            return before(*args, **kwargs) if before else None  # a true value would skip the compile

        def on_built(*args, **kwargs):
            with self._lock:
                if threading.get_ident() in self._active:
                    self._active.discard(threading.get_ident())
                    self.jit_n += 1
                    if not self._active:
                        self.jit_s += time.perf_counter() - self._started
            return after(*args, **kwargs) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_built
        self.timing = True

    def hook_jax(self):
        """Listen to JAX's compile events once jax is imported (never importing it here)."""
        if self.jax_hooked or "jax" not in sys.modules:
            return
        self.jax_hooked = True
        register = getattr(getattr(sys.modules["jax"], "monitoring", None), "register_event_duration_secs_listener",
                           None)
        if register is None:
            return

        def on_duration(event, duration, *args, **kwargs):
            if str(event).startswith("/jax/core/compile/"):
                self.jax_s += float(duration)

        register(on_duration)

    @staticmethod
    def torch_compile_s() -> float:
        dynamo = sys.modules.get("torch._dynamo.utils")
        if dynamo is None or not hasattr(dynamo, "calculate_time_spent"):
            return 0.0
        try:
            return float(dynamo.calculate_time_spent().get("total_wall_time", 0.0))
        except Exception:  # a private API: its absence must never fail a test
            return 0.0

    def now(self) -> tuple[float, int, float, float]:
        return self.jit_s, self.jit_n, self.torch_compile_s(), self.jax_s

    def hook(self):
        self.hook_triton()
        self.hook_jax()


class Timing:
    """The pytest plugin object (one per process; the xdist controller only collects and prints)."""

    def __init__(self, config, show: bool, profile: str):
        self.config = config
        self.show = show
        self.profile = profile
        self.clock = Clock()
        self.rows: list[dict] = []
        self.log = os.environ.get(LOG_ENV)

    def _write(self, record: dict):
        if self.log:
            with open(self.log, "a") as f:  # one short line per append: safe across worker processes
                f.write(json.dumps(record) + "\n")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        self.clock.hook()
        hyp = getattr(getattr(item, "obj", None), "hypothesis", None)
        inner = getattr(hyp, "inner_test", None)
        start, begun = self.clock.now(), time.perf_counter()
        counted = [0]
        if inner is not None:
            from hypothesis.errors import UnsatisfiedAssumption

            try:
                from flashcheck.strategies.context import BudgetSpent
            except ImportError:  # a tree from before the budget, timed by bench/gpu_lane_speed.py --then
                BudgetSpent = UnsatisfiedAssumption

            def verdict(kwargs):  # one more example ran to a verdict
                counted[0] += 1
                if self.log:
                    case = kwargs.get("case")
                    self._write(dict(kind="example", test=item.nodeid, impl=_impl_name(item), at=time.time(),
                                     t=time.perf_counter() - begun, jit=self.clock.jit_s - start[0],
                                     case=None if case is None else repr(case)))

            @functools.wraps(inner)
            def counting(*args, **kwargs):
                try:
                    out = inner(*args, **kwargs)
                except (UnsatisfiedAssumption, BudgetSpent):  # a rejected draw, or the budget's end: no example
                    raise
                except BaseException:
                    verdict(kwargs)
                    raise
                verdict(kwargs)
                return out

            hyp.inner_test = counting
        try:
            return (yield)
        finally:
            if inner is not None:
                hyp.inner_test = inner
            self.clock.hook()  # a plug-in may import triton or jax only on its first call
            end = self.clock.now()
            item.user_properties.append((_KEY, dict(
                impl=_impl_name(item), examples=counted[0] if inner is not None else None,
                jit=end[0] - start[0] if self.clock.timing else None,
                compiles=end[1] - start[1], torch_compile=max(0.0, end[2] - start[2]),  # a torch._dynamo.reset() zeroes dynamo's total
                jax=end[3] - start[3])))

    def pytest_runtest_logreport(self, report):
        if report.when != "call":
            return
        numbers = dict(report.user_properties).get(_KEY)
        if numbers is None:
            return
        row = dict(test=report.nodeid, wall=report.duration, outcome=report.outcome, **numbers)
        self.rows.append(row)
        if not hasattr(self.config, "workerinput"):  # the controller (or a run without xdist) writes it once
            # a failure's message goes with it: a run stopped at a time limit writes no report at its end
            why = {"failure": _head(report.longreprtext)} if report.failed else {}
            self._write(dict(kind="test", at=time.time(), **row, **why))

    def pytest_terminal_summary(self, terminalreporter):
        if self.show and self.rows:
            from flashcheck.strategies import buckets

            lines = table(self.rows)
            if buckets.active(self.profile.split("-")[0]):
                lines.insert(2, "  " + buckets.describe())
            for line in lines:
                terminalreporter.write_line(line)


def _head(text: str, lines: int = 40) -> str:
    """The part of a failure's text that says what failed: flashcheck's own lines (the property, the
    case, the worst entry), found from the end of pytest's long report, where its AssertionError is."""
    kept = [line for line in text.splitlines() if line.startswith("E ")] or text.splitlines()
    return "\n".join(kept[-lines:])


def _impl_name(item) -> str:
    impl = getattr(getattr(item, "callspec", None), "params", {}).get("impl")
    return getattr(impl, "name", "")


def _s(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(rows: list[dict], shown: int = SHOWN) -> list[str]:
    """The summary: the slowest tests, then the totals per implementation."""
    out = ["", f"flashcheck timing (slowest {min(shown, len(rows))} of {len(rows)} tests; jit = Triton's JIT "
               "compiles, torch.compile = dynamo + inductor, jax = JAX's trace, lowering and XLA compile)",
           f"{'wall s':>8} {'jit s':>7} {'compiles':>8} {'torch.compile s':>15} {'jax s':>7} {'examples':>8} "
           f"{'ex/s':>6}  test"]
    for r in sorted(rows, key=lambda r: -r["wall"])[:shown]:
        out.append(f"{r['wall']:8.1f} {_s(r['jit']):>7} {r['compiles']:8d} {_s(r['torch_compile'] or None):>15} "
                   f"{_s(r.get('jax') or None):>7} {'-' if r['examples'] is None else r['examples']:>8} "
                   f"{_rate(r['examples'], r['wall']):>6}  {r['test']}")
    totals: dict[str, dict] = {}
    for r in rows:
        t = totals.setdefault(r["impl"] or "(no implementation)",
                              dict(wall=0.0, jit=None, compiles=0, torch_compile=0.0, jax=0.0, examples=0, tests=0))
        t["wall"] += r["wall"]
        t["compiles"] += r["compiles"]
        t["torch_compile"] += r["torch_compile"]
        t["jax"] += r.get("jax") or 0.0
        t["examples"] += r["examples"] or 0
        t["tests"] += 1
        if r["jit"] is not None:
            t["jit"] = (t["jit"] or 0.0) + r["jit"]
    out.append("per implementation (sums over its tests):")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]["wall"]):
        out.append(f"{t['wall']:8.1f} {_s(t['jit']):>7} {t['compiles']:8d} {_s(t['torch_compile'] or None):>15} "
                   f"{_s(t['jax'] or None):>7} {t['examples']:8d} {_rate(t['examples'], t['wall']):>6}  {name} "
                   f"({t['tests']} tests)")
    return out


def _rate(examples, wall) -> str:
    return "-" if not examples or wall <= 0 else f"{examples / wall:.2f}"


ORDER_ENV = "FLASHCHECK_ORDER_BY"
# The built-ins' walls in a whole gpu lane on one H200 (2026-12-06, every test that ran): the order a
# gpu-profile run takes when FLASHCHECK_ORDER_BY names no log of its own (0: pytest's order). Without
# it the longest tests (FlexAttention's, 50-150 s) started last, and that lane ended 2 min after the
# summed work divided by its eight workers. A kernel's own tests are unknown to it: they go first.
LANE_WALLS = Path(__file__).with_name("lane_walls.jsonl")


def order_log(profile: str | None) -> str | None:
    """The timing log a run orders its tests by: FLASHCHECK_ORDER_BY's, else (once the profile is
    known) LANE_WALLS in a gpu profile; None for pytest's order."""
    given = os.environ.get(ORDER_ENV, "")
    if given == "0":
        return None
    if given:
        return given
    gpu = profile is not None and profile.split("-")[0] == "gpu"
    return str(LANE_WALLS) if gpu and LANE_WALLS.is_file() else None  # an install without it: pytest's order


def longest_first(items: list, path: str) -> None:
    """Sort ``items`` in place by the wall time each test took in an earlier run's log (a
    FLASHCHECK_TIMING_LOG), longest first; tests the log does not know (new ones) go first of all.
    Over xdist's workers a run's end waits for the slowest test started last: started first, it
    runs beside the many short ones instead. The sort is stable, and input-validation properties
    stay after the numeric ones."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise pytest.UsageError(f"{ORDER_ENV}={path!r}: cannot read that timing log ({exc})") from None
    wall = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut off when that run was stopped
        if isinstance(record, dict) and record.get("kind") == "test":
            wall[record["test"]] = float(record["wall"])
    items.sort(key=lambda it: (it.get_closest_marker("input_validation") is not None,
                               -wall.get(it.nodeid, float("inf"))))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:  # inside an xdist worker: every worker sorts its own (identical) collection alike
        items[:] = by_worker(items, wall, workers)


LIGHT = 1.0  # seconds: a test below this in the log (a skip, most refusals) fills a worker's run


def _kernel(item) -> str | None:
    impl = getattr(getattr(item, "callspec", None), "params", {}).get("impl")
    return getattr(impl, "name", None)


def by_worker(ordered: list, wall: dict, workers: int, kernel=_kernel) -> list:
    """``ordered`` (longest first) laid out as xdist's worksteal hands it out: one contiguous run per
    worker, of equal counts. Each worker's run starts with its share of the long tests, so that no
    long test waits behind another (a queue sorted longest first gave the first worker every long
    one: a gpu lane left its 49 longest unstarted), and stealing takes from the short ends.

    The long tests of one kernel go to as few workers as their time allows: each worker compiles
    for itself (torch.compile's graphs, Triton's JIT), and a kernel dealt round all eight compiled
    each graph eight times, at once, so that none found it in the disk caches (an H200 lane: 1485 s
    of 4300 compiling FlexAttention). A test the log does not know counts as the mean long one."""
    quota, left = [], len(ordered)
    for w in range(workers):  # as worksteal's first hand: each idle worker len(pending) // workers left
        quota.append(left // (workers - w))
        left -= quota[-1]
    long = [it for it in ordered if wall.get(it.nodeid, float("inf")) >= LIGHT]
    known = [wall[it.nodeid] for it in long if it.nodeid in wall]
    mean = sum(known) / len(known) if known else 1.0
    cost = {id(it): wall.get(it.nodeid, mean) for it in long}
    target = sum(cost.values()) / workers
    runs, load, homes = [[] for _ in range(workers)], [0.0] * workers, {}
    for it in long:
        open_ = [w for w in range(workers) if len(runs[w]) < quota[w]]
        key = kernel(it)
        home = [w for w in homes.get(key, ()) if w in open_ and load[w] + cost[id(it)] <= target]
        w = min(home or open_, key=load.__getitem__)
        if key is not None and w not in homes.setdefault(key, []):
            homes[key].append(w)
        runs[w].append(it)
        load[w] += cost[id(it)]
    rest = iter(it for it in ordered if wall.get(it.nodeid, float("inf")) < LIGHT)
    for w in range(workers):
        runs[w] += [next(rest) for _ in range(quota[w] - len(runs[w]))]
    return [it for run in runs for it in run]


class Order:
    """FLASHCHECK_ORDER_BY's plug-in: it sorts last, after -m and -k have deselected, since xdist hands
    each worker an equal count of what is left."""

    def __init__(self, path: str):
        self.path = path

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        longest_first(items, self.path)


def register(config, profile: str):
    """Called by the plugin's pytest_configure once the Hypothesis profile is known."""
    switch = os.environ.get(ENV, "")
    if switch not in ("", "0", "1"):
        raise pytest.UsageError(f"{ENV} must be 0 (no timing table) or 1 (print it), got {switch!r}")
    show = switch == "1" or (switch == "" and profile.split("-")[0] == "gpu")
    if show or os.environ.get(LOG_ENV):
        config.pluginmanager.register(Timing(config, show, profile), "flashcheck-timing")
