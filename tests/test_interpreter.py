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


def _tuned(prune=None):
    """A copy kernel autotuned over three tile sizes, keyed on its length."""
    configs = [triton.Config({"BLOCK": b}) for b in (16, 32, 64)]
    kw = {"prune_configs_by": {"early_config_prune": prune}} if prune else {}

    @triton.autotune(configs=configs, key=["n"], **kw)
    @triton.jit
    def double(X, Y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + i, tl.load(X + i, mask=i < n) * 2.0, mask=i < n)

    def run(n):
        x, y = torch.arange(float(n)), torch.full((n,), float("nan"))
        double[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
        assert torch.equal(y, 2 * x), f"expected the doubled input for n = {n}, got {y[:5]}"
        return double.best_config.kwargs["BLOCK"]

    return double, run


def test_an_autotuned_kernel_runs_in_the_interpreter_with_one_tile_per_key_and_every_tile_reached():
    assert interpreter.pick_autotuned_configs() and interpreter.pick_autotuned_configs(), \
        "expected the pick installed, and idempotent"
    double, run = _tuned()
    picked = {n: run(n) for n in range(1, 41)}
    assert set(picked.values()) == {16, 32, 64}, f"expected 40 keys to reach all three tiles, got {picked}"
    double.cache.clear()  # a new process: the same keys pick the same tiles
    again = {n: run(n) for n in picked}
    assert again == picked, f"expected each key's tile to be a function of the key, got {picked} then {again}"


def test_the_pick_keeps_to_the_tiles_that_the_kernels_own_pruning_leaves():
    interpreter.pick_autotuned_configs()
    _, run = _tuned(prune=lambda configs, nargs, **kw: [c for c in configs if c.kwargs["BLOCK"] != 32])
    picked = {run(n) for n in range(1, 41)}
    assert picked == {16, 64}, f"expected only the tiles the pruning keeps (16, 64), got {sorted(picked)}"
