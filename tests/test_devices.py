"""Several GPUs (flashcheck/devices.py): which GPU each xdist worker takes, how many workers
-n auto starts, and that a failure names its GPU. A CPU machine checks the logic with
FLASHCHECK_GPUS standing in for the GPUs; docs/gpu-lane.md has the runs on H200s."""
import os
import subprocess
import sys

import pytest

from flashcheck import devices

pytestmark = pytest.mark.properties


def test_workers_take_the_gpus_round_robin():
    got = [devices.gpu_of(f"gw{i}", ["0", "1"]) for i in range(5)]
    assert got == ["0", "1", "0", "1", "0"], f"expected the workers spread evenly over two GPUs, got {got}"
    assert devices.gpu_of("master", ["0"]) is None and devices.gpu_of("gw0", []) is None


def test_the_gpu_list_comes_from_flashcheck_gpus_then_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert devices.gpus() == ["3", "5"]
    monkeypatch.setenv(devices.GPUS_ENV, "GPU-aa, GPU-bb")
    assert devices.gpus() == ["GPU-aa", "GPU-bb"], "FLASHCHECK_GPUS names the GPUs to use, UUIDs included"


def test_workers_per_gpu_default_to_half_the_cores_shared_out_and_can_be_set(monkeypatch):
    monkeypatch.delenv(devices.PER_GPU_ENV, raising=False)
    assert devices.workers_per_gpu(2, cores=32) == 8 and devices.workers_per_gpu(1, cores=16) == 8
    monkeypatch.setenv(devices.PER_GPU_ENV, "3")
    assert devices.workers_per_gpu(2) == 3
    monkeypatch.setenv(devices.PER_GPU_ENV, "none")
    with pytest.raises(ValueError, match="FLASHCHECK_WORKERS_PER_GPU='none'"):
        devices.workers_per_gpu(2)


def test_each_xdist_worker_sees_only_its_own_gpu(tmp_path):
    # each worker writes what it sees once it is configured (the flashcheck plugin configures first)
    (tmp_path / "conftest.py").write_text(
        "import os\n"
        "def pytest_configure(config):\n"
        "    if os.environ.get('PYTEST_XDIST_WORKER'):\n"
        "        with open(os.environ['OUT'], 'a') as f:\n"
        "            f.write(os.environ['PYTEST_XDIST_WORKER'] + '=' + os.environ.get('CUDA_VISIBLE_DEVICES', '-') + '\\n')\n")
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    out = tmp_path / "seen.txt"
    env = {**os.environ, devices.GPUS_ENV: "4,6", "OUT": str(out)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--impl",
                          "numpy-dense", "--allow-skip", "-k", "test_nothing", "test_nothing.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    seen = dict(line.split("=") for line in out.read_text().split())
    assert seen == {"gw0": "4", "gw1": "6"}, f"expected gw0 on GPU 4 and gw1 on GPU 6, got {seen}"


def test_a_failure_names_the_gpu_it_ran_on(monkeypatch):
    from flashcheck import report
    from flashcheck.contract import load
    from flashcheck.strategies import AttentionCase

    monkeypatch.setenv(devices.RAN_ON_ENV, "GPU 6 of 4,6 (xdist worker gw1)")
    failure = report.Failure(load("numpy-dense"), "test_x", AttentionCase(), AssertionError("o: wrong"), "")
    text = failure.render(None)
    assert "ran on GPU 6 of 4,6 (xdist worker gw1)" in text, f"the report does not name the GPU:\n{text}"


def test_a_lost_cuda_context_stops_the_run_with_a_line_that_says_why(monkeypatch):
    class Session:
        shouldstop = False

    class Item:
        nodeid, session = "properties/test_forward.py::test_x[k]", Session()

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(devices, "lost_context", lambda: None)
    devices.stop_if_lost(Item)
    assert Item.session.shouldstop is False, "a healthy context must not stop the run"
    monkeypatch.setattr(devices, "lost_context", lambda: "AcceleratorError: CUDA error: misaligned address")
    devices.stop_if_lost(Item)
    stop = str(Item.session.shouldstop)
    assert "test_x[k]" in stop and "misaligned address" in stop, f"expected the test and the error, got {stop!r}"


def test_a_process_without_cuda_has_no_lost_context():
    assert devices.lost_context() is None, "on a machine without CUDA nothing can be lost"


def test_triton_autotuning_choices_are_cached_on_cuda_unless_the_user_says_otherwise(monkeypatch):
    from flashcheck import plugin

    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plugin._cache_autotuning()
    assert "TRITON_CACHE_AUTOTUNING" not in os.environ, "the interpreter has nothing to time: expected no cache"
    monkeypatch.delenv("TRITON_INTERPRET")
    plugin._cache_autotuning()
    assert os.environ.get("TRITON_CACHE_AUTOTUNING") == "1", \
        f"expected the autotuner's disk cache on, got {os.environ.get('TRITON_CACHE_AUTOTUNING')!r}"
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    plugin._cache_autotuning()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0", "a user's TRITON_CACHE_AUTOTUNING=0 was overridden"
