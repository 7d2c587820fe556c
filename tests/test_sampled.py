"""The sampled oracle (flashcheck/oracle/sampled.py) gives every sampled entry the dense oracle's verdict.

Over cases of every dtype, logit regime and feature, the truth and the allowed error at the sampled
rows match the dense oracle's at those rows, and results placed on either side of the bound get the
same verdict from both.
"""
import warnings

import numpy as np
import pytest

from flashcheck import oracle as orc
from flashcheck.oracle import bounds, sampled
from flashcheck.strategies import REGIMES, AttentionCase as Case

pytestmark = pytest.mark.selftest

BR, TL = "bottom_right", "top_left"
CASES = [Case(batch=2, hq=4, hkv=2, sq=37, sk=29, d=8, dv=6, causal=BR, dtype=dt, regime=r, seed=i)
         for i, (dt, r) in enumerate(zip(("float16", "bfloat16", "float32") * 3, REGIMES))] + [
    Case(hq=2, sq=40, sk=33, d=8, dv=8, causal=TL, dtype="float16", window=(5, 2)),
    Case(hq=2, sq=33, sk=50, d=8, dv=8, dtype="bfloat16", softcap=3.0, alibi=(0.25, -0.1)),
    Case(batch=2, hq=2, sq=35, sk=19, d=8, dv=8, dtype="float16", alibi=((0.3, -0.05), (-0.2, 0.1))),
    Case(batch=2, hq=4, hkv=2, sq=40, sk=37, d=8, dv=8, causal=BR, dtype="float32", mask=("rows", True, True, 0.5, 1)),
    Case(hq=2, sq=33, sk=50, d=8, dv=8, dtype="float16", mask=("band", False, True, 5, 2)),
    Case(sq=30, sk=30, d=8, dv=8, dtype="bfloat16", bias=("min", True, False, 1.0, 3)),
    Case(hq=4, hkv=2, sq=40, sk=23, d=8, dv=8, causal=BR, dtype="float32", sinks=(-1e999, 0.5, 3.0, 30.0)),
    Case(hq=2, sq=48, sk=48, d=8, dv=8, dtype="float32", precision="tf32", regime="large"),
]
ROWS = dict(block=8, random_rows=3)  # about half the rows: the rest are left out


def _rows(case):
    return sampled.rows_to_check(case, **ROWS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dtype}-{c.regime}-{'+'.join(c.features) or 'plain'}")
def test_sampled_rows_get_the_dense_oracles_truth_bound_and_verdicts(case):
    rows = _rows(case)
    truth, _ = sampled.parts(case, rows)
    rng = np.random.default_rng(0)
    for name in sampled.NAMES:
        want = orc.truth(case)[name][:, :, rows]
        limit = np.broadcast_to(orc.allowed(case, name), orc.truth(case)[name].shape)[:, :, rows]
        # the sums run in another order: their difference is rounding noise of float64, far below the bound
        with np.errstate(invalid="ignore"):
            off = np.where(np.isfinite(want), np.abs(truth[name] - want), 0.0)
        assert np.array_equal(truth[name][~np.isfinite(want)], want[~np.isfinite(want)]) and (off <= 1e-6 * limit).all(), (
            f"{name}: expected the dense truth at the sampled rows, off by {float(np.max(off / limit)):.3g} of the bound")
        got_limit = sampled.allowed(case, name, rows)
        assert np.allclose(got_limit, limit, rtol=1e-9, atol=0), (
            f"{name}: expected the dense oracle's allowed error at the sampled rows, worst ratio "
            f"{float(np.max(got_limit / limit)):.6g}")
        # results on both sides of the bound (factor 0 to 2 of it), away from it by 1e-3 of itself
        factor = rng.uniform(0, 2, want.shape)
        got = np.where(np.isfinite(want), want + np.sign(rng.standard_normal(want.shape)) * factor * limit, want)
        full = orc.truth(case)[name].copy()
        full[:, :, rows] = got
        dense = orc.entries(case, name, full).wrong[:, :, rows]
        mine = sampled.entries(case, name, got, rows).wrong
        clear = np.abs(factor - 1) > 1e-3
        assert np.array_equal(dense[clear], mine[clear]), (
            f"{name}: {int((dense != mine)[clear].sum())} sampled verdicts differ from the dense oracle's")
        assert dense.any() and not dense.all(), f"{name}: expected both verdicts among the drawn results"
    for name in sampled.NAMES if not case.features else ():  # the fused kernel's emulation (no features) passes
        sampled.compare(case, name, orc.model(case)[name][:, :, rows], rows)


