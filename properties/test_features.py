"""Sliding window, softcap, ALiBi, attention sinks and mask tensors: agreement with dense float64, and the
metamorphic relations that tie each feature back to plain attention.

Every case is drawn with the features the implementation declares (the others are fitted
off), each shrinking to off: a failure whose case still has a feature on needs it.
Dropout has its own file (test_dropout.py): its results are random by design.
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, assume, example, given, note
from hypothesis import strategies as st

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.contract import call
from flashcheck.oracle import reference
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import feature_table

pytestmark = pytest.mark.properties

FEATURES = feature_table.DETERMINISTIC  # dropout has its own properties (test_dropout.py)


def _compare_all(impl, case, res, names, who=None):
    for name in names:
        got = getattr(res, name)
        if got is not None:
            orc.compare(case, name, got, who=who or impl.name)


def _geometric(h):
    """ALiBi's slopes for h heads: 2^(-8 i / h), i = 1..h."""
    return tuple(2.0 ** (-8.0 * (i + 1) / h) for i in range(h))


def _tiles16(**fields):
    return Case(d=16, dv=16, block_q=16, block_k=16, **fields)


# Aimed at the branches of a tiled kernel, with 16-wide tiles so that every length spans several:
# tiles skipped on either side of a window, bands wider than two tiles (masked, unmasked, masked
# in turn, left edges one past a tile boundary: Sk - Sq - left = -17 and -62), windows that empty
# rows, saturating and identity softcaps, ALiBi of both signs per head and per batch, sinks from
# -inf to dominant, and everything at once; causal both ways, GQA, Sq != Sk.
TILE_GRID = (
    _tiles16(hq=2, hkv=1, sq=40, sk=40, dtype="float32", window=(3, 2)),
    _tiles16(hq=2, hkv=2, sq=29, sk=53, dtype="float32", window=(7, -1), causal="bottom_right"),
    _tiles16(hq=2, hkv=1, sq=45, sk=30, dtype="float16", window=(-1, 4), causal="top_left"),
    _tiles16(hq=2, hkv=1, sq=64, sk=70, dtype="float32", window=(23, 20)),
    _tiles16(hq=4, hkv=2, sq=70, sk=64, dtype="float16", window=(56, -1), causal="bottom_right"),
    _tiles16(sq=50, sk=20, dtype="float32", window=(0, 0)),
    _tiles16(sq=20, sk=33, dtype="float16", window=(40, 40), causal="bottom_right"),
    _tiles16(hq=2, hkv=1, sq=33, sk=33, dtype="float32", softcap=0.5, scale=1.0, causal="bottom_right"),
    _tiles16(sq=20, sk=20, dtype="float32", softcap=1e-35, causal="bottom_right"),
    _tiles16(hq=2, hkv=2, sq=20, sk=35, dtype="float16", softcap=1e4),
    _tiles16(hq=4, hkv=2, sq=37, sk=21, dtype="float32", softcap=3.0, scale=0.6),
    _tiles16(hq=4, hkv=2, sq=22, sk=41, dtype="float32", alibi=_geometric(4), causal="bottom_right"),
    _tiles16(batch=2, hq=2, hkv=1, sq=35, sk=19, dtype="float16", alibi=((0.3, -0.05), (-0.2, 0.1))),
    _tiles16(hq=4, hkv=2, sq=40, sk=23, dtype="float32", sinks=(-math.inf, 0.5, 3.0, 30.0), causal="bottom_right"),
    _tiles16(hq=4, hkv=2, sq=38, sk=51, dtype="float32", window=(9, 3), causal="bottom_right", softcap=2.0,
             alibi=_geometric(4), sinks=(0.0, -1.0, 2.0, -math.inf)),
    _tiles16(hq=2, hkv=1, sq=41, sk=26, dtype="float16", window=(12, 1), causal="top_left", softcap=4.0,
             alibi=(0.25, -0.1), sinks=(1.0, -2.0)),
    # mask tensors: rows emptied per batch entry and head across tiles; a band per head with ALiBi
    _tiles16(batch=2, hq=4, hkv=2, sq=40, sk=37, dtype="float32", mask=("rows", True, True, 0.5, 1),
             causal="bottom_right"),
    _tiles16(hq=2, hkv=1, sq=33, sk=50, dtype="float16", mask=("band", False, True, 5, 2), alibi=(0.25, -0.1)),
)


