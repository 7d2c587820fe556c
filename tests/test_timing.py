"""The timing summary (flashcheck/timing.py): wall, compile and examples per test, and its log."""
import json
import os
import sys
import types

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flashcheck import timing

pytestmark = pytest.mark.properties


def test_examples_are_counted_per_test_and_logged(tmp_path, monkeypatch):
    """The plugin's hooks driven by hand on a Hypothesis test that rejects every other draw."""
    log = tmp_path / "timing.jsonl"
    monkeypatch.setenv(timing.LOG_ENV, str(log))
    monkeypatch.delitem(sys.modules, "triton", raising=False)  # no JIT here: its column reads "-"

    @settings(max_examples=20, database=None, derandomize=True)
    @given(st.integers(0, 100))
    def prop(n):
        assume(n % 2)

    config = types.SimpleNamespace()  # no workerinput: the process that writes test records
    plugin = timing.Timing(config, show=True, profile="ci")
    impl = types.SimpleNamespace(name="my-kernel")
    item = types.SimpleNamespace(obj=prop, nodeid="t.py::prop[my-kernel]", user_properties=[],
                                 callspec=types.SimpleNamespace(params={"impl": impl}))
    original = prop.hypothesis.inner_test
    call = plugin.pytest_runtest_call(item)
    next(call)
    prop()
    with pytest.raises(StopIteration):
        call.send(None)
    report = types.SimpleNamespace(when="call", nodeid=item.nodeid, duration=2.0, outcome="passed", failed=False,
                                   user_properties=item.user_properties)
    plugin.pytest_runtest_logreport(report)
    text = "    def test(...):\n>       orc.compare(...)\nE   my-kernel o: 1 of 4 entries off by more than allowed\nE     case: c"
    plugin.pytest_runtest_logreport(types.SimpleNamespace(**{**vars(report), "nodeid": "t.py::other", "failed": True,
                                                           "outcome": "failed", "longreprtext": text}))
    failed = json.loads(log.read_text().splitlines()[-1])
    assert failed.get("failure") == "E   my-kernel o: 1 of 4 entries off by more than allowed\nE     case: c", \
        f"expected the failure's E lines in its record, got {failed}"
    log.write_text("\n".join(log.read_text().splitlines()[:-1]) + "\n")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    examples = [r for r in records if r["kind"] == "example"]
    (test,) = [r for r in records if r["kind"] == "test"]
    assert test["examples"] == len(examples) == 20, f"expected 20 examples that ran, logged {examples}, got {test}"
    assert test["impl"] == "my-kernel" and test["wall"] == 2.0 and test["jit"] is None, test
    assert "failure" not in test, f"a passed test's record carries no failure, got {test}"
    row = next(line for line in timing.table(plugin.rows) if line.endswith(item.nodeid))
    assert row.split()[:7] == ["2.0", "-", "0", "-", "-", "20", "10.00"], f"expected 2.0 s and 20 examples, got {row!r}"
    assert prop.hypothesis.inner_test is original, "expected the test's own inner_test back after the call"


def test_triton_compile_hooks_are_timed_and_chained(monkeypatch):
    seen = []
    runtime = types.SimpleNamespace(jit_cache_hook=lambda **kw: seen.append("cache") or "skip?",
                                    jit_post_compile_hook=lambda **kw: seen.append("post"))
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))
    clock = timing.Clock()
    clock.hook_triton()
    assert runtime.jit_cache_hook(key=1) == "skip?", "the earlier hook's answer must be passed on"
    runtime.jit_post_compile_hook(key=1)
    runtime.jit_post_compile_hook(key=2)  # a post hook with no start (an inductor kernel): not counted
    assert seen == ["cache", "post", "post"] and clock.jit_n == 1 and clock.jit_s >= 0, (seen, clock.jit_n)


