"""Compiles ahead of launches (impls/triton_warm.py): once per key, all at once, errors left to the launch."""
import threading

import pytest

from flashcheck.impls import triton_warm as warm

pytestmark = pytest.mark.properties


class _Kernel:
    """Records its warmups; the first ``fail`` of them raise."""

    def __init__(self, fail=0):
        self.calls, self.fail, self.threads = [], fail, set()

    def warmup(self, *args, grid, **kwargs):
        self.threads.add(threading.get_ident())
        self.calls.append((args, grid, kwargs))
        if len(self.calls) <= self.fail:
            raise RuntimeError("out of resources")


@pytest.fixture(autouse=True)
def _no_cuda_device(monkeypatch):
    monkeypatch.setattr(warm.torch.cuda, "device", lambda device: threading.Lock())  # a context that does nothing


def test_a_keys_launches_compile_once_with_the_launches_own_blocks_warps_and_stages():
    a, b = _Kernel(), _Kernel()
    launches = lambda: [(a, lambda bm, bn: (bm, 1, 1), [64, None, 4, 3], (1, 2), dict(X=1)),  # noqa: E731
                        (b, lambda bm, bn: (bm, bn, 1), [32, 128, 8, 2], (3,), {})]
    warm.wait(warm.ahead(("test-key", 1), launches, "cuda:0"))
    assert warm.ahead(("test-key", 1), launches, "cuda:0") == [], "a key seen before must start nothing"
    assert a.calls == [((1, 2), (64, 1, 1), dict(num_warps=4, num_stages=3, BLOCK_M=64, X=1))], a.calls
    assert b.calls == [((3,), (32, 128, 1), dict(num_warps=8, num_stages=2, BLOCK_M=32, BLOCK_N=128))], b.calls


def test_a_compile_that_fails_ahead_is_left_to_the_launch():
    bad = _Kernel(fail=1)
    futures = warm.ahead(("test-key", 2), lambda: [(bad, lambda bm, bn: (1,), [16, 16, 4, 1], (), {})], "cuda:0")
    warm.wait(futures)  # does not raise
    assert len(bad.calls) == 1 and futures[0].exception() is not None


def test_compiles_run_in_threads_of_their_own():
    kernels = [_Kernel() for _ in range(3)]
    launches = lambda: [(k, lambda bm, bn: (1,), [16, 16, 4, 1], (), {}) for k in kernels]  # noqa: E731
    warm.wait(warm.ahead(("test-key", 3), launches, "cuda:0"))
    assert all(k.calls for k in kernels)
    assert threading.get_ident() not in set().union(*(k.threads for k in kernels)), "compiled on the caller's thread"


def _a_kernel(x):
    return x + 1


def test_tritons_parse_takes_a_lock_once_compiles_run_in_threads():
    """Python < 3.13 raises SystemError when two threads construct an AST at once: Triton parses a
    kernel's source on every compile, so the threads must take turns there."""
    triton_jit = pytest.importorskip("triton.runtime.jit")
    kernel = triton_jit.JITFunction(_a_kernel)  # not triton.jit: under TRITON_INTERPRET=1 that parses nothing
    warm.wait(warm.ahead(("test-key", 4), lambda: [(_Kernel(), lambda bm, bn: (1,), [16, 16, 4, 1], (), {})],
                         "cuda:0"))
    assert getattr(triton_jit.JITFunction.parse, "serialized", False), "JITFunction.parse is not wrapped"
    done = threading.Event()
    with warm.PARSE_LOCK:
        t = threading.Thread(target=lambda: (kernel.parse(), done.set()))
        t.start()
        assert not done.wait(0.3), "a thread parsed a kernel while another held the parse lock"
    t.join(10)
    assert done.is_set(), "the parse did not finish once the lock was free"
    assert warm.serialize_parse() and triton_jit.JITFunction.parse.serialized, "wrapped twice, or unwrapped"


class _Blocking(_Kernel):
    """A compile that lasts until ``release`` is set."""

    def __init__(self, release):
        super().__init__()
        self.release, self.started = release, threading.Event()

    def warmup(self, *args, grid, **kwargs):
        self.started.set()
        self.release.wait(30)
        super().warmup(*args, grid=grid, **kwargs)


def test_a_call_takes_over_its_compile_queued_behind_the_background_queue():
    release = threading.Event()
    busy = [_Blocking(release) for _ in range(warm.BACKGROUND_THREADS)]
    for i, kernel in enumerate(busy):  # every background thread busy
        warm.ahead(("test-key", 5, i), lambda k=kernel: [(k, lambda bm, bn: (1,), [16, 16, 4, 1], (), {})], "cuda:0",
                   background=True)
    mine = _Kernel()
    queued = warm.ahead(("test-key", 6), lambda: [(mine, lambda bm, bn: (1,), [16, 16, 4, 1], (), {})], "cuda:0",
                        background=True)
    try:
        assert all(k.started.wait(10) for k in busy), "the background threads did not start"
        assert not mine.calls and not queued[0].done(), "expected the compile still queued"
        claimed = warm.claim(("test-key", 6))
        done, _ = warm.concurrent.futures.wait(claimed, timeout=10)
        assert done and mine.calls, "a claimed compile waited behind the background queue"
        assert queued[0].cancelled(), "expected the queued compile taken out of the background queue"
        assert len(mine.calls) == 1, f"compiled {len(mine.calls)} times"
    finally:
        release.set()
    assert warm.claim(("test-key", 7)) == [], "a key nobody queued has nothing to wait for"


def test_the_background_queue_does_not_hold_the_process_at_exit(tmp_path):
    """Thirty queued compiles of a second each: the process ends after the running ones, not all."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "queued_compiles.py"  # not queue.py: that would shadow the module
    script.write_text(
        "import time, threading\n"
        "import flashcheck\n"
        "from flashcheck.impls import triton_warm as warm\n"
        "warm.serialize_parse = lambda: True\n"
        "warm.torch.cuda.device = lambda device: threading.Lock()\n"
        "class K:\n"
        "    def warmup(self, *a, **k): time.sleep(1)\n"
        "for i in range(30):\n"
        "    warm.ahead(('k', i), lambda: [(K(), lambda bm, bn: (1,), [16, 16, 4, 1], (), {})], 'cuda:0', "
        "background=True)\n")
    start = time.perf_counter()
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's flashcheck, installed or not
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    subprocess.run([sys.executable, str(script)], check=True, timeout=60, env=env)
    took = time.perf_counter() - start
    assert took < 10, f"expected the queue dropped at exit (a few seconds), the process took {took:.0f} s"