def _tile_grid(test):
    for case in reversed(TILE_GRID):  # decorators apply bottom-up: keep the grid's order
        test = example(case=case)(test)
    return test


@pytest.mark.requires("features")
@given(case=fs.cases(features=FEATURES))
@_tile_grid
@example(case=Case(sq=4, sk=6, window=(0, 0)))  # each row sees exactly its diagonal key
@example(case=Case(sq=6, sk=3, d=2, window=(1, 1)))  # Sq > Sk: the first rows' windows end before key 0
@example(case=Case(sq=5, sk=5, causal="top_left", window=(2, -1), block_q=2, block_k=2))  # window + causal
@example(case=Case(sq=3, sk=4, softcap=1e-3))  # saturated: every logit pinned near +-c
@example(case=Case(hq=2, sq=3, sk=5, alibi=(0.5, -0.5)))  # ALiBi of both signs, Sq != Sk
@example(case=Case(batch=2, hq=2, sq=4, sk=2, alibi=((0.25, 1.0), (-1.0, 0.0))))  # per-batch slopes
@example(case=Case(sq=3, sk=1, causal="bottom_right", sinks=(1.5,)))  # masked rows with a sink: O = 0, LSE = sink
@example(case=Case(sq=2, sk=3, sinks=(1e3,), dtype="float32"))  # a dominant sink: O ~ 0
@example(case=Case(hq=2, sq=3, sk=4, mask=("random", False, True, 0.0, 0)))  # an all-False mask: every row empty
# a bias of ~46 cancels ALiBi's -46.5 to a logit of -0.27 that holds its row: the partial sum rounded
# at 46 (torch-tiled fp16, LSE 1.11x a bound that counted the features' net change; H200 lane)
@example(case=Case(hq=7, sq=9, sk=40, d=16, dv=16, causal="top_left", dtype="float16", block_q=16, block_k=32,
                   regime="equal", window=(-1, -1), softcap=1.0, alibi=(0.0,) * 6 + (1.5,),
                   bias=("normal", False, False, 30.0, 38)))
def test_output_matches_dense_float64_with_features(impl, case):
    case = fs.fit(impl, case)
    note(f"features on: {case.features}")
    res = ph.forward(impl, case)
    _compare_all(impl, case, res, ("o", "lse"))


@pytest.mark.requires("features", "backward")
@given(case=fs.cases(features=FEATURES))
@_tile_grid
@example(case=Case(sq=3, sk=4, d=2, softcap=0.5, scale=3.0))  # the tanh's derivative enters dQ and dK
@example(case=Case(hq=2, hkv=1, sq=4, sk=3, sinks=(0.0, -2.0), causal="bottom_right"))  # dsinks, masked rows
@example(case=Case(sq=5, sk=5, window=(1, 0), block_q=2, block_k=2))  # window in the backward
@example(case=Case(hq=2, sq=3, sk=6, alibi=(0.5, -0.25), softcap=2.0, sinks=(0.5, 1.0)))  # all at once
# float64 inputs, float32 sinks: a gradient summed over two sequences' float32 parts is one float32 ulp
# off, which a float64 bound rejected (torch-tiled-varlen, seed sweep)
@example(case=Case(batch=2, sinks=(0.0,)))
def test_gradients_match_analytic_float64_with_features(impl, case):
    case = fs.fit(impl, case)
    note(f"features on: {case.features}")
    res = ph.backward(impl, case)
    _compare_all(impl, case, res, ("dq", "dk", "dv"))
    if case.bias is not None:
        assert res.dbias is not None and res.dbias.shape == case.attn_bias().shape, (
            f"{impl.name}: declares bias but gave no gradient of attn_bias's shape {case.attn_bias().shape}, got "
            f"{None if res.dbias is None else res.dbias.shape}\n  case: {case!r}")
        orc.compare(case, "dbias", res.dbias, who=impl.name)
    if case.sinks is not None:
        assert res.dsinks is not None, f"{impl.name}: declares sinks but gave no gradient for them\n  case: {case!r}"
        orc.compare(case, "dsinks", res.dsinks, who=impl.name)


