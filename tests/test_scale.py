"""The scale region's machinery (strategies/scale.py, properties/test_scale.py) on CPU, at sizes a
CPU runs: heads read back and judged by the sampled oracle, a wrong head named, cases halved to fit."""
import pytest
import torch

from flashcheck.contract import load
from flashcheck.properties import test_scale as prop
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import scale

CASE = Case(batch=40, hq=4, hkv=2, sq=48, sk=40, d=16, dv=16, causal="top_left", dtype="float32")


def run(impl, case, seed=3):
    tensors = prop.device_inputs(torch, case, seed, device="cpu")
    return tensors, prop.run_on(torch, impl, case, tensors, "cpu")


@pytest.mark.parametrize("whole", [True, False], ids=["whole-heads", "sampled-rows"])
def test_sampled_heads_of_a_correct_kernel_pass(whole, monkeypatch):
    monkeypatch.setattr(prop, "WHOLE_HEAD", CASE.sq * CASE.sk if whole else CASE.sq * CASE.sk - 1)
    impl = load("sdpa-math")
    tensors, results = run(impl, CASE)
    prop.judge_heads(impl, CASE, tensors, results, seed=3)


@pytest.mark.parametrize("whole", [True, False], ids=["whole-heads", "sampled-rows"])
def test_heads_of_a_kernel_held_to_the_naive_rule_are_judged_by_it(whole, monkeypatch):
    """SDPA's math and efficient backends on CUDA declare precision="naive" (the scale region's
    first H200 run failed them: the sampled oracle refused that rule)."""
    monkeypatch.setattr(prop, "WHOLE_HEAD", CASE.sq * CASE.sk if whole else CASE.sq * CASE.sk - 1)
    impl, case = load("sdpa-math"), CASE.replace(dtype="float16", precision="naive")
    tensors, results = run(impl, case)
    prop.judge_heads(impl, case, tensors, results, seed=3)
    name = "dv" if whole else "o"
    results[name][0, 0, -1, 1] += 0.5  # the first head and the last row are always judged
    with pytest.raises(AssertionError, match=f" {name} "):
        prop.judge_heads(impl, case, tensors, results, seed=3)


@pytest.mark.parametrize("name, at", [("o", (-1, 0)), ("dq", (-1, 3)), ("dk", (0, 1)), ("dv", (CASE.sk - 1, 2))])
def test_a_wrong_entry_in_a_judged_head_fails_and_the_message_names_the_head(name, at):
    impl = load("sdpa-math")
    tensors, results = run(impl, CASE)
    b, h = prop.heads_to_check(CASE, 3)[-1]
    results[name][b, h // 2 if name in ("dk", "dv") else h][at] += 1e-2  # whole heads: every row and key is judged
    where = f"batch {b}, head {h} of.*kv head {h // 2}" if name in ("dk", "dv") else f"batch {b}, head {h} of"
    with pytest.raises(AssertionError, match=f"(?s){where}.* {name} "):
        prop.judge_heads(impl, CASE, tensors, results, seed=3)


def test_a_head_longer_than_whole_head_is_judged_at_sampled_rows():
    long = CASE.replace(sq=3000, sk=1000)
    rows = prop.rows_judged(long, seed=3)
    assert 0 < len(rows) < long.sq and {0, long.sq - 1} <= set(rows), rows
    assert list(prop.rows_judged(CASE, seed=3)) == list(range(CASE.sq)), "expected a small head judged whole"


def test_heads_to_check_hold_the_first_and_the_last():
    picks = prop.heads_to_check(CASE, 0)
    assert (0, 0) in picks and (CASE.batch - 1, CASE.hq - 1) in picks and len(picks) == prop.HEADS, picks


@pytest.mark.parametrize("target", list(scale.TARGETS))
def test_a_target_that_does_not_fit_is_halved_until_it_does(target):
    case = Case(**scale.TARGETS[target], dtype="float16")
    free = scale.nbytes(case, True) // 5
    small = scale.fitted_to_memory(case, free, True)
    assert scale.nbytes(small, True) <= free, f"expected {small!r} to fit in {free} bytes"
    assert (small.hq, small.d) == (case.hq, case.d), "expected the batch and lengths halved, the heads kept"
    assert scale.fitted_to_memory(case, 10 * scale.nbytes(case, True), True) == case, "a case that fits is kept"


def test_the_targets_pass_the_limits_they_are_named_for():
    grid, elements, long = (Case(**scale.TARGETS[t]) for t in ("grid", "elements", "long"))
    assert grid.batch * grid.hq > 65535
    assert elements.batch * elements.hq * elements.sq * elements.d > 2**31
    assert long.sq == long.sk == 131072


def test_giant_cases_run_at_the_kernels_declared_tiles():
    assert scale.tiles(load("triton-fused")) == load("triton-fused").blocks
    assert scale.tiles(load("torch-tiled")) == (256,), "a kernel that takes any tile runs at 256: 16 would take hours"
    assert scale.tiles(load("sdpa-math")) == (16,)


def test_halving_reaches_the_smallest_case_and_stops():
    case, steps = Case(**scale.TARGETS["long"]), 0
    while (smaller := scale.halved(case)) is not None:
        assert smaller.sq < case.sq or smaller.batch < case.batch, (case, smaller)
        case, steps = smaller, steps + 1
    assert (case.batch, case.sq, case.sk) == (1, 16, 16) and steps == 13, (case, steps)
