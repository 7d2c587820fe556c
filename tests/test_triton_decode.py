"""triton-decode (impls/triton_decode.py) on pinned caches, against each sequence's dense float64 truth.

Its full property run is opt-in on CPU, where the kernels run in Triton's interpreter
(pytest -m properties --impl triton-decode); these pins cover what a split-KV kernel over pages gets
wrong, in a few seconds: the same pages in another order, page sizes 1 and 3, more splits than key
tiles, sequences without keys, NaN in unused blocks, several row tiles of one GQA group, the merge
kernel against flashcheck.merge.merge_splits, and the refusals.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashcheck.contract import cache, load  # noqa: E402
from flashcheck.merge import merge_splits  # noqa: E402
from flashcheck.properties import test_kvcache as props  # noqa: E402
from flashcheck.strategies import AttentionCase as Case  # noqa: E402
from flashcheck.strategies.kvcache import Cached  # noqa: E402

td = pytest.importorskip("flashcheck.impls.triton_decode")
# on CPU these run in Triton's interpreter: -m "not interpreter" leaves them out there
pytestmark = [pytest.mark.properties, *([pytest.mark.interpreter] if td.INTERPRET else []),
              pytest.mark.skipif(not td.INTERPRET and not torch.cuda.is_available(),
                                 reason="needs CUDA, or TRITON_INTERPRET=1 set before triton is imported")]
BR = "bottom_right"
DEVICE = "cpu" if td.INTERPRET else "cuda"


def impl():
    return load("triton-decode")


def run_and_check(c: Cached):
    """Every sequence within its own bound (exactly 0 / -inf without keys); returns (O, LSE)."""
    res, _ = cache.run(impl(), c.case, c.call())
    for b in range(len(c.lengths)):
        props.check_sequence(impl(), c, b, res, "pinned")
    return res.o, res.lse


# 40 keys are three 16-key tiles under the interpreter: a sequence of 17 keys, one of none
GQA = Case(batch=1, hq=4, hkv=2, sq=3, sk=40, d=8, dv=5, causal=BR, dtype="float32")


def test_the_same_pages_in_any_order_give_what_a_contiguous_cache_gives():
    contiguous = Cached(GQA, (40, 0, 17), spare=2, num_splits=2)
    paged = contiguous.replace(page_size=16, order=5, spare=3)  # shuffled blocks, three of them unused (NaN)
    o_c, lse_c = run_and_check(contiguous)
    o_p, lse_p = run_and_check(paged)
    assert np.isfinite(o_p).all(), "NaN from an unused block or a slot past a sequence reached O"
    np.testing.assert_allclose(o_p, o_c, rtol=1e-6, atol=1e-6, err_msg="paged O differs from contiguous")
    np.testing.assert_allclose(lse_p, lse_c, rtol=1e-6, atol=1e-6, err_msg="paged LSE differs from contiguous")


@pytest.mark.parametrize("page", [1, 3])
def test_pages_of_one_and_three_slots_with_appended_keys(page):
    # appended keys cross page boundaries; the cache must afterwards hold them, and nothing else changed
    c = Cached(Case(hq=2, hkv=1, sq=2, sk=19, d=5, dv=3, causal=BR, dtype="float32"), (17, 4, 0), append=True,
               page_size=page, order=page, spare=2, num_splits=3)
    call = c.call()
    res, (k_after, v_after) = cache.run(impl(), c.case, call)
    for b in range(len(c.lengths)):
        props.check_sequence(impl(), c, b, res, f"page size {page}")
    for before, new, after in ((call.k_cache, call.k_new, k_after), (call.v_cache, call.v_new, v_after)):
        want = before.copy()
        for b, n in enumerate(c.lengths):
            where, at = call.layout.slots(b, n + c.case.sq)
            want[where[n:], :, at[n:]] = np.swapaxes(new[b], 0, 1)
        assert np.array_equal(want, after, equal_nan=True), "the cache after appending is not the expected one"


def test_more_splits_than_key_tiles_equal_one_split():
    c = Cached(GQA.replace(dtype="float16"), (40, 3, 0), page_size=16, order=1, spare=1)
    o1, lse1 = run_and_check(c)
    # 64 splits launch as many as the longest sequence has key tiles (3 of 16 under the interpreter):
    # the 3-key sequence still gets two empty splits, the sequence without keys three
    o64, lse64 = run_and_check(c.replace(num_splits=64))
    np.testing.assert_allclose(o64, o1, atol=2e-3, err_msg="64 splits differ from one")
    np.testing.assert_allclose(lse64, lse1, atol=1e-5, err_msg="64 splits' LSE differs from one")


def test_a_batch_without_any_key_gives_zero_and_minus_inf():
    # no split sees a key: the launch falls back to one split, which must still write the empty rows;
    # the cache's two slots hold NaN
    for splits in (1, 4):
        o, lse = run_and_check(Cached(GQA.replace(sk=0, causal=None), (0, 0), spare=2, num_splits=splits))
        assert (o == 0).all() and (lse == -np.inf).all(), f"num_splits={splits}: expected O = 0, LSE = -inf"


def test_a_gqa_group_of_several_row_tiles_and_masked_rows():
    # G * Sq = 4 * 20 = 80 rows: two 64-row tiles; 5 keys for 20 queries, so causal rows see no key
    c = Cached(Case(hq=4, hkv=1, sq=20, sk=5, d=16, dv=16, causal=BR, dtype="float32"), (5, 33), num_splits=2)
    run_and_check(c)


def test_the_merge_kernel_equals_merge_splits():
    gen = torch.Generator().manual_seed(0)
    b, hq, sq, ns, dv = 2, 3, 5, 70, 7  # 70 splits, merged one by one
    op = torch.randn(b, hq, sq, ns, dv, generator=gen)
    lp = torch.randn(b, hq, sq, ns, generator=gen) * 30
    lp[0, 1, 2] = -float("inf")  # a row that saw no key in any split
    lp[1, 0, :, ::3] = -float("inf")  # empty splits
    op[lp == -float("inf")] = 0.0
    o, lse = torch.empty(b, hq, sq, dv), torch.empty(b, hq, sq)
    op, lp, o, lse = (x.to(DEVICE) for x in (op, lp, o, lse))
    td.decode_merge[(b * hq, 1)](op, lp, o, lse, *op.stride(), *lp.stride(), *o.stride(), *lse.stride(), hq, sq, dv,
                                 ns, BLOCK_R=8, DV_PAD=16)
    want_o, want_lse = merge_splits(op.permute(3, 0, 1, 2, 4).cpu().double(), lp.permute(3, 0, 1, 2).cpu().double())
    assert lse[0, 1, 2] == -float("inf") and (o[0, 1, 2] == 0).all(), "a row without keys must give O = 0, LSE = -inf"
    np.testing.assert_allclose(o.cpu().double(), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.cpu().double(), want_lse, rtol=1e-6, atol=1e-5)


def _cache_call(**kw):
    q = torch.zeros(1, 2, 1, 8, device=DEVICE)
    kc, vc = torch.zeros(1, 1, 4, 8, device=DEVICE), torch.zeros(1, 1, 4, 8, device=DEVICE)
    return td.attention(q, kc, vc, cache_seqlens=torch.tensor([4], dtype=torch.int32, device=DEVICE), **kw)


@pytest.mark.parametrize("kw, words", [
    (dict(num_splits=0), "num_splits must be an int in 1..65535, got 0"),
    (dict(num_splits=True), "num_splits must be an int in 1..65535, got True"),
    (dict(num_splits=2.0), "num_splits must be an int in 1..65535, got 2.0"),
    (dict(causal="top_left"), "bottom-right only"),
    (dict(causal="sideways"), "causal must be"),
])
def test_bad_arguments_raise_naming_them(kw, words):
    with pytest.raises(ValueError, match=words):
        _cache_call(**kw)
