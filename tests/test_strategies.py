"""The strategies can reach every region they promise, and cases replay bit for bit."""
import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, find, given, settings
from hypothesis import strategies as st

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.properties import helpers as ph
from flashcheck.properties import test_forward as forward_props  # its helpers, tested here
from flashcheck.oracle.rounding import HALF
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import context

pytestmark = [pytest.mark.properties, ph.CPU_PROFILES_ONLY]

SEARCH = settings(max_examples=3000, database=None, derandomize=True,  # the same search in every profile
                  suppress_health_check=list(HealthCheck))
FIRST_FOUND = settings(SEARCH, phases=[Phase.generate])  # reached is all that is asked: no shrinking

REGIONS = {
    "Sq = Sk = 1": lambda c: c.sq == 1 and c.sk == 1,
    "Sq > Sk": lambda c: c.sq > c.sk,
    "Sq < Sk": lambda c: c.sq < c.sk,
    "prime lengths": lambda c: c.sq in (13, 17, 19, 23, 29, 31, 37) and c.sk in (13, 17, 19, 23, 29, 31, 37),
    "Sk = block_k - 1": lambda c: c.block_k >= 16 and c.sk == c.block_k - 1,
    "Sk = block_k": lambda c: c.block_k >= 16 and c.sk == c.block_k,
    "Sk = block_k + 1": lambda c: c.block_k >= 16 and c.sk == c.block_k + 1,
    "block larger than the sequence": lambda c: c.block_q > c.sq and c.block_k > c.sk,
    "block that does not divide": lambda c: c.sk > c.block_k > 1 and c.sk % c.block_k,
    "D = 1": lambda c: c.d == 1,
    "D not a power of two": lambda c: c.d > 8 and c.d & (c.d - 1),
    "Dv != D": lambda c: c.dv != c.d,
    "GQA": lambda c: c.hq > c.hkv > 1,
    "MQA": lambda c: c.hkv == 1 and c.hq > 1,
    "a wide GQA group": lambda c: c.hq // c.hkv in (5, 6, 7, 8, 16) and c.hq // c.hkv > 3,
    "batch > 1": lambda c: c.batch > 1,
    "bottom-right causal": lambda c: c.causal == "bottom_right",
    "top-left causal": lambda c: c.causal == "top_left",
    "fully masked rows": lambda c: c.has_masked_rows,
    "keys nobody sees": lambda c: c.has_masked_keys,
    "scale None": lambda c: c.scale is None,
    "scale 0.0": lambda c: c.scale == 0.0,
    "tiny scale": lambda c: c.scale is not None and 0 < c.scale <= 1e-6,
    "large scale": lambda c: c.scale is not None and c.scale >= 30,
    **{f"dtype {t}": (lambda t: lambda c: c.dtype == t)(t) for t in fs.draw.DEFAULT_DTYPES},
    **{f"regime {r}": (lambda r: lambda c: c.regime == r)(r) for r in fs.REGIMES},
}


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_cases_can_reach(region):
    found = find(fs.cases(dtypes=fs.draw.DEFAULT_DTYPES), REGIONS[region], settings=FIRST_FOUND)
    assert REGIONS[region](found)


@given(case=fs.cases(masked_rows=True))
def test_masked_rows_strategy_draws_only_cases_with_masked_rows(case):
    assert case.has_masked_rows, f"expected rows that see no key, drew {case!r}"


def reachable(case):
    """float16 inputs cannot grow large enough for extreme logits under a tiny scale."""
    return case.effective_scale != 0 and not (case.dtype == "float16" and case.effective_scale < 1e-3)


