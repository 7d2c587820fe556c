"""bench/gpu_lane_speed.py's speed-up over several nights: pooled examples over pooled seconds."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("gpu_lane_speed", Path(__file__).parent.parent / "bench" / "gpu_lane_speed.py")
speed = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(speed)


def night(then, now):
    return {("triton-fused", "then"): dict(zip(("examples", "seconds", "span"), then)),
            ("triton-fused", "now"): dict(zip(("examples", "seconds", "span"), now))}


def test_the_speed_up_over_nights_pools_examples_and_seconds_not_ratios():
    # per busy second the two nights give 4x and 2x, whose mean is 3x; pooled: (500 / 300) / (200 / 400)
    lines = speed.overall([night((100, 100, 200), (400, 100, 200)), night((100, 100, 200), (100, 100, 100))])
    assert len(lines) == 1, f"expected one line for triton-fused against then, got {lines}"
    assert "now 2.5x the examples per second of then" in lines[0], f"expected 500 / 200 = 2.5x, got {lines[0]!r}"
    assert "(3.3x per second busy" in lines[0], f"expected (500 / 300) / (200 / 400) = 3.3x, got {lines[0]!r}"
    assert "500 examples against 200" in lines[0], lines[0]


def test_a_single_pair_gives_no_speed_up():
    lines = speed.overall([{("triton-fused", "now"): dict(examples=5, seconds=1.0, span=2.0)}])
    assert lines == [], f"expected nothing without a baseline arm, got {lines}"


def test_the_share_plugin_runs_each_test_in_one_process_only(tmp_path):
    """The arm's processes both collect every test; the one that claims a test first runs it, the other skips it."""
    (tmp_path / "flashcheck_bench_share.py").write_text(speed.SHARE)
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    (tmp_path / "claims").mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path), FLASHCHECK_BENCH_CLAIMS=str(tmp_path / "claims"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:flashcheck.plugin",
           "-p", "flashcheck_bench_share", "-rs", "test_two.py"]
    first, second = (subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True) for _ in range(2))
    assert "2 passed" in first.stdout, f"expected the first process to run both tests, got:\n{first.stdout}"
    assert "2 skipped" in second.stdout and "the arm's other process runs this test" in second.stdout, (
        f"expected the second process to skip both claimed tests, got:\n{second.stdout}")


def test_the_matched_speed_up_compares_rates_on_the_tests_both_arms_ran():
    # then: test a at 1 example/s; now: a at 4 examples/s, and b, which then never reached (left out)
    old = {"per_test": {"test_a[x]": [10, 10.0]}}
    now = {"per_test": {"test_a[x]": [40, 10.0], "test_b[x]": [500, 10.0]}}
    would, took, tests = speed.matched(old, now)
    assert (would, took, tests) == (40.0, 10.0, 1), (
        f"expected the old arm to need 40 s for now's 40 examples of test_a, against 10 s, on 1 test; got "
        f"{would} s, {took} s, {tests} tests")
