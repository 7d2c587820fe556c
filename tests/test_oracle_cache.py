"""The oracle's caches: one truth per problem within an example, and a bounded footprint across them.

Held by count alone, the caches of O(Sq Sk) intermediates grew a gpu-lane process by about 390 MB per
2048 x 2048 case, and each long case then took 1.8x as long on fresh pages (docs/gpu-lane.md).
"""
from dataclasses import dataclass, replace

import pytest

from flashcheck.oracle import rule

pytestmark = pytest.mark.selftest


@dataclass(frozen=True)
class Problem:  # what _cached reads of a case
    sq: int
    sk: int = 8
    batch: int = 1
    hq: int = 1
    block_q: int = 16
    block_k: int = 16
    precision: str = "fused"

    def replace(self, **kw):
        return replace(self, **kw)


def counted(maxsize, large):
    calls = []

    @rule._cached(maxsize, large=large)
    def fn(case, *args):
        calls.append((case, args))
        return object()

    return fn, calls


def test_a_case_at_another_tiling_is_served_from_the_cache():
    fn, calls = counted(4, large=True)
    first = fn(Problem(sq=3, block_q=32, block_k=64))
    assert fn(Problem(sq=3, block_q=128, block_k=16)) is first, "another tiling computed the result again"
    assert len(calls) == 1, f"expected one computation, got {len(calls)}"


def test_a_small_cache_holds_its_count_and_drops_the_least_recent():
    fn, calls = counted(2, large=False)
    a, b = fn(Problem(sq=1)), fn(Problem(sq=2))
    assert fn(Problem(sq=1)) is a
    fn(Problem(sq=3))  # drops sq=2, the least recently used
    assert fn(Problem(sq=1)) is a, "the recently used entry was dropped"
    assert fn(Problem(sq=2)) is not b, "three entries held in a cache of two"
    assert len(calls) == 4, f"expected 4 computations, got {len(calls)}"


def test_a_large_cache_holds_at_most_its_score_budget_but_always_the_newest():
    side = int(rule.HELD_SCORES ** 0.5)
    fn, calls = counted(32, large=True)
    small = fn(Problem(sq=4, sk=4))
    huge = fn(Problem(sq=2 * side, sk=side))  # alone over the budget: kept while it is the newest
    assert fn(Problem(sq=2 * side, sk=side)) is huge, "the newest entry was dropped"
    assert fn(Problem(sq=4, sk=4)) is not small, "a small entry outlived a case past the budget"
    half = fn(Problem(sq=side // 2, sk=side))
    assert fn(Problem(sq=side // 2, sk=side)) is half
    assert len(calls) == 4, f"expected 4 computations, got {len(calls)}"
    fn.cache_clear()
    assert fn(Problem(sq=side // 2, sk=side)) is not half, "cache_clear kept an entry"