def _scaled_logits(case):
    q, k, _, _ = case.inputs()
    kk = np.repeat(k, case.hq // case.hkv, axis=1)
    return case.effective_scale * (q @ np.swapaxes(kk, -1, -2))


@given(case=fs.cases(regimes=("large",)))
def test_large_regime_overflows_exp_without_max_subtraction(case):
    assume(reachable(case))
    peak = np.abs(_scaled_logits(case)).max()
    assert peak > fs.OVERFLOW_LOG[case.dtype], f"largest |logit| {peak} should pass {fs.OVERFLOW_LOG[case.dtype]}"


@given(case=fs.cases(regimes=("negative",)))
def test_negative_regime_puts_every_logit_far_below_zero(case):
    assume(reachable(case))
    top = _scaled_logits(case).max()
    assert top < -fs.OVERFLOW_LOG[case.dtype], f"largest logit {top} should be below -{fs.OVERFLOW_LOG[case.dtype]}"


@given(case=fs.cases(regimes=("equal",)))
def test_equal_regime_gives_every_key_the_same_score(case):
    s = _scaled_logits(case)
    assert np.allclose(s, s[..., :1], rtol=1e-12, atol=0), "expected identical scores along every row"


@given(case=fs.cases(regimes=("dominant",)))
def test_dominant_regime_has_one_key_far_ahead(case):
    assume(reachable(case) and case.sk >= 2)
    s = np.sort(_scaled_logits(case), axis=-1)
    gap = (s[..., -1] - s[..., -2]).min()
    assert gap > 0.2 * fs.OVERFLOW_LOG[case.dtype], f"expected one key well ahead, smallest gap {gap}"


@given(case=fs.cases())
def test_inputs_are_exact_in_the_case_dtype_and_replay_bit_for_bit(case):
    first = case.inputs()
    again = eval(repr(case), {"AttentionCase": Case}).inputs()  # the printed case is the reproducer
    for x, y in zip(first, again):
        assert np.array_equal(x, y), "replaying the printed case gave different inputs"
        assert np.array_equal(x, fs.quantize(x, case.dtype)), f"inputs are not representable in {case.dtype}"
        assert np.isfinite(x).all(), "inputs must be finite"


def _declared():
    """Built-ins, the examples, and one kernel that declares every limit at once."""
    from flashcheck.contract import builtins, implementation, load

    narrow = implementation(name="narrow", causal="bottom_right", causal_only=True, head_dims=range(4, 33, 4),
                            min_seq=3, max_seq=20, seq_multiple=3, gqa=False, blocks=(16, 32), masked_rows=False,
                            scale_arg=False, supports=lambda c: c.hq <= 2 or "at most two heads",
                            register=False)(lambda q, k, v, **_: q)
    return [*builtins(), load("examples/sdpa_causal_only.py:attention"), load("examples/strict_plugin.py:attention"),
            load("mutants/fixed_tiles.py:correct"), narrow.__flashcheck__]


@given(st.data())
def test_fit_is_idempotent_and_stays_within_declarations(data):
    impl = data.draw(st.sampled_from(_declared()), label="impl")
    case = fs.fit(impl, data.draw(fs.cases(), label="case"))
    assert fs.fit(impl, case) == case
    assert case.dtype in impl.dtypes
    assert case.causal is None or case.causal in impl.causal
    if isinstance(impl.blocks, tuple):
        assert case.block_q in impl.blocks and case.block_k in impl.blocks
    assert impl.tiles is None or (case.block_q, case.block_k) == impl.tiles, f"{impl.name} runs its tiles: {case!r}"
    assert case.causal is not None or not impl.causal_only, f"{impl.name} is causal_only, drew {case!r}"
    assert impl.head_dim_ok(case.d) and impl.head_dim_ok(case.dv), f"{impl.name}: head dims of {case!r}"
    for n in (case.sq, case.sk):
        assert impl.min_seq <= n <= (impl.max_seq or n) and n % impl.seq_multiple == 0, f"{impl.name}: {case!r}"
    assert case.sq == case.sk or not impl.equal_lengths
    assert case.scale is None or impl.scale_arg
    assert impl.unsupported(case) is None, f"{impl.name} does not support {case!r}"


PLAIN = Case(block_q=1, block_k=1)  # what every field shrinks to when a failure does not need it
# A failure that needs one feature must shrink to the plainest case that has it and to nothing more.
NEEDS = {
    "three keys": (lambda c: c.sk >= 3, PLAIN.replace(sk=3)),
    "more queries than keys": (lambda c: c.sq > c.sk, PLAIN.replace(sq=2)),
    "top-left causal": (lambda c: c.causal == "top_left", PLAIN.replace(causal="top_left")),
    "GQA": (lambda c: c.hq > c.hkv, PLAIN.replace(hq=2)),
    "Dv != D": (lambda c: c.dv != c.d, PLAIN.replace(dv=2)),
    "a custom scale": (lambda c: c.scale is not None, PLAIN.replace(scale=0.0)),
    "float16": (lambda c: c.dtype == "float16", PLAIN.replace(dtype="float16")),
    "large logits": (lambda c: c.regime == "large", PLAIN.replace(regime="large")),
    "a second batch": (lambda c: c.batch == 2, PLAIN.replace(batch=2)),
    "a key block of at least 3": (lambda c: c.block_k >= 3, PLAIN.replace(block_k=3)),
}


@pytest.mark.parametrize("need", sorted(NEEDS))
def test_shrinking_keeps_only_what_the_failure_needs(need):
    fails, plainest = NEEDS[need]
    assert find(fs.cases(dtypes=fs.draw.DEFAULT_DTYPES), fails, settings=SEARCH) == plainest


def test_the_shrinking_check_sees_a_field_that_does_not_shrink():
    stuck = st.builds(lambda c, b: c.replace(block_k=b), fs.cases(dtypes=fs.draw.DEFAULT_DTYPES),
                      st.sampled_from((64, 1)))  # 64 first: a block that cannot shrink below it
    fails, plainest = NEEDS["three keys"]
    assert find(stuck, fails, settings=SEARCH) != plainest


def test_a_per_tile_bug_shrinks_to_the_smallest_tile_that_shows_it():
    """The mutant whose causal mask is decided per key tile, through the real property, no pins:
    a tile of 2 keys is the smallest that shows it, and that is where shrinking must end."""
    import re

    from mutants import tiled
    from flashcheck.properties import test_forward

    inner = test_forward.test_output_matches_dense_float64.hypothesis.inner_test
    prop = settings(phases=[Phase.generate, Phase.shrink], database=None, derandomize=True,
                    max_examples=25)(given(case=fs.cases())(inner))
    with pytest.raises(AssertionError) as info:
        prop(impl=tiled.causal_per_tile.__flashcheck__)
    shrunk = eval(re.findall(r"case: (AttentionCase\([^)]*\))", str(info.value))[-1], {"AttentionCase": Case})
    # the smallest tile that shows it: 2 keys in one key tile, or 2 rows in one query tile
    assert (shrunk.block_k, shrunk.sk) == (2, 2) or (shrunk.block_q, shrunk.sq) == (2, 2), (
        f"expected a tile of 2 keys over 2 keys or of 2 rows over 2 rows, shrank to {shrunk!r}")


@st.composite
def masks(draw):
    """A band (a causal diagonal, a window of any width, rows that see nothing) or any mask."""
    sq, sk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    if draw(st.booleans()):
        right = draw(st.integers(-sq - 1, sk + 1))
        return (j <= i + right) & (j >= i + right - draw(st.integers(0, sk + 1)))
    return np.array(draw(st.lists(st.lists(st.booleans(), min_size=sk, max_size=sk), min_size=sq, max_size=sq)))


@given(vis=masks(), seed=st.integers(0, 2**32 - 1))
def test_the_visible_range_from_runs_equals_the_one_from_the_mask(vis, seed):
    """test_forward's min and max over each row's keys: the table of runs (bands) gives what the
    masked comparison gives, and any other mask takes the masked comparison."""
    v = np.random.default_rng(seed).standard_normal((2, 3, vis.shape[1], 5))
    fast, slow = forward_props._visible_range(vis, v), forward_props._masked_range(vis, v)
    for name, a, b in zip(("min", "max"), fast, slow):
        assert np.array_equal(a, b), f"expected the masked {name} per row, got another at {np.argwhere(a != b)[:3]}"


def test_oracle_floor_admits_an_exact_answer_when_dense_error_is_zero():
    case = Case(sk=1, dtype="float16")
    orc.compare(case, "o", orc.truth(case).o)


@given(case=fs.cases(masked_keys=True))
def test_masked_keys_strategy_draws_only_cases_with_keys_nobody_sees(case):
    assert case.has_masked_keys, f"expected keys no query sees, drew {case!r}"


def _sample(strategy, n=200):
    seen = []

    @settings(max_examples=n, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        seen.append(case)

    collect()
    return seen


def test_declared_tiles_draw_lengths_around_their_multiples(monkeypatch):
    from flashcheck.contract import implementation

    impl = implementation(name="tiled", tiles=(32, 48), dtypes=("float64",), register=False)(
        lambda q, k, v, **_: q).__flashcheck__
    monkeypatch.setattr(context, "current", lambda: context.Test(impl=impl))
    fitted = fs.cases(dtypes=("float64",)).map(lambda c: fs.draw.within(impl, c))
    for name, tile in (("sq", 32), ("sk", 48)):
        for n in (tile - 1, tile, tile + 1, 2 * tile):
            found = find(fitted, lambda c: getattr(c, name) == n, settings=FIRST_FOUND)
            assert (found.block_q, found.block_k) == (32, 48), f"a case must show the kernel's tiles: {found!r}"
            assert found.batch == 1 or max(found.sq, found.sk) <= fs.limits()["seq"], f"too costly: {found!r}"


@functools.cache
def _default_sample():
    """200 draws of the default strategy, shared by the tests that read its distribution."""
    return _sample(fs.cases(dtypes=fs.draw.DEFAULT_DTYPES))


def test_lengths_around_common_tile_sizes_are_drawn_without_a_declaration():
    within_budget = {n for t in fs.draw.TILE_SIZES for n in (t - 1, t, t + 1) if n <= fs.limits()["seq"]}
    seen = {c.sk for c in _default_sample() if c.dtype not in HALF}
    assert within_budget <= seen, f"expected every length around a common tile size, missing {within_budget - seen}"
    assert max(seen) <= fs.limits()["seq"], "without declared tiles lengths stay within the profile's budget"


def test_trivial_one_by_one_cases_are_a_small_minority():
    seen = _default_sample()
    trivial = sum(c.sq == c.sk == 1 for c in seen)
    assert trivial <= 0.1 * len(seen), f"expected at most 10% Sq = Sk = 1 cases, drew {trivial} of {len(seen)}"


def test_long_half_precision_region_is_drawn_and_only_in_half_precision():
    seen = _default_sample()
    long = [c for c in seen if max(c.sq, c.sk) > fs.limits()["seq"]]
    assert len(long) >= 3, f"expected the long region among 200 draws, got {len(long)}"
    assert all(c.dtype in HALF for c in long), "long cases must be fp16 or bf16"
    assert max(max(c.sq, c.sk) for c in long) >= 1024, "the long region should reach 1024 and beyond"
    assert not any(max(c.sq, c.sk) > fs.limits()["seq"] for c in _sample(fs.cases(dtypes=("float32",)), 60))


def test_long_region_reaches_2048():
    found = find(fs.draw.long_cases(HALF), lambda c: max(c.sq, c.sk) == 2048, settings=SEARCH)
    assert max(found.sq, found.sk) == 2048


def test_every_numeric_property_pins_every_dtype_and_regime_pair():
    from flashcheck.properties import test_backward, test_forward, test_invariance

    numeric = [test_forward.test_output_matches_dense_float64, test_forward.test_lse_is_natural_log_sum_exp_of_scaled_logits,
               test_forward.test_output_lies_within_the_visible_values, test_backward.test_gradients_match_analytic_float64,
               *[getattr(test_invariance, n) for n in dir(test_invariance) if n.startswith("test_")]]
    for test in numeric:
        pinned = {(e.kwargs["case"].dtype, e.kwargs["case"].regime) for e in test.hypothesis_explicit_examples}
        missing = {(t, r) for t in fs.draw.DEFAULT_DTYPES for r in fs.REGIMES} - pinned
        assert not missing, f"{test.__name__}: no pin for {sorted(missing)[:4]}"


def test_a_long_case_is_not_drawn_for_a_kernel_without_half_precision():
    from hypothesis.errors import UnsatisfiedAssumption

    from flashcheck.contract import builtins

    impl = {i.name: i for i in builtins()}["numpy-tiled"]  # float32 and float64 only

    @given(st.just(Case(sq=2048, sk=2048, dtype="float16")))
    def fit_long(case):
        fs.fit(impl, case)

    with pytest.raises((UnsatisfiedAssumption, Exception)) as info:
        fit_long()
    assert "Unsatisfiable" in type(info.value).__name__ or isinstance(info.value, UnsatisfiedAssumption), info.value
