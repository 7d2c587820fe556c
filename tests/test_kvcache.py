"""The KV-cache layout, its declarations, its strategy, and torch-tiled-kvcache on pinned cases (its
full property run is opt-in on CPU: pytest -m properties --impl torch-tiled-kvcache)."""
import numpy as np
import pytest
from hypothesis import find

from flashcheck.contract import ContractError, cache, implementation, load
from flashcheck.properties import test_kvcache as props
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import context
from flashcheck.strategies import kvcache as fk
from flashcheck.strategies.kvcache import Cached

pytestmark = pytest.mark.properties
BR = "bottom_right"


def test_a_paged_cache_reads_back_what_was_laid_out_and_is_nan_elsewhere():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((2, n, 3)) for n in (5, 0, 9)]
    lay = cache.Layout.paged(3, 9, page_size=4, spare=2, order_seed=11)
    arr = cache.lay_out(parts, lay, 3, 2, 3)
    assert arr.shape == (3 * 3 + 2, 2, 4, 3), f"expected 11 blocks of 4 positions, got {arr.shape}"
    for b, x in enumerate(parts):
        assert np.array_equal(cache.read_back(arr, lay, b, x.shape[1]), x), f"sequence {b} did not read back"
    filled = sum(x.size for x in parts)
    assert np.isnan(arr).sum() == arr.size - filled, "every position no sequence holds must be NaN"
    used = {blk for row in lay.table for blk in row}
    assert len(used) == 9 and used <= set(range(11)), f"expected 9 distinct blocks of 11, got {sorted(used)}"


@pytest.mark.parametrize("kw, words", [
    (dict(kv_append=True), "goes with kvcache=True"),
    (dict(kvcache=True, backward=True), "forward only"),
    (dict(kvcache=True, causal=("bottom_right", "top_left")), "'bottom_right' or None"),
    (dict(kvcache=True, paged=False, page_sizes=(16,)), "declared with paged=True"),
    (dict(kvcache=True, paged=True, page_sizes=(0,)), "ints >= 1"),
    (dict(kvcache=True, varlen=True), "no varlen"),
])
def test_a_malformed_cache_declaration_is_refused_naming_it(kw, words):
    with pytest.raises(ContractError, match=words):
        implementation(name="bad-cache", register=False, **kw)(lambda q, k, v, **_: q)


def test_the_cache_strategy_shrinks_to_one_sequence_in_order_with_one_split():
    impl = load("torch-tiled-kvcache")
    context.begin(impl=impl)
    try:
        smallest = find(fk.cached_batches(), lambda c: True)
    finally:
        context.end()
    assert (len(smallest.lengths), smallest.append, smallest.order, smallest.spare, smallest.num_splits) == \
        (1, False, None, 0, 1), f"expected one sequence, no append, pages in order, one split; got {smallest!r}"
    assert smallest.lengths == (smallest.case.sk,), f"the one sequence holds the template's keys: {smallest!r}"


def test_an_appending_draw_keeps_the_template_as_one_of_its_sequences():
    impl = load("torch-tiled-kvcache")
    context.begin(impl=impl)
    try:
        drawn = find(fk.cached_batches(append=True), lambda c: len(c.lengths) > 2 and c.case.sq > 2)
    finally:
        context.end()
    keys = [drawn.keys(b) for b in range(len(drawn.lengths))]
    assert drawn.append and drawn.case.sk in keys, f"the template's keys {drawn.case.sk} are no sequence's: {drawn!r}"


PINNED = [
    Cached(Case(batch=1, hq=4, hkv=2, sq=3, sk=40, d=8, dv=4, causal=BR), (40, 0, 17), page_size=16, order=5,
           spare=2, num_splits=3),
    Cached(Case(sq=4, sk=6, causal=BR, dtype="float32"), (2, 9), append=True, page_size=3, order=1),
    Cached(Case(hq=2, sq=2, sk=33, window=(4, 0), softcap=3.0, alibi=(0.5, 0.25), sinks=(0.3, -1.0), causal=BR),
           (33, 5), num_splits=4, spare=1),
    Cached(Case(sq=5, sk=2, causal=BR, dtype="float16"), (2, 0), append=True, num_splits=64),
]


@pytest.mark.parametrize("c", PINNED, ids=["paged-gqa-splits", "appended-paged", "features-split", "fp16-more-splits"])
def test_torch_tiled_kvcache_matches_dense_float64_on_pinned_caches(c):
    impl = load("torch-tiled-kvcache")
    res, _ = cache.run(impl, c.case, c.call())
    for b in range(len(c.lengths)):
        props.check_sequence(impl, c, b, res, "pinned")