@pytest.mark.requires("features")
@given(case=fs.cases(features=FEATURES))
@settings(suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])  # rows emptied by a window are rare
def test_rows_that_see_no_key_give_zero_output(impl, case):
    """Also with a sink: the sink takes the whole softmax and contributes no value."""
    case = fs.fit(impl, case)
    rows = ph.masked_rows(case)
    assume(rows.size)
    res = ph.forward(impl, case)
    o = res.o[:, :, rows]
    assert np.all(o == 0), f"{impl.name}: expected O = 0 on rows {rows.tolist()} that see no key\n  case: {case!r}"
    if res.lse is not None:
        # -inf exactly without a sink; with one, the sink's logit (an fp32 kernel may carry it through
        # base 2 and back, so it is held to the oracle's LSE bound, not to bitwise equality)
        got, want = res.lse[:, :, rows], orc.truth(case).lse[:, :, rows]
        bound = orc.allowed(case, "lse")[:, :, rows]
        fin = np.isfinite(want)
        with np.errstate(invalid="ignore"):
            ok = np.where(fin, np.abs(got - want) <= bound, got == want)
        assert ok.all(), (
            f"{impl.name}: expected LSE {'-inf' if case.sinks is None else 'equal to the sink'} on rows that see "
            f"no key, got {got[~ok].ravel()[:5]} where {want[~ok].ravel()[:5]} was expected\n  case: {case!r}")


def _finite_gap(a, b) -> float:
    both = np.isfinite(a) & np.isfinite(b)
    with np.errstate(invalid="ignore"):
        return float(np.abs(np.where(both, a - b, 0.0)).max(initial=0.0))


def _same(impl, case, other, what, drift=None):
    """``impl`` on ``other`` gives what it gives on ``case`` (up to twice the rounding allowed, plus the
    float64 difference ``drift`` of the two problems' truths)."""
    # In Triton's CPU interpreter a backward costs seconds: that lane checks the relations on the
    # forward (its gradients meet every feature in test_gradients_match_analytic_float64_with_features).
    assume(not any(issue.applies(other) for issue in impl.known_issues))  # declared, reported elsewhere
    both = impl.has_backward and "interpreter" not in impl.tags
    names = ph.RESULTS if both else ("o", "lse")
    run = ph.backward if both else ph.forward
    a, b = run(impl, case), run(impl, other)
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            continue
        extra = 0.0 if drift is None else _finite_gap(orc.truth(case)[name], orc.truth(other)[name])
        orc.compare(case, name, y, want=x, budget=2 * orc.allowed(case, name) + extra,
                    who=f"{impl.name} ({what})")


@pytest.mark.requires("window")
@given(case=fs.cases(features=FEATURES))
@example(case=Case(sq=3, sk=5, causal="bottom_right"))
def test_a_window_of_the_full_length_equals_no_window(impl, case):
    case = fs.fit(impl, case.replace(window=None))
    full = case.replace(window=(case.sq + case.sk, case.sq + case.sk))
    _same(impl, case, full, f"window {full.window} vs none")


@pytest.mark.requires("softcap")
@given(case=fs.cases(features=FEATURES))
@example(case=Case(sq=2, sk=3, dtype="float32", regime="large"))
def test_a_softcap_of_1e6_equals_no_softcap(impl, case):
    """1e6 tanh(s / 1e6) = s - s^3 / 3e12 + ...: the truths differ by that much, which is allowed."""
    case = fs.fit(impl, case.replace(softcap=0.0))
    _same(impl, case, case.replace(softcap=1e6), "softcap 1e6 vs none", drift=True)


