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


def _another_kernel(x):
    return x * 2


def test_compile_threads_copy_trees_parsed_in_the_callers_thread(monkeypatch):
    """pytest and Hypothesis parse in the main thread with no lock of ours: a compile thread must not
    build an AST from source at all. The kernel and Triton's own functions are parsed up front."""
    import ast

    triton_jit = pytest.importorskip("triton.runtime.jit")
    standard = pytest.importorskip("triton.language.standard")
    kernel = triton_jit.JITFunction(_another_kernel)
    # Triton's own functions are JIT functions unless TRITON_INTERPRET=1 (as on CPU) makes them interpreted
    fns = [kernel] + [f for f in vars(standard).values() if isinstance(f, triton_jit.JITFunction)][:1]
    assert warm.serialize_parse()
    warm.preparse([kernel])
    want = [ast.dump(f.parse()) for f in fns]
    caller = threading.get_ident()
    parse = ast.parse

    def main_thread_only(*args, **kwargs):
        assert threading.get_ident() == caller, "a compile thread built an AST from source"
        return parse(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", main_thread_only)
    got = []
    t = threading.Thread(target=lambda: got.extend(ast.dump(f.parse()) for f in fns))
    t.start()
    t.join(10)
    assert got == want, "expected copies of the trees parsed up front, got none or others"
    assert kernel.parse() is not kernel.parse(), "expected a fresh copy per parse (a compile may change its tree)"
