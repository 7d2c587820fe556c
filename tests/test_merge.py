"""flashcheck.merge_attention_states: attention over two sets of keys, merged through their LSEs,
equals attention over all of them, for any cut, with rows that see no key on a side or on both."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from flashcheck import merge_attention_states
from flashcheck import oracle as orc
from flashcheck.oracle.reference import dense_forward
from flashcheck.strategies import AttentionCase as Case, cases

pytestmark = pytest.mark.properties


def _halves(case, cut):
    q, k, v, _ = case.inputs()
    kw = case.reference_kwargs()
    a = dense_forward(q, k[:, :, :cut], v[:, :, :cut], **{**kw, "causal": False})
    b = dense_forward(q, k[:, :, cut:], v[:, :, cut:], **{**kw, "causal": False})
    return a, b


@settings(max_examples=40, database=None, derandomize=True, suppress_health_check=list(HealthCheck), deadline=None)
@given(case=cases(causal="none", dtypes=("float64",)), at=st.floats(0, 1))
def test_two_halves_of_the_keys_merged_equal_the_whole(case, at):
    case = case.replace(sk=max(case.sk, 2))
    cut = min(max(1, round(at * case.sk)), case.sk - 1)
    note(f"keys cut at {cut}")
    (oa, la), (ob, lb) = _halves(case, cut)
    o, lse = merge_attention_states(oa, la, ob, lb)
    t = orc.truth(case)
    assert np.allclose(o, t["o"], rtol=1e-12, atol=1e-12), f"expected the whole's O, off by {np.abs(o - t['o']).max():.3g}"
    assert np.allclose(lse, t["lse"], rtol=1e-12, atol=1e-12), f"expected the whole's LSE, off by {np.abs(lse - t['lse']).max():.3g}"


def test_merging_is_associative_over_three_chunks():
    case = Case(hq=2, sq=5, sk=9, d=4, dv=3, scale=3.0, dtype="float64", regime="large")
    q, k, v, _ = case.inputs()
    parts = [dense_forward(q, k[:, :, i:j], v[:, :, i:j]) for i, j in ((0, 2), (2, 7), (7, 9))]
    left = merge_attention_states(*merge_attention_states(*parts[0], *parts[1]), *parts[2])
    right = merge_attention_states(*parts[0], *merge_attention_states(*parts[1], *parts[2]))
    for x, y, what in zip(left, right, ("o", "lse")):
        assert np.allclose(x, y, rtol=1e-13, atol=0), f"expected one {what} whichever pair merges first"


def test_a_side_without_keys_gives_the_other_and_no_keys_at_all_gives_zero_and_minus_inf():
    o_a, lse_a = np.array([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]]), np.array([0.5, -np.inf, -np.inf])
    o_b, lse_b = np.array([[0.0, 0.0], [3.0, -1.0], [0.0, 0.0]]), np.array([-np.inf, 2.0, -np.inf])
    with np.errstate(all="raise"):
        o, lse = merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert np.array_equal(o, [[1.0, 2.0], [3.0, -1.0], [0.0, 0.0]]), f"expected each side's own O, got {o}"
    assert np.array_equal(lse, [0.5, 2.0, -np.inf]), f"expected each side's own LSE and -inf, got {lse}"


def test_a_nan_is_never_merged_away():
    o, lse = merge_attention_states(np.ones((2, 1)), np.array([np.nan, 0.0]), np.ones((2, 1)), np.array([-np.inf, 0.0]))
    assert np.isnan(lse[0]) and np.isnan(o[0]).all(), f"expected NaN to reach the merged row, got {o[0]}, {lse[0]}"


def test_torch_tensors_merge_as_arrays_do_and_keep_their_dtype():
    case = Case(batch=2, hq=2, sq=4, sk=6, d=3, dv=5, dtype="float64")
    (oa, la), (ob, lb) = _halves(case, 2)
    want_o, want_lse = merge_attention_states(oa, la, ob, lb)
    t = [torch.from_numpy(x) for x in (oa.astype(np.float16), la.astype(np.float32), ob.astype(np.float16),
                                       lb.astype(np.float32))]
    o, lse = merge_attention_states(*t)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32, f"expected fp16 O and fp32 LSE, got {o.dtype}, {lse.dtype}"
    assert np.allclose(o.double().numpy(), want_o, rtol=2e-3, atol=2e-3), "expected the float64 merge, to fp16"
    assert np.allclose(lse.double().numpy(), want_lse, rtol=1e-6), "expected the float64 merge's LSE, to fp32"


@pytest.mark.parametrize("bad, message", [
    ((np.ones((2, 3)), np.ones(2), np.ones((2, 4)), np.ones(2)), "differ in shape"),
    ((np.ones((2, 3)), np.ones(3), np.ones((2, 3)), np.ones(3)), "expected o (..., S, Dv) and lse (..., S)"),
    ((torch.ones(2, 3), np.ones(2), np.ones((2, 3)), np.ones(2)), "four NumPy arrays or four torch tensors"),
], ids=["states-differ", "lse-not-o-rows", "mixed-kinds"])
def test_malformed_states_raise_an_error_naming_the_problem(bad, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        merge_attention_states(*bad)


def test_many_splits_merged_at_once_round_the_lse_once():
    """64 float32 states far from 0 (the negative regime's LSEs): one combine step errs by about
    one rounding of the LSE; merging them two at a time rounds it 63 times, and errs more. That
    gap once put torch-tiled-kvcache's LSE past the oracle's bound at 64 splits."""
    from flashcheck.merge import merge_splits

    rng = np.random.default_rng(0)
    n, rows = 64, 4096
    lse = (rng.normal(-30.0, 1.0, (n, rows))).astype(np.float32)
    o = rng.normal(0.0, 1.0, (n, rows, 4)).astype(np.float32)
    top = lse.astype(np.float64).max(0)
    exact = top + np.log(np.exp(lse.astype(np.float64) - top).sum(0))
    _, at_once = merge_splits(o, lse)
    pairwise_o, pairwise = o[0], lse[0]
    for i in range(1, n):
        pairwise_o, pairwise = merge_attention_states(pairwise_o, pairwise, o[i], lse[i])
    u = 2.0 ** -24
    err_once, err_pairs = np.abs(at_once - exact), np.abs(pairwise - exact)
    one_rounding = u * np.abs(exact) + u * (2 + np.sqrt(n))
    assert (err_once <= one_rounding).all(), (f"merged at once: expected an LSE error within one rounding "
                                              f"({one_rounding.max():.3g}), got {err_once.max():.3g}")
    assert err_pairs.max() > 4 * err_once.max(), (f"merged two at a time: expected the 63 roundings to show, got "
                                                  f"{err_pairs.max():.3g} against {err_once.max():.3g} at once")
