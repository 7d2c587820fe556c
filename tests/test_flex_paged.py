"""flex-paged (impls/flex_paged.py) on pinned caches, for CI: its whole property run is opt-in on CPU
(``pytest -m properties --impl flex-paged``), as flex's is. Also the declarations it needed: a kernel
that takes only paged caches (contiguous_cache=False), and one that lets NaN in unused entries through
a zero probability (isolates_nan=False with kvcache)."""
import numpy as np
import pytest
import torch

from flashcheck.contract import ContractError, cache, implementation, load
from flashcheck.properties import test_kvcache as props
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import kvcache as fk
from flashcheck.strategies.kvcache import Cached

pytest.importorskip("flashcheck.impls.flex_paged")
if pytest.importorskip("flashcheck.impls.flex")._CUDA:  # an H200 run of this file failed on its CPU tensors
    pytest.skip("flex-paged runs compiled on CUDA here, for CUDA tensors of D >= 16: the gpu lane runs every "
                "property on it; these pin eager flex-paged on CPU", allow_module_level=True)
pytestmark = pytest.mark.properties
BR = "bottom_right"

PINNED = [  # an empty sequence, one that fills its pages exactly, a partial last page, a long one
    Cached(Case(batch=1, hq=4, hkv=2, sq=3, sk=40, d=8, dv=4, causal=BR), (40, 0, 16, 70), page_size=16, order=5,
           spare=2),
    Cached(Case(sq=4, sk=6, causal=BR, dtype="float32"), (2, 9), append=True, page_size=32, order=1, spare=1),
    Cached(Case(hq=2, sq=2, sk=33, dtype="float16"), (33, 5), page_size=16, order=-1),  # not causal
    Cached(Case(sq=5, sk=2, causal=BR, dtype="bfloat16"), (2, 0), append=True, page_size=64),  # rows that see no key
]


def impl():
    return load("flex-paged")


@pytest.mark.parametrize("c", PINNED, ids=["gqa-shuffled", "appended", "fp16-reversed", "bf16-no-keys"])
def test_flex_paged_matches_dense_float64_on_pinned_caches(c):
    res, _ = cache.run(impl(), c.case, c.call())
    for b in range(len(c.lengths)):
        props.check_sequence(impl(), c, b, res, "pinned")


def test_flex_paged_repeats_kv_heads_where_compiled_gqa_finds_no_kernel_and_stays_exact(monkeypatch):
    """Compiled flex raises NoValidChoicesError for GQA with a block mask at Sq < 128 < Sq G (an H200 gpu
    lane, torch 2.11: hq=12, hkv=3, sq=33), and flex-paged always has a block mask, so its kv heads are
    repeated there. Eager here, with the compiled path forced: the repeated heads give the same result."""
    from flashcheck.impls import flex, flex_paged
    calls = []

    def forced(sq, hq, k, v):
        k2, v2 = flex._ungrouped_where_no_choices(sq, hq, k, v, compiled=True)
        calls.append((k.shape[1], k2.shape[1]))
        return k2, v2

    monkeypatch.setattr(flex_paged, "_ungrouped_where_no_choices", forced)
    c = Cached(Case(hq=12, hkv=3, sq=33, d=8, dv=8, causal=BR, dtype="float32"), (33, 50), page_size=16, order=3,
               spare=1)
    res, _ = cache.run(impl(), c.case, c.call())
    assert calls == [(3, 12)], f"expected the 3 kv heads repeated to 12, got (before, after) {calls}"
    for b in range(len(c.lengths)):
        props.check_sequence(impl(), c, b, res, "kv heads repeated")


def test_flex_paged_appends_in_place_and_changes_nothing_else():
    c = PINNED[1]
    call = c.call()
    _, (k_after, _) = cache.run(impl(), c.case, call)
    want = cache.poisoned(impl(), call.k_cache).copy()
    for b, n in enumerate(c.lengths):
        where, at = call.layout.slots(b, n + c.case.sq)
        want[where[n:], :, at[n:]] = np.swapaxes(call.k_new[b], 0, 1)
    assert np.array_equal(want, k_after), "expected k_new written at cache_seqlens onwards and nothing else changed"


