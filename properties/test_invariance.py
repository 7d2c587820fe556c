"""Transformations that must not change attention, and results that must not depend on tiling."""
import numpy as np
import pytest
from hypothesis import assume, example, given, note
from hypothesis import strategies as st

from flashcheck import oracle as orc
from flashcheck.merge import merge_attention_states
from flashcheck import strategies as fs
from flashcheck.contract import call
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import buckets

pytestmark = pytest.mark.properties

seeds = st.integers(0, 2**16)
blocks = fs.draw.tilings()


@pytest.mark.requires("non_causal")
@given(case=fs.cases(causal="none"), perm_seed=seeds)
@ph.every_dtype_and_regime(causal=False, perm_seed=0)
@example(case=Case(sk=3, block_k=2), perm_seed=0)
def test_permuting_keys_and_values_together_leaves_output_unchanged(impl, case, perm_seed):
    if ph.slow_pin(impl, case):
        return
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    perm = np.random.default_rng(perm_seed).permutation(case.sk)
    note(f"permutation: {perm.tolist()}")
    base = ph.forward(impl, case).o
    moved = ph.forward(impl, case, k=k[:, :, perm], v=v[:, :, perm]).o
    budget = orc.allowed(case, "o")
    orc.compare(case, "o", moved, want=base, budget=2 * budget, who=f"{impl.name} (keys permuted)")


@given(case=fs.cases(), shift_seed=seeds, size=st.sampled_from((1.0, 4.0, 16.0)))
@ph.every_dtype_and_regime(shift_seed=0, size=4.0)
@example(case=Case(sq=2, sk=3, d=2, dtype="float32"), shift_seed=0, size=16.0)
def test_adding_one_vector_to_every_key_leaves_output_unchanged(impl, case, shift_seed, size):
    """q.(k + c) = q.k + q.c shifts a whole row of logits, which softmax ignores."""
    if ph.slow_pin(impl, case):
        return
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    c = size * np.random.default_rng(shift_seed).standard_normal(case.d)
    shifted = fs.quantize(k + c, case.dtype)  # rounding k + c moves the truth a little: budget it
    drift = np.abs(orc.dense64(case, q, shifted, v) - orc.dense64(case, q, k, v)).max()
    note(f"shift {c.tolist()}, float64 drift from rounding {drift:.3e}")
    base = ph.forward(impl, case).o
    moved = ph.forward(impl, case, k=shifted).o
    budget = orc.allowed(case, "o")
    # The shift adds q.c to every logit: the kernel's float32 scores carry that much more rounding.
    vv = ph.kv_heads(case, v)
    extra = 2 * np.sqrt(case.d) * fs.EPS["float32"] * abs(case.effective_scale) * np.abs(q @ c).max(initial=0) \
        * np.abs(vv).max(initial=0)
    orc.compare(case, "o", moved, want=base, budget=4 * budget + drift + extra, who=f"{impl.name} (keys shifted)")