@pytest.mark.requires("alibi")
@given(case=fs.cases(features=FEATURES), per_batch=st.booleans())
@example(case=Case(sq=3, sk=5), per_batch=False)
def test_zero_slopes_equal_no_alibi(impl, case, per_batch):
    case = fs.fit(impl, case.replace(alibi=None))
    zeros = ((0.0,) * case.hq,) * case.batch if per_batch else (0.0,) * case.hq
    _same(impl, case, case.replace(alibi=zeros), "zero slopes vs none")


@pytest.mark.requires("sinks")
@given(case=fs.cases(features=FEATURES))
@example(case=Case(sq=3, sk=1, causal="bottom_right"))  # rows that see nothing: -inf - (-inf) must not be NaN
def test_a_sink_of_minus_infinity_equals_no_sink(impl, case):
    case = fs.fit(impl, case.replace(sinks=None))
    gone = case.replace(sinks=(-math.inf,) * case.hq)
    _same(impl, case, gone, "sinks -inf vs none")
    if impl.has_backward:
        dsinks = ph.backward(impl, gone).dsinks
        assert dsinks is not None and np.array_equal(dsinks, np.zeros(case.hq)), (
            f"{impl.name}: a sink of -inf takes no probability, so its gradient must be 0, got {dsinks}\n"
            f"  case: {gone!r}")


@pytest.mark.requires("mask", "causal")
@given(case=fs.cases(features=FEATURES), per_batch=st.booleans(), per_head=st.booleans())
@example(case=Case(hq=2, sq=5, sk=3, causal="bottom_right"), per_batch=False, per_head=True)  # masked rows
def test_a_mask_equal_to_the_causal_mask_equals_causal(impl, case, per_batch, per_head):
    case = fs.fit(impl, case.replace(mask=None))
    case = case if case.causal else fs.fit(impl, case.replace(causal=impl.causal[0]))
    assume(case.causal and case.mask is None)
    tensor = case.replace(causal=None, mask=("causal", per_batch, per_head, int(case.causal == "bottom_right"), 0))
    assume(tensor == fs.fit(impl, tensor))  # e.g. a kernel whose non-causal mode takes no masked rows
    _same(impl, case, tensor, f"attn_mask = the {case.causal} causal mask vs causal={case.causal!r}")


@pytest.mark.requires("mask")
@given(case=fs.cases(features=FEATURES), per_batch=st.booleans(), per_head=st.booleans())
@example(case=Case(batch=2, hq=2, sq=3, sk=5), per_batch=True, per_head=True)
def test_an_all_true_mask_equals_no_mask(impl, case, per_batch, per_head):
    case = fs.fit(impl, case.replace(mask=None))
    _same(impl, case, case.replace(mask=("random", per_batch, per_head, 1.0, 0)), "an all-True attn_mask vs none")


@pytest.mark.requires("bias")
@given(case=fs.cases(features=FEATURES), per_batch=st.booleans(), per_head=st.booleans())
@example(case=Case(batch=2, hq=2, sq=3, sk=5), per_batch=True, per_head=False)
def test_a_zero_bias_equals_no_bias(impl, case, per_batch, per_head):
    case = fs.fit(impl, case.replace(bias=None))
    _same(impl, case, case.replace(bias=("normal", per_batch, per_head, 0.0, 0)), "a zero attn_bias vs none")


