"""Transformations that must not change attention, and results that must not depend on tiling."""
import numpy as np
import pytest
from hypothesis import assume, example, given, note
from hypothesis import strategies as st

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.impls import call
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties

seeds = st.integers(0, 2**16)
blocks = st.tuples(st.integers(1, 8) | st.sampled_from((16, 32, 64)), st.integers(1, 8) | st.sampled_from((16, 32, 64)))


@given(case=fs.cases(causal="none"), perm_seed=seeds)
@example(case=Case(sk=3, block_k=2), perm_seed=0)
def test_permuting_keys_and_values_together_leaves_output_unchanged(impl, case, perm_seed):
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    perm = np.random.default_rng(perm_seed).permutation(case.sk)
    note(f"permutation: {perm.tolist()}")
    base = ph.forward(impl, case).o
    moved = ph.forward(impl, case, k=k[:, :, perm], v=v[:, :, perm]).o
    budget, _ = orc.allowed(case, "o")
    orc.compare(case, "o", moved, want=base, budget=2 * budget, who=f"{impl.name} (keys permuted)")


@given(case=fs.cases(), shift_seed=seeds, size=st.sampled_from((1.0, 4.0, 16.0)))
@example(case=Case(sq=2, sk=3, d=2, dtype="float32"), shift_seed=0, size=16.0)
def test_adding_one_vector_to_every_key_leaves_output_unchanged(impl, case, shift_seed, size):
    """q.(k + c) = q.k + q.c shifts a whole row of logits, which softmax ignores."""
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    c = size * np.random.default_rng(shift_seed).standard_normal(case.d)
    shifted = fs.quantize(k + c, case.dtype)  # rounding k + c moves the truth a little: budget it
    drift = np.abs(orc.dense64(case, q, shifted, v) - orc.dense64(case, q, k, v)).max()
    note(f"shift {c.tolist()}, float64 drift from rounding {drift:.3e}")
    base = ph.forward(impl, case).o
    moved = ph.forward(impl, case, k=shifted).o
    budget, _ = orc.allowed(case, "o")
    orc.compare(case, "o", moved, want=base, budget=4 * budget + drift, who=f"{impl.name} (keys shifted)")


@given(case=fs.cases(), pick=seeds)
@example(case=Case(batch=2, hq=4, hkv=2, sq=3, sk=3), pick=1)
def test_batch_and_head_slices_alone_equal_the_batched_result(impl, case, pick):
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    full = ph.forward(impl, case).o
    budget, _ = orc.allowed(case, "o")
    b, h = pick % case.batch, (pick // 7) % case.hkv
    g = case.hq // case.hkv
    heads = slice(h * g, (h + 1) * g)
    one = ph.forward(impl, case, q=q[b:b + 1, heads], k=k[b:b + 1, h:h + 1], v=v[b:b + 1, h:h + 1]).o
    orc.compare(case, "o", one, want=full[b:b + 1, heads], budget=2 * budget,
                who=f"{impl.name} (batch {b}, kv head {h} alone)")


@pytest.mark.requires("lse")
@given(case=fs.cases(causal="none"), cut=seeds)
@example(case=Case(sk=2), cut=0)
def test_two_halves_of_the_keys_merged_by_lse_equal_the_whole(impl, case, cut):
    case = fs.fit(impl, case)
    assume(case.sk >= 2)
    s = 1 + cut % (case.sk - 1)
    note(f"keys split at {s}")
    q, k, v, _ = case.inputs()
    a = ph.forward(impl, case, k=k[:, :, :s], v=v[:, :, :s])
    b = ph.forward(impl, case, k=k[:, :, s:], v=v[:, :, s:])
    lse = np.logaddexp(a.lse, b.lse)
    o = np.exp(a.lse - lse)[..., None] * a.o + np.exp(b.lse - lse)[..., None] * b.o
    budget, _ = orc.allowed(case, "o")
    orc.compare(case, "o", o, budget=2 * budget, who=f"{impl.name} (merged halves)")
    orc.compare(case, "lse", lse, budget=2 * orc.allowed(case, "lse")[0], who=f"{impl.name} (merged halves)")


@pytest.mark.requires("blocks")
@given(case=fs.cases(), other=blocks)
@example(case=Case(sq=5, sk=7, causal="bottom_right"), other=(1, 1))
def test_results_do_not_depend_on_block_sizes(impl, case, other):
    case = fs.fit(impl, case)
    case2 = fs.fit(impl, case.replace(block_q=other[0], block_k=other[1]))
    note(f"second blocks: {case2.block_q} x {case2.block_k}")
    names = ph.RESULTS if impl.has_backward else ("o", "lse")
    run = ph.backward if impl.has_backward else ph.forward
    r1, r2 = run(impl, case), run(impl, case2)
    for name in names:
        x, y = getattr(r1, name), getattr(r2, name)
        if x is not None:
            orc.compare(case, name, y, want=x, budget=2 * orc.allowed(case, name)[0],
                        who=f"{impl.name} ({case2.block_q}x{case2.block_k} vs {case.block_q}x{case.block_k})")


@given(case=fs.cases())
def test_inputs_are_never_modified(impl, case):
    case = fs.fit(impl, case)
    q, k, v, do = case.inputs()
    res = call.run(impl, case, q, k, v, do if impl.has_backward else None)
    for name, before, after in zip("qkv", (q, k, v), res.inputs_after):
        assert np.array_equal(before, after), f"{impl.name} modified its input {name}\n  case: {case!r}"