@given(case=fs.cases(), pick=seeds)
@ph.every_dtype_and_regime(pick=1)
@example(case=Case(batch=2, hq=4, hkv=2, sq=3, sk=3), pick=1)
def test_batch_and_head_slices_alone_equal_the_batched_result(impl, case, pick):
    if ph.slow_pin(impl, case):
        return
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    full = ph.forward(impl, case).o
    budget = orc.allowed(case, "o")
    b, h = pick % case.batch, (pick // 7) % case.hkv
    g = case.hq // case.hkv
    assume(fs.draw.runs_as_is(impl, case.replace(batch=1, hq=g, hkv=1)))
    heads = slice(h * g, (h + 1) * g)
    one = ph.forward(impl, case, q=q[b:b + 1, heads], k=k[b:b + 1, h:h + 1], v=v[b:b + 1, h:h + 1]).o
    orc.compare(case, "o", one, want=full[b:b + 1, heads], budget=2 * budget[b:b + 1, heads],
                who=f"{impl.name} (batch {b}, kv head {h} alone)")


@pytest.mark.requires("lse", "non_causal")
@given(case=fs.cases(causal="none"), cuts=st.lists(seeds, min_size=1, max_size=4))
@ph.every_dtype_and_regime(causal=False, cuts=[0])
@example(case=Case(sk=2), cuts=[0])
@example(case=Case(sk=5), cuts=[0, 0, 0, 0])  # five chunks of one key: a split-KV kernel's many splits
def test_keys_split_into_chunks_merged_by_lse_equal_the_whole(impl, case, cuts):
    if ph.slow_pin(impl, case):
        return
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    # every chunk a length the implementation declares it runs
    bounds = buckets.key_chunks(case.sk, cuts, lambda n: fs.draw.runs_as_is(impl, case.replace(sk=n)))
    assume(bounds)
    o = lse = None
    for start, stop in bounds:
        part = ph.forward(impl, case, k=k[:, :, start:stop], v=v[:, :, start:stop])
        o, lse = (part.o, part.lse) if o is None else merge_attention_states(o, lse, part.o, part.lse)
    chunks = [stop - start for start, stop in bounds]
    note(f"keys split into chunks of {chunks}")
    who = f"{impl.name} ({len(chunks)} chunks of {chunks} merged)"
    # each chunk's result carries its own rounding, at most one bound's worth per chunk
    orc.compare(case, "o", o, budget=len(chunks) * orc.allowed(case, "o"), who=who)
    orc.compare(case, "lse", lse, budget=len(chunks) * orc.allowed(case, "lse"), who=who)


@pytest.mark.requires("blocks")
@given(case=fs.cases(), other=blocks)
@ph.every_dtype_and_regime(other=(1, 1))
@example(case=Case(sq=5, sk=7, causal="bottom_right"), other=(1, 1))
def test_results_do_not_depend_on_block_sizes(impl, case, other):
    if ph.slow_pin(impl, case):
        return
    other = fs.draw.second_tiling(case, other)
    case = fs.fit(impl, case)
    case2 = fs.fit(impl, case.replace(block_q=other[0], block_k=other[1]))
    note(f"second blocks: {case2.block_q} x {case2.block_k}")
    names = ph.RESULTS if impl.has_backward else ("o", "lse")
    run = ph.backward if impl.has_backward else ph.forward
    r1, r2 = run(impl, case), run(impl, case2)
    for name in names:
        x, y = getattr(r1, name), getattr(r2, name)
        if x is not None:
            orc.compare(case, name, y, want=x, budget=2 * orc.allowed(case, name),
                        who=f"{impl.name} ({case2.block_q}x{case2.block_k} vs {case.block_q}x{case.block_k})")


@given(case=fs.cases(), path=st.sampled_from(tuple(call.PATHS)))
@ph.every_dtype_and_regime(path="autograd")
@example(case=Case(sq=3, sk=5, d=2, dv=2), path="plain")  # each way a kernel is called, in every run
@example(case=Case(sq=3, sk=5, d=2, dv=2), path="no_grad")
@example(case=Case(sq=3, sk=5, d=2, dv=2), path="inference_mode")
def test_inputs_are_never_modified(impl, case, path):
    """On the training path and every inference path: a kernel may branch on requires_grad."""
    if ph.slow_pin(impl, case):
        return
    case = fs.fit(impl, case)
    if path == "autograd" and not impl.has_backward:
        path = "plain"
    q, k, v, do = case.inputs()
    if impl.framework == "numpy":  # one way to call it
        path, do = None, do if impl.has_backward else None
    res = call.run(impl, case, q, k, v, do if path == "autograd" else None, path=path) if path else \
        call.run(impl, case, q, k, v, do)
    how = f" when called {call.PATHS[path]}" if path else ""
    for name, before, after in zip("qkv", case.inputs(), res.inputs_after):  # inputs() is a fresh copy
        assert np.array_equal(before, after), f"{impl.name} modified its input {name}{how}\n  case: {case!r}"


@pytest.mark.requires("deterministic")
@given(case=fs.cases())
@ph.every_dtype_and_regime()
@example(case=Case(hq=4, hkv=2, sq=17, sk=33, d=16, dv=16, block_q=16, block_k=16))  # several tiles, GQA
def test_repeated_calls_on_one_input_are_bitwise_identical(impl, case):
    case = fs.fit(impl, case)
    lines = call.repeat_differences(impl, case)
    assert not lines, (f"{impl.name} declares deterministic=True, but two calls on the same input differ "
                       f"(a race or nondeterminism):\n  " + "\n  ".join(lines) + f"\n  case: {case!r}")
