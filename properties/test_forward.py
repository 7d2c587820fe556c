"""Forward results match dense float64 attention, and the semantics' edge cases hold exactly."""
import numpy as np
import pytest
from hypothesis import assume, example, given, note

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties


@pytest.mark.requires("independent")
@given(case=fs.cases())
@ph.every_dtype_and_regime(long=True)
@example(case=Case())  # one query, one key: the smallest problem there is
@example(case=Case(sk=2, block_k=1, dtype="float32"))  # two key tiles: the rescale runs once
@example(case=Case(sq=17, sk=17, d=16, dv=16, block_q=16, block_k=16))  # one past a whole tile
@example(case=Case(sq=5, sk=9, causal="bottom_right", block_q=2, block_k=4))  # Sq < Sk, bottom-right
@example(case=Case(sq=9, sk=5, causal="bottom_right", block_q=4, block_k=2))  # Sq > Sk: masked rows
@example(case=Case(sq=6, sk=6, causal="top_left", block_q=3, block_k=3))  # the diagonal inside a tile
@example(case=Case(sq=3, sk=4, d=7, scale=0.0))  # scale 0: uniform weights
@example(case=Case(sq=4, sk=6, d=3, dtype="float32", regime="large"))  # overflow without max subtraction
@example(case=Case(sq=4, sk=6, d=3, dtype="float32", regime="negative"))  # underflow without max subtraction
@example(case=Case(hq=4, hkv=2, sq=3, sk=3, d=2))  # GQA
def test_output_matches_dense_float64(impl, case):
    case = fs.fit(impl, case)
    res = ph.forward(impl, case)
    assert res.dtype == case.dtype, (
        f"{impl.name}: expected output dtype {case.dtype}, got {res.dtype}\n  case: {case!r}")
    orc.compare(case, "o", res.o, who=impl.name)


@pytest.mark.requires("lse", "independent")
@given(case=fs.cases())
@ph.every_dtype_and_regime(long=True)
@example(case=Case(sk=2, block_k=1))  # two key tiles: the LSE merges across them
@example(case=Case(sq=3, sk=1, causal="bottom_right"))  # rows 0 and 1 see nothing: LSE = -inf
@example(case=Case(sq=2, sk=2, d=4, regime="large", dtype="float32"))  # LSE near the overflow point
def test_lse_is_natural_log_sum_exp_of_scaled_logits(impl, case):
    case = fs.fit(impl, case)
    res = ph.forward(impl, case)
    want = orc.result_dtype(case.dtype, "lse")
    assert res.lse_dtype == want, f"{impl.name}: expected LSE in {want}, got {res.lse_dtype}\n  case: {case!r}"
    orc.compare(case, "lse", res.lse, who=impl.name)


@pytest.mark.requires("masked_rows")
@given(case=fs.cases(masked_rows=True))
@example(case=Case(sq=2, sk=1, causal="bottom_right"))
def test_rows_that_see_no_key_give_zero_and_minus_inf(impl, case):
    case = fs.fit(impl, case)
    rows = ph.masked_rows(case)
    assume(rows.size)  # fitting may have removed them (e.g. max_seq): nothing to test then
    note(f"masked rows: {rows.tolist()}")
    res = ph.forward(impl, case)
    o = res.o[:, :, rows]
    assert np.all(o == 0), (
        f"{impl.name}: expected O = 0 on rows {rows.tolist()} that see no key, got {o[o != 0][:5]}\n  case: {case!r}")
    if res.lse is not None:
        lse = res.lse[:, :, rows]
        assert np.all(lse == -np.inf), (
            f"{impl.name}: expected LSE = -inf on masked rows, got {lse[lse != -np.inf][:5]}\n  case: {case!r}")
    assert np.isfinite(res.o).all(), f"{impl.name}: non-finite output elsewhere\n  case: {case!r}"


def _visible_range(vis, v):
    """Per row, the least and the greatest value among the keys it sees (0 where it sees none), for
    v (B, H, Sk, Dv) and vis (Sq, Sk): (B, H, Sq, Dv) each. Rows that each see one run of keys (every
    band: causal, a window) take it from a table of runs; other masks go row set by row set."""
    sees = vis.any(axis=1)
    first = np.argmax(vis, axis=1)
    last = vis.shape[1] - 1 - np.argmax(vis[:, ::-1], axis=1)
    if np.array_equal(vis.sum(axis=1), np.where(sees, last - first + 1, 0)):
        return _run_range(first, last, sees, v)
    return _masked_range(vis, v)