def test_nan_in_an_unused_cache_entry_reaches_flex_paged_s_result():
    """Why flex-paged declares isolates_nan=False: a hidden key gets probability 0 and 0 * NaN = NaN
    in P V (eager flex multiplies every physical key). When this stops reproducing, the declaration can
    go. The suite gives such a kernel cache.POISON in those entries instead, finite and still visible."""
    c = PINNED[2]
    call = c.call()
    assert np.isnan(call.v_cache).any(), "expected NaN past the sequences' keys"
    (q, kc, vc), kw = cache.tensors(impl(), c.case, call, "cpu")
    assert not torch.isnan(vc).any() and (vc == cache.POISON).any(), "expected POISON, not NaN, for this kernel"
    vc = torch.tensor(call.v_cache).to(vc.dtype)  # NaN as a kernel that isolates it would get
    o, _ = impl().fn(q, kc, vc, **kw)
    assert torch.isnan(o).all(), "expected NaN in unused entries to reach every row through 0 * NaN"


def test_a_paged_only_kernel_gets_every_cache_on_pages_of_a_size_it_takes():
    real = impl()
    sized = implementation(name="flex-paged-sized", register=False, causal=("bottom_right",), dtypes=real.dtypes,
                           gqa=True, lse=True, kvcache=True, paged=True, page_sizes=(16, 32, 64, 128),
                           contiguous_cache=False, isolates_nan=False)(real.fn).__flashcheck__
    assert fk._pages_for(real, Cached(Case(sq=1, sk=5), (5, 3), page_size=3)) == {}, \
        "expected flex-paged (any page size) to keep a drawn page of 3"
    sizes = [fk._pages_for(sized, Cached(Case(sq=1, sk=5), (5, 3), page_size=n)).get("page_size", n)
             for n in (None, 3, 16, 256)]
    assert sizes == [16, 16, 16, 128], f"expected pages of 16, 16, 16 and 128, got {sizes}"
    both = load("torch-tiled-kvcache")
    assert fk._pages_for(both, Cached(Case(sq=1, sk=5), (5, 3))) == {}, "a kernel taking both keeps a contiguous cache"


@pytest.mark.parametrize("kw, words", [
    (dict(kvcache=True, contiguous_cache=False), "goes with paged=True"),
    (dict(isolates_nan=False), "varlen=True or kvcache=True"),
])
def test_the_new_cache_declarations_are_refused_where_they_mean_nothing(kw, words):
    with pytest.raises(ContractError, match=words):
        implementation(name="bad-cache", register=False, **kw)(lambda q, k, v, **_: q)


def test_a_kvcache_kernel_may_declare_that_it_does_not_isolate_nan():
    declared = implementation(name="cache-no-nan", register=False, kvcache=True, isolates_nan=False)(
        lambda q, k, v, **_: q)
    assert not declared.__flashcheck__.isolates_nan


def test_a_read_past_the_length_is_caught_by_the_poison_that_replaces_nan():
    """isolates_nan=False trades NaN for cache.POISON in unused entries; a kernel that reads one position
    past each sequence must still fail: here the real kernel told one key more than each sequence has."""
    real = impl()

    def one_past(q, k_cache, v_cache, *, cache_seqlens, **kw):
        return real.fn(q, k_cache, v_cache, cache_seqlens=cache_seqlens + (cache_seqlens > 0).int(), **kw)

    mutant = implementation(name="flex-paged-one-past", register=False, causal=("bottom_right",), dtypes=real.dtypes,
                            gqa=True, lse=True, kvcache=True, paged=True,
                            contiguous_cache=False, isolates_nan=False)(one_past).__flashcheck__
    c = PINNED[0]
    res, _ = cache.run(mutant, c.case, c.call())
    with pytest.raises(AssertionError, match="sequence 0 of 4"):
        props.check_sequence(mutant, c, 0, res, "one past")