@pytest.mark.requires("alibi")
@given(case=fs.cases(causal="none", features=("alibi", "softcap")), extra=st.integers(1, 8))
@example(case=Case(sq=3, sk=2, alibi=(0.5,)), extra=1)
def test_shifting_alibi_distances_leaves_rows_whose_keys_lie_on_one_side_unchanged(impl, case, extra):
    """Appending query rows moves the diagonal i + Sk - Sq left by ``extra``: a row with every key at
    or right of its diagonal (i <= Sq - Sk) sees every distance grow by ``extra``, a constant per
    row that softmax ignores; its LSE moves by exactly -slope * extra."""
    case = fs.fit(impl, case.replace(sq=max(case.sq, case.sk), window=None, sinks=None))
    case = case if case.alibi is not None else case.replace(alibi=(0.5,) * case.hq)
    assume(case.sq >= case.sk)
    q, k, v, _ = case.inputs()
    more = np.concatenate([q, fs.quantize(np.random.default_rng(extra).standard_normal(q.shape[:2] + (extra,) +
                                                                                         q.shape[3:]), case.dtype)], 2)
    rows = np.arange(case.sq - case.sk + 1)
    note(f"rows compared: {rows.tolist()}, {extra} query rows appended")
    kw = case.reference_kwargs()
    drift = _finite_gap(reference.dense_forward(more, k, v, **kw)[0][:, :, rows],
                        reference.dense_forward(q, k, v, **kw)[0][:, :, rows])
    base, moved = ph.forward(impl, case), ph.forward(impl, case, q=more)
    budget = 4 * orc.allowed(case, "o")[:, :, rows] + drift
    orc.compare(case, "o", moved.o[:, :, rows], want=base.o[:, :, rows], budget=budget,
                who=f"{impl.name} (ALiBi distances + {extra})")
    if base.lse is not None:
        slopes = np.broadcast_to(case.alibi_slopes().astype(np.float64), (case.batch, case.hq))[:, :, None]
        want = base.lse[:, :, rows] - slopes * extra
        orc.compare(case, "lse", moved.lse[:, :, rows], want=want, budget=4 * orc.allowed(case, "lse")[:, :, rows] +
                    4 * orc.EPS["float32"] * np.abs(slopes * (case.sk + extra)).max(),
                    who=f"{impl.name} (LSE with ALiBi distances + {extra})")


MALFORMED = [  # (feature, keyword, bad value: a callable of (framework array maker) -> value)
    ("window", "window", lambda arr: (1,)),
    ("window", "window", lambda arr: (-2, 0)),
    ("softcap", "softcap", lambda arr: -1.0),
    ("alibi", "alibi_slopes", lambda arr: arr(np.ones(3, np.float32))),
    ("sinks", "sinks", lambda arr: arr(np.ones((1, 2), np.float32))),
    ("dropout", "dropout_p", lambda arr: 1.0),
    ("mask", "attn_mask", lambda arr: arr(np.ones((1, 1, 2, 4), bool))),  # Sk is 3
    ("mask", "attn_mask", lambda arr: arr(np.ones((1, 1, 2, 3), np.float32))),  # not bool
    ("bias", "attn_bias", lambda arr: arr(np.zeros((1, 3, 2, 3), np.float32))),  # 3 heads of 2
]


@pytest.mark.requires("dense")
@pytest.mark.parametrize("feature, keyword, bad", MALFORMED, ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(MALFORMED)])
def test_a_malformed_feature_argument_raises_an_error_naming_it(impl, feature, keyword, bad):
    if not getattr(impl, feature):
        pytest.skip(f"{impl.name} does not declare {feature}")
    case = fs.fit(impl, Case(hq=2, sq=2, sk=3, d=2, dv=2, dtype="float32"))
    q, k, v, _ = case.inputs()
    if impl.framework == "numpy":
        arr, args = np.asarray, tuple(x.astype(case.dtype) for x in (q, k, v))
    else:
        import torch

        device = call.device_for(impl)
        arr = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        args = tuple(torch.from_numpy(x).to(device=device, dtype=getattr(torch, case.dtype)) for x in (q, k, v))
    kw = call.kwargs_for(impl, case, tensor=arr)
    kw[keyword] = bad(arr)
    with pytest.raises((ValueError, TypeError), match=keyword):
        impl.fn(*args, **kw)