def test_compiles_in_several_threads_at_once_count_their_overlap_once(monkeypatch):
    import threading
    import time

    runtime = types.SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))
    clock = timing.Clock()
    clock.hook_triton()
    started, release = threading.Barrier(3), threading.Event()

    def compile_in_thread():
        runtime.jit_cache_hook(key=threading.get_ident())
        started.wait()
        release.wait()
        runtime.jit_post_compile_hook(key=threading.get_ident())

    threads = [threading.Thread(target=compile_in_thread) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    started.wait()  # both compiles are running now
    time.sleep(0.2)
    release.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert clock.jit_n == 2, f"expected two compiles counted, got {clock.jit_n}"
    assert 0.2 <= clock.jit_s <= wall, f"expected the compiles' common 0.2-{wall:.2f} s once, got {clock.jit_s:.3f} s"


def test_a_malformed_switch_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv(timing.ENV, "on")
    with pytest.raises(pytest.UsageError, match=timing.ENV):
        timing.register(None, "gpu")


def test_jax_compile_events_are_summed(monkeypatch):
    listeners = []
    monitoring = types.SimpleNamespace(register_event_duration_secs_listener=listeners.append)
    jax = types.SimpleNamespace(monitoring=monitoring)
    monkeypatch.setitem(sys.modules, "jax", jax)
    clock = timing.Clock()
    clock.hook()
    clock.hook()  # once per process
    assert len(listeners) == 1
    listeners[0]("/jax/core/compile/backend_compile_duration", 1.5)
    listeners[0]("/jax/core/compile/jaxpr_trace_duration", 0.25, fun_name="f")
    listeners[0]("/jax/dispatch/other_duration", 9.0)  # not a compile
    assert clock.jax_s == 1.75 and clock.now()[3] == 1.75, clock.jax_s


@pytest.mark.parametrize("workers, preset, worker, expected", [
    ("8", None, True, "share"), ("8", "3", True, "kept"), ("8", None, False, "kept"), ("1", None, True, "kept")])
def test_an_xdist_worker_takes_its_share_of_the_cores_unless_threads_were_set(monkeypatch, workers, preset, worker,
                                                                             expected):
    import torch

    from flashcheck import devices

    before = torch.get_num_threads()
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    monkeypatch.setattr(devices, "usable_cores", lambda: 16)
    if preset is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    config = types.SimpleNamespace(getoption=lambda name, default=None: None,
                                   **({"workerinput": {}} if worker else {}))
    try:
        devices.share_cores(config)
        got = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    want = 16 // int(workers) if expected == "share" else before
    assert got == want, f"expected {want} torch threads ({expected}) for {workers} workers, got {got}"


@pytest.mark.parametrize("spawning, preset, expected", [
    (8, None, ("2", "2", "2")), (2, None, ("1", "1", "1")), (1, None, (None, None, None)),
    (8, "OMP_NUM_THREADS", (None, None, "2")),  # BLAS reads OMP_NUM_THREADS too: the user's count stands
    (8, "OPENBLAS_NUM_THREADS", ("5", "2", "2"))])
def test_the_controller_gives_its_workers_a_share_of_the_cores_for_blas_and_compiles(monkeypatch, spawning, preset,
                                                                                     expected):
    from flashcheck import devices

    envs = devices.BLAS_ENVS + (devices.COMPILE_ENV,)  # OpenBLAS, MKL, inductor
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.setattr(devices, "usable_cores", lambda: 16 if spawning == 8 else 2)
    for env in ("OMP_NUM_THREADS",) + envs:
        monkeypatch.delenv(env, raising=False)
    if preset:
        monkeypatch.setenv(preset, "5")
    config = types.SimpleNamespace(getoption=lambda name, default=None: spawning if name == "numprocesses" else None)
    devices.share_cores(config)
    got = tuple(os.environ.get(env) for env in envs)
    assert got == expected, f"expected {envs} = {expected} for {spawning} workers (preset {preset}), got {got}"


def test_the_cores_shared_out_are_those_the_process_may_run_on_not_the_host_s(monkeypatch):
    from flashcheck import devices

    monkeypatch.setattr("os.cpu_count", lambda: 64)  # a container on a big host, pinned to two cores
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 5}, raising=False)
    assert devices.usable_cores() == 2, f"expected the 2 cores of the affinity, got {devices.usable_cores()}"


def test_an_earlier_runs_log_orders_the_tests_longest_first(tmp_path, monkeypatch):
    """Unknown tests first, then by the logged wall time; input validation stays last; cut-off lines skipped."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)  # one process: no dealing
    log = tmp_path / "last-night.jsonl"
    rows = [dict(kind="test", test="t::short", wall=1.0), dict(kind="example", test="t::long"),
            dict(kind="test", test="t::long", wall=90.0), dict(kind="test", test="t::refusal", wall=500.0)]
    log.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"kind": "test", "te')

    def item(nodeid, validation=False):
        return types.SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: validation or None)

    items = [item("t::short"), item("t::refusal", True), item("t::long"), item("t::new")]
    timing.longest_first(items, str(log))
    assert [it.nodeid for it in items] == ["t::new", "t::long", "t::short", "t::refusal"], [it.nodeid for it in items]
    with pytest.raises(pytest.UsageError, match="cannot read that timing log"):
        timing.longest_first(items, str(tmp_path / "missing.jsonl"))


def test_under_xdist_the_longest_tests_are_dealt_one_to_each_worker(tmp_path, monkeypatch):
    """Each of the 3 workers' contiguous share of the queue starts with one of the 3 longest tests."""
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(dict(kind="test", test=f"t::{w}", wall=float(w))) for w in range(9)))
    items = [types.SimpleNamespace(nodeid=f"t::{w}", get_closest_marker=lambda name: None) for w in range(9)]
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    timing.longest_first(items, str(log))
    shares = [[int(it.nodeid[3:]) for it in items[i:i + 3]] for i in (0, 3, 6)]
    assert [run[0] for run in shares] == [8, 7, 6], f"expected each run to start with one of the longest, got {shares}"
    assert max(map(sum, shares)) - min(map(sum, shares)) <= 2, f"expected balanced runs, got {shares}"


