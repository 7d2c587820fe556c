"""flashcheck/impls/interpreter.py: Triton's interpreter without its swap of triton.language on every
helper call, with the same results."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashcheck.impls import interpreter  # noqa: E402
from flashcheck.impls import triton_fused as tf  # noqa: E402

pytestmark = pytest.mark.skipif(not tf.INTERPRET, reason="needs TRITON_INTERPRET=1 set before triton is imported")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as ti  # noqa: E402


@triton.jit
def _doubled(x):
    return x * 2.0


@triton.jit
def _sum_of_doubled_tiles(X, OUT, TILES, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for t in range(0, TILES):  # a helper and tl's own jit functions in every tile, as our kernels do
        acc += _doubled(tl.load(X + t * BLOCK + tl.arange(0, BLOCK)))
    tl.store(OUT, tl.sum(acc, 0))


def _swaps(monkeypatch, tiles):
    """(result, how often the interpreter walked a module to swap its builtins) for one launch."""
    walks = []
    original = ti._patch_builtin
    monkeypatch.setattr(ti, "_patch_builtin", lambda *a: walks.append(1) or original(*a))
    x, out = torch.arange(16.0 * tiles), torch.zeros(1)
    _sum_of_doubled_tiles[(1,)](x, out, tiles, BLOCK=16)
    return out.item(), len(walks)


def test_the_interpreter_swaps_triton_language_once_per_launch_not_once_per_helper_call(monkeypatch):
    assert interpreter.quicken() and interpreter.quicken(), "expected quicken installed, and idempotent"
    _swaps(monkeypatch, 1)  # the first launch rewrites each jit function, in its own order of calls
    few, few_walks = _swaps(monkeypatch, 5)
    many, many_walks = _swaps(monkeypatch, 40)
    assert (few, many) == (2.0 * sum(range(80)), 2.0 * sum(range(640))), f"wrong sums: {few}, {many}"
    assert few_walks == many_walks, (f"expected the same swaps for 5 and 40 tiles of helper calls, got "
                                     f"{few_walks} and {many_walks}")


def test_a_quickened_interpreter_gives_the_kernels_results_bit_for_bit(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    fast = tf.attention(q, k, v, causal=True)
    monkeypatch.setattr(ti, "_patch_lang", ti._patch_lang.original)
    monkeypatch.setattr(ti.GridExecutor, "__call__", ti.GridExecutor.__call__.original)
    slow = tf.attention(q, k, v, causal=True)
    for name, a, b in zip(("O", "LSE"), fast, slow):
        assert np.array_equal(a.numpy(), b.numpy()), f"{name} differs between the quickened and the plain interpreter"
