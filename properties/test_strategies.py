"""The strategies can reach every region they promise, and cases replay bit for bit."""
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, find, given, settings
from hypothesis import strategies as st

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties

SEARCH = settings(max_examples=3000, database=None, suppress_health_check=list(HealthCheck))

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
    "batch > 1": lambda c: c.batch > 1,
    "bottom-right causal": lambda c: c.causal == "bottom_right",
    "top-left causal": lambda c: c.causal == "top_left",
    "fully masked rows": lambda c: c.has_masked_rows,
    "keys nobody sees": lambda c: c.has_masked_keys,
    "scale None": lambda c: c.scale is None,
    "scale 0.0": lambda c: c.scale == 0.0,
    "tiny scale": lambda c: c.scale is not None and 0 < c.scale <= 1e-6,
    "large scale": lambda c: c.scale is not None and c.scale >= 30,
    **{f"dtype {t}": (lambda t: lambda c: c.dtype == t)(t) for t in ("float64", "float32", "float16", "bfloat16")},
    **{f"regime {r}": (lambda r: lambda c: c.regime == r)(r) for r in fs.REGIMES},
}


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_cases_can_reach(region):
    found = find(fs.cases(dtypes=fs.draw.DEFAULT_DTYPES), REGIONS[region], settings=SEARCH)
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


@given(st.data())
def test_fit_is_idempotent_and_stays_within_declarations(data):
    from flashcheck.impls import builtins

    impl = data.draw(st.sampled_from(builtins()), label="impl")
    case = fs.fit(impl, data.draw(fs.cases(), label="case"))
    assert fs.fit(impl, case) == case
    assert case.dtype in impl.dtypes
    assert case.causal is None or case.causal in impl.causal
    if isinstance(impl.blocks, tuple):
        assert case.block_q in impl.blocks and case.block_k in impl.blocks


def test_shrinking_reaches_the_plainest_case():
    """With a property that always fails, the shrinker must end at the minimal case."""
    assert find(fs.cases(dtypes=fs.draw.DEFAULT_DTYPES), lambda c: True, settings=SEARCH) == Case(block_q=1, block_k=1)


def test_oracle_floor_admits_an_exact_answer_when_dense_error_is_zero():
    case = Case(sk=1, dtype="float16")
    orc.compare(case, "o", orc.truth(case).o)


@given(case=fs.cases(masked_keys=True))
def test_masked_keys_strategy_draws_only_cases_with_keys_nobody_sees(case):
    assert case.has_masked_keys, f"expected keys no query sees, drew {case!r}"