def _run_range(first, last, sees, v):
    """Min and max over keys first..last of each row, from the min and max of every run of 2^j keys
    (a sparse table): two overlapping runs of the same length cover each row's run."""
    tables = [(v, v)]
    while 2 ** len(tables) <= v.shape[2]:
        k = 2 ** (len(tables) - 1)
        lo, hi = tables[-1]
        tables.append((np.minimum(lo[:, :, :-k], lo[:, :, k:]), np.maximum(hi[:, :, :-k], hi[:, :, k:])))
    b, h, _, dv = v.shape
    out_lo, out_hi = np.zeros((b, h, len(first), dv)), np.zeros((b, h, len(first), dv))
    level = np.frexp(np.maximum(last - first + 1, 1))[1] - 1  # floor(log2(run length)), exactly
    for j in np.unique(level[sees]):
        rows = np.flatnonzero(sees & (level == j))
        a, z = first[rows], last[rows] - 2 ** j + 1
        lo, hi = tables[j]
        out_lo[:, :, rows] = np.minimum(lo[:, :, a], lo[:, :, z])
        out_hi[:, :, rows] = np.maximum(hi[:, :, a], hi[:, :, z])
    return out_lo, out_hi


def _masked_range(vis, v):
    """_visible_range for any mask. Rows that see the same keys share one computation, the others go
    in chunks: all (Sq, Sk, Dv) comparisons at once held gigabytes."""
    rows, which = np.unique(vis, axis=0, return_inverse=True)
    b, h, sk, dv = v.shape
    lo, hi = np.zeros((b, h, len(rows), dv)), np.zeros((b, h, len(rows), dv))
    seen = np.flatnonzero(rows.any(axis=1))
    step = max(1, (1 << 22) // (b * h * sk * dv))  # rows per chunk: about 32 MB of float64
    for at in range(0, len(seen), step):
        some = seen[at:at + step]
        sees = rows[some][None, None, :, :, None]  # (1, 1, n, Sk, 1)
        lo[:, :, some] = np.where(sees, v[:, :, None], np.inf).min(axis=3)
        hi[:, :, some] = np.where(sees, v[:, :, None], -np.inf).max(axis=3)
    which = which.reshape(-1)
    return lo[:, :, which], hi[:, :, which]


@given(case=fs.cases())
@ph.every_dtype_and_regime()
def test_output_lies_within_the_visible_values(impl, case):
    """Each output is a convex combination of the values its row sees."""
    if ph.slow_pin(impl, case):
        return
    case = fs.fit(impl, case)
    _, _, v, _ = case.inputs()
    res = ph.forward(impl, case)
    lo, hi = (ph.kv_heads(case, x) for x in _visible_range(case.visible(), v))
    slack = np.broadcast_to(orc.allowed(case, "o"), res.o.shape)  # per entry: an array, or one number
    with np.errstate(invalid="ignore"):  # NaN output: outside every range, and named below
        outside = np.nan_to_num(np.maximum(lo - res.o, res.o - hi) - slack, nan=np.inf)
    idx = tuple(int(i) for i in np.unravel_index(np.argmax(outside), outside.shape))
    assert outside[idx] <= 0, (
        f"{impl.name}: o[{', '.join(map(str, idx))}] = {float(res.o[idx])!r} lies outside [min, max] = "
        f"[{float(lo[idx])!r}, {float(hi[idx])!r}] of the values its row sees, by {outside[idx]:.3e} beyond "
        f"the slack {slack[idx]:.3e}; {int((outside > 0).sum())} of {outside.size} entries outside\n  case: {case!r}")


@given(case=fs.cases(regimes=("equal",)))
@ph.every_dtype_and_regime(regimes=("equal",))
@example(case=Case(sq=3, sk=5, causal="bottom_right", regime="equal"))
def test_uniform_scores_give_the_mean_of_visible_values(impl, case):
    if ph.slow_pin(impl, case):
        return
    case = fs.fit(impl, case)
    _, _, v, _ = case.inputs()
    vis = case.visible().astype(float)
    counts = vis.sum(axis=1, keepdims=True)
    weights = np.divide(vis, counts, out=np.zeros_like(vis), where=counts > 0)
    want = weights @ ph.kv_heads(case, v)
    res = ph.forward(impl, case)
    orc.compare(case, "o", res.o, want=want, who=f"{impl.name} (mean of visible values)")
