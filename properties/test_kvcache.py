"""KV caches (kvcache=True): each sequence attends to its own filled positions, and nothing else."""
import numpy as np
import pytest
from hypothesis import example, given, note

from flashcheck import oracle as orc
from flashcheck.contract import cache
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import draw as fs_draw
from flashcheck.strategies import kvcache as fk
from flashcheck.strategies.kvcache import Cached

pytestmark = [pytest.mark.properties, pytest.mark.requires("kvcache")]

BR = "bottom_right"


def every_dtype(test):
    """One cached pin per dtype: an empty sequence, one that fills its pages exactly, a long one."""
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        test = example(c=Cached(Case(sq=2, sk=17, dtype=dtype, causal=BR), (17, 0, 16, 40), spare=1))(test)
    return test


def run(impl, c: Cached):
    return cache.run(impl, c.case, c.call())


def check_sequence(impl, c: Cached, b: int, res, who: str):
    """Sequence b's rows of O and LSE against its own float64 truth; a sequence without keys exactly."""
    s = c.sequence(b)
    label = f"{impl.name} ({who}, sequence {b} of {len(c.lengths)}, {s.sk} keys)"
    for name in ("o", "lse"):
        got = getattr(res, name)
        if got is None:
            continue
        part = got[b:b + 1]
        if s.sk == 0:  # no key: O = 0, LSE = -inf
            want = np.full(part.shape, -np.inf if name == "lse" else 0.0)
            assert np.array_equal(part, want), (f"{label}: {name} of a sequence without keys: expected "
                                                f"{'-inf' if name == 'lse' else 0} everywhere, got {part[part != want][:5]}"
                                                f"\n  cached: {c!r}")
            continue
        orc.compare(s, name, part, who=label)


@given(c=fk.cached_batches())
@every_dtype
@example(c=Cached(Case(sq=1, sk=5), (5,)))  # one sequence: the dense case, decoding one token
@example(c=Cached(Case(sq=3, sk=3, causal=BR), (3, 1, 0), append=True))  # appended keys, and a cache of 0
@example(c=Cached(Case(sq=4, sk=2, hq=4, hkv=2, causal=BR), (2, 7), spare=3))  # rows that see no key
@example(c=Cached(Case(sq=1, sk=33, d=16, dv=16, dtype="float32"), (33, 32, 1), page_size=16, order=7, spare=2))
@example(c=Cached(Case(sq=2, sk=20, causal=BR), (20, 3), page_size=3, num_splits=17))  # more splits than keys
def test_each_cached_sequence_matches_its_own_dense_float64(impl, c):
    """Every position past a sequence's keys and every unused block is NaN (large finite values for a
    kernel that declares isolates_nan=False): none may reach a result."""
    c = fk.fit(impl, c)
    res, _ = run(impl, c)
    for b in range(len(c.lengths)):
        check_sequence(impl, c, b, res, "cached")


@pytest.mark.requires("kv_append")
@given(c=fk.cached_batches(append=True))
@example(c=Cached(Case(sq=2, sk=2), (0, 5), append=True, spare=1))
@example(c=Cached(Case(sq=3, sk=6), (3, 14), append=True, page_size=16, order=3))  # crosses a page
def test_appended_keys_land_in_their_slots_and_nothing_else_in_the_cache_changes(impl, c):
    c = fk.fit(impl, c)
    call = c.call()
    _, (k_after, v_after) = cache.run(impl, c.case, call)
    lay = call.layout
    for label, before, new, after in (("k_cache", call.k_cache, call.k_new, k_after),
                                      ("v_cache", call.v_cache, call.v_new, v_after)):
        want = cache.poisoned(impl, before).copy()
        for b, n in enumerate(c.lengths):
            where, at = lay.slots(b, n + c.case.sq)
            want[where[n:], :, at[n:]] = np.swapaxes(new[b], 0, 1)
        same = (want == after) | (np.isnan(want) & np.isnan(after))
        if not same.all():
            idx = tuple(int(i) for i in np.argwhere(~same)[0])
            raise AssertionError(f"{impl.name}: {label} after appending differs from the cache with k_new/v_new "
                                 f"written at cache_seqlens onwards in {int((~same).sum())} of {same.size} entries; "
                                 f"first at {idx}: expected {want[idx]!r}, got {after[idx]!r}\n  cached: {c!r}")


@pytest.mark.requires("paged")
@given(c=fk.cached_batches())
@example(c=Cached(Case(sq=1, sk=40), (40, 9), page_size=16, order=1, spare=2))
def test_where_the_pages_lie_does_not_change_the_result(impl, c):
    """Any block order, any unused blocks (NaN), against the same pages in order with none unused."""
    c = fk.fit(impl, c)
    note(f"against {c.replace(order=None, spare=0)!r}")
    res, _ = run(impl, c)
    plain, _ = run(impl, c.replace(order=None, spare=0))
    _agree(impl, c, res, plain, "the same pages in order")


def _agree(impl, c, res, other, against):
    for b in range(len(c.lengths)):
        s = c.sequence(b)
        if s.sk == 0:
            continue
        for name in ("o", "lse"):
            if getattr(res, name) is None:
                continue
            budget = 2 * orc.allowed(s, name)
            orc.compare(s, name, getattr(res, name)[b:b + 1], want=getattr(other, name)[b:b + 1], budget=budget,
                        who=f"{impl.name} (sequence {b} of {len(c.lengths)}, against {against})")


@pytest.mark.requires("splits")
@given(c=fk.cached_batches())
@example(c=Cached(Case(sq=2, sk=100, causal=BR), (100, 30), num_splits=3))
def test_num_splits_does_not_matter_beyond_rounding(impl, c):
    c = fk.fit(impl, c)
    if c.num_splits == 1:
        c = c.replace(num_splits=2)
    res, _ = run(impl, c)
    one, _ = run(impl, c.replace(num_splits=1))
    _agree(impl, c, res, one, "num_splits=1")


# name -> a change of exactly one thing in a valid cache call, and a word our own kernels use
BAD_CALLS = {
    "cache_seqlens_int64": (lambda torch, kw: kw.update(cache_seqlens=kw["cache_seqlens"].long()), "int32"),
    "cache_seqlens_past_the_cache": (lambda torch, kw: kw["cache_seqlens"].fill_(10**6), "cache_seqlens"),
    "cache_seqlens_negative": (lambda torch, kw: kw["cache_seqlens"].fill_(-1), "cache_seqlens"),
    "one_length_fewer": (lambda torch, kw: kw.update(cache_seqlens=kw["cache_seqlens"][1:]), "shape"),
}


@pytest.mark.input_validation
@pytest.mark.parametrize("bad", sorted(BAD_CALLS))
def test_malformed_cache_seqlens_raise_a_named_error(impl, bad):
    import torch

    from flashcheck.contract import call as fc

    case = fs_draw.supported(impl, Case(hq=2, hkv=1, sq=1, sk=4, d=4, dv=4, dtype="float32"))[0]
    if case is None:
        pytest.skip(f"{impl.name}: its supports() refuses the starting case")
    c = Cached(case, (case.sk, 3), page_size=(impl.page_sizes or (16,))[0] if impl.paged else None)
    args, kw = cache.tensors(impl, case, c.call(), fc.device_for(impl))
    change, word = BAD_CALLS[bad]
    ph.assert_one_change_is_refused(impl, args, kw, lambda kw: change(torch, kw), word, ("torch-tiled-kvcache",))