def test_the_rows_to_check_cover_both_ends_every_tile_boundary_and_random_rows():
    case = Case(sq=300, sk=8, d=4, dv=4)
    rows = sampled.rows_to_check(case, block=64, random_rows=5)
    assert {0, 63, 236, 299} <= set(rows) and {63, 64, 127, 128, 191, 192, 255, 256} <= set(rows), rows
    assert np.all(np.diff(rows) > 0) and rows.min() >= 0 and rows.max() < 300


def test_a_wrong_sampled_row_fails_and_the_message_names_its_row_in_the_whole_case():
    case = CASES[0]
    rows = _rows(case)
    got = sampled.parts(case, rows)[0]["o"].copy()
    got[1, 2, 5, 3] += 1.0
    with pytest.raises(AssertionError, match=rf"(?s)worst at \(1, 2, {rows[5]}, 3\).*rows checked: {len(rows)} of 37"):
        sampled.compare(case, "o", got, rows, who="k")


@pytest.mark.parametrize("case, name, why", [
    (CASES[0], "dk", "sums over every query row"),
    (CASES[0].replace(precision="naive"), "o", "naive rule"),
    (CASES[0].replace(dropout_p=0.25), "o", "keep mask"),
])
def test_what_the_sampled_oracle_cannot_judge_is_refused_by_name(case, name, why):
    with pytest.raises(ValueError, match=why):
        sampled.allowed(case, name, _rows(case))


WHOLE = CASES[:3] + CASES[-3:] + [CASES[1].replace(precision="naive"), CASES[-3].replace(precision="naive")]


@pytest.mark.parametrize("case", WHOLE, ids=lambda c: f"{c.dtype}-{c.regime}-{'+'.join(c.features) or 'plain'}-{c.precision}")
def test_with_every_row_every_result_gets_the_dense_oracles_truth_and_bound(case):
    """dK and dV, and the naive rule, which the sampled oracle judges only when the rows are all of them."""
    rows = np.arange(case.sq)
    truth, terms = sampled.parts(case, rows)
    for name in sampled.NAMES + sampled.KEY_NAMES:
        want, limit = orc.truth(case)[name], np.broadcast_to(orc.allowed(case, name), orc.truth(case)[name].shape)
        assert np.allclose(truth[name], want, rtol=1e-12, atol=1e-300), f"{name}: expected the dense truth"
        got_limit = sampled.allowed(case, name, rows, truth, terms)
        assert np.allclose(got_limit, limit, rtol=1e-9, atol=0), (
            f"{name}: expected the dense oracle's allowed error, worst ratio {float(np.max(got_limit / limit)):.6g}")


def test_dk_and_dv_at_a_subset_of_the_rows_are_refused_by_name():
    case = CASES[0]
    with pytest.raises(ValueError, match="dk sums over every query row, and 3 of 37 rows were sampled"):
        sampled.entries(case, "dk", np.zeros((2, 2, 29, 8)), np.arange(3))


CHUNKED = CASES + [CASES[0].replace(precision="prescaled"), CASES[4].replace(precision="tf32+prescaled+delta"),
                   CASES[2].replace(precision="dense")]


@pytest.mark.parametrize("case", CHUNKED, ids=lambda c: f"{c.dtype}-{c.regime}-{'+'.join(c.features) or 'plain'}-{c.precision}")
def test_the_terms_evaluated_in_chunks_of_rows_are_the_whole_problems(case, monkeypatch):
    """bounds.py evaluates a large problem a few query rows at a time (dK's and dV's terms summed over the
    chunks): the terms of every result are those of the whole problem at once."""
    pt, ds = orc.rule._parts(case), orc.rule._dscores(case)
    with np.errstate(over="ignore"):  # as the rule calls it: an infinite variance is honest
        whole = dict(bounds.rounding_bounds(case, pt, ds, orc.rule.half_spacing))
    monkeypatch.setattr(bounds, "CHUNK", 3 * case.batch * case.hq * case.sk)  # three rows a chunk
    chunks = bounds._row_chunks(case, pt, orc.rule.Precision.of(case.dtype, case.precision))
    assert len(chunks) == (1 if case.precision == "dense" else -(-case.sq // 3)), chunks  # "dense": ties down columns
    with np.errstate(over="ignore"):
        chunked = dict(bounds.rounding_bounds(case, pt, ds, orc.rule.half_spacing))
    monkeypatch.setattr(bounds, "threads", lambda: 2)  # the chunks in two threads, as on a worker with two cores
    with np.errstate(over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("error")  # the caller's error state holds in the threads: no RuntimeWarning
        threaded = dict(bounds.rounding_bounds(case, pt, ds, orc.rule.half_spacing))
    for terms in (chunked, threaded):
        for name in sampled.NAMES + sampled.KEY_NAMES:
            assert terms[name].shape == whole[name].shape and np.allclose(terms[name], whole[name], rtol=1e-12, atol=0), (
                f"{name}: expected the whole problem's terms, worst ratio {float(np.max(terms[name] / whole[name])):.15g}")