def test_one_kernels_long_tests_stay_on_as_few_workers_as_their_time_allows():
    """Two kernels of four 10 s tests each on two workers: each kernel on one worker (dealt, both would
    compile everything twice), and the short tests fill the runs to xdist's equal counts."""
    def item(kernel, n):
        return types.SimpleNamespace(nodeid=f"t::{kernel}{n}", kernel=kernel)

    ordered = [item(k, n) for n in range(4) for k in "ab"] + [item(None, n) for n in range(4)]
    wall = {it.nodeid: 10.0 if it.kernel else 0.1 for it in ordered}
    out = timing.by_worker(ordered, wall, 2, kernel=lambda it: it.kernel)
    runs = [[it.kernel for it in out[:6]], [it.kernel for it in out[6:]]]
    assert runs == [list("aaaa") + [None] * 2, list("bbbb") + [None] * 2], f"expected a kernel per worker, got {runs}"
    three = timing.by_worker(ordered, wall, 3, kernel=lambda it: it.kernel)
    assert sorted(len({it.kernel for it in three[i:i + 4]} - {None}) for i in (0, 4, 8)) == [1, 1, 2], \
        f"expected one kernel split, the other whole, got {[[it.kernel for it in three[i:i + 4]] for i in (0, 4, 8)]}"


def test_a_run_given_a_log_runs_its_longest_test_first(tmp_path):
    """The plugin applies it to a real collection (FLASHCHECK_ORDER_BY), in a pytest of its own."""
    import os
    import subprocess

    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(dict(kind="test", test=f"test_order.py::test_{n}", wall=w))
                             for n, w in (("a", 1.0), ("b", 30.0), ("c", 5.0))))
    (tmp_path / "test_order.py").write_text("def test_a(): pass\ndef test_b(): pass\ndef test_c(): pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHCHECK_IMPL", "PYTEST_XDIST_WORKER_COUNT")} | {
        timing.ORDER_ENV: str(log)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "test_order.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    ran = [line.split("::")[1].split()[0] for line in run.stdout.splitlines() if line.startswith("test_order.py::")]
    assert ran == ["test_b", "test_c", "test_a"], f"expected the longest first, ran {ran}\n{run.stdout[-2000:]}"


@pytest.mark.parametrize("profile, given, expected", [
    ("gpu", None, timing.LANE_WALLS), ("gpu-scale", None, timing.LANE_WALLS),  # no log: the last lane's walls
    ("gpu", "mine.jsonl", "mine.jsonl"), (None, "mine.jsonl", "mine.jsonl"),  # a log given: in any profile
    ("gpu", "0", None), ("ci", None, None), ("default", None, None)])  # 0: pytest's order; CPU profiles keep it
def test_a_gpu_run_without_a_log_of_its_own_orders_by_the_last_lanes_walls(profile, given, expected, monkeypatch):
    monkeypatch.delenv(timing.ORDER_ENV, raising=False)
    if given is not None:
        monkeypatch.setenv(timing.ORDER_ENV, given)
    got = timing.order_log(profile)
    want = None if expected is None else str(expected)
    assert got == want, f"expected {want} for profile {profile}, FLASHCHECK_ORDER_BY {given}; got {got}"


def test_the_shipped_lane_walls_name_tests_and_built_ins_that_exist():
    """A renamed property or built-in would silently fall out of the default order: every line of
    LANE_WALLS must name a test function that exists, and a property's a built-in."""
    import ast

    from flashcheck.impls import builtin

    root = timing.LANE_WALLS.parent.parent
    names = set(builtin.NAMES) | set(builtin.UNAVAILABLE)  # jax's, where jax is not installed
    records = [json.loads(line) for line in timing.LANE_WALLS.read_text().splitlines()]
    assert len(records) > 400 and all(r["kind"] == "test" and r["wall"] >= 0 for r in records)
    functions = {}
    for r in records:
        path, rest = r["test"].split("::")
        func, _, impl = rest.rstrip("]").partition("[")
        if path not in functions:
            tree = ast.parse((root / path).read_text())
            functions[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in functions[path], f"{r['test']}: no {func} in {path}"
        assert not path.startswith("properties/") or any(impl == n or impl.startswith(n + "-") for n in names), (
            f"{r['test']}: no built-in {impl}")


@pytest.mark.parametrize("profile, args, dist, expected", [
    ("gpu", ("-n", "8"), "load", "worksteal"),  # xdist's default under -n
    ("gpu", ("-n", "8", "--dist", "load"), "load", "load"),  # asked for: kept
    ("gpu", ("-n", "8", "--dist=loadgroup"), "loadgroup", "loadgroup"),
    ("ci", ("-n", "2"), "load", "load"),  # CPU profiles: as xdist would
    ("gpu", (), "no", "no"),  # no workers
])
def test_the_gpu_profile_lets_idle_workers_steal_queued_tests(profile, args, dist, expected, monkeypatch):
    from flashcheck import devices

    pytest.importorskip("xdist")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    config = types.SimpleNamespace(option=types.SimpleNamespace(dist=dist),
                                   invocation_params=types.SimpleNamespace(args=args))
    devices.steal_work(config, profile)
    assert config.option.dist == expected, f"expected --dist {expected} for {profile} {args}, got {config.option.dist}"
