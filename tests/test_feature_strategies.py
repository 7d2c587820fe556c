"""The feature strategies reach every region the issue names, shrink to "off", and are fitted
off for implementations that do not declare them."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import strategies as st

from flashcheck import strategies as fs
from flashcheck import implementation
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies.features import DROPOUTS, geometric_slopes

pytestmark = [pytest.mark.properties, ph.CPU_PROFILES_ONLY]

SEARCH = settings(max_examples=3000, database=None, derandomize=True,  # the same search in every profile
                  suppress_health_check=list(HealthCheck))


def _empty_rows(c):
    return c.window is not None and not c.visible().any(axis=-1).all()


def _slopes(c):
    return np.array(c.alibi, dtype=float).ravel() if c.alibi is not None else np.zeros(0)


REGIONS = {
    "window 0 on the left": lambda c: c.window is not None and c.window[0] == 0,
    "window 0 on the right": lambda c: c.window is not None and c.window[1] == 0,
    "window wider than the sequence": lambda c: c.window is not None and min(c.window) > max(c.sq, c.sk),
    "window that empties rows": _empty_rows,
    "window asymmetric": lambda c: c.window is not None and min(c.window) >= 0 and c.window[0] != c.window[1],
    "window with causal": lambda c: c.window is not None and c.causal is not None,
    "softcap tiny (saturating)": lambda c: 0 < c.softcap <= 1e-3,
    "softcap huge (identity)": lambda c: c.softcap >= 1e6,
    "softcap in between": lambda c: 0.1 < c.softcap < 100,
    "slopes geometric": lambda c: c.alibi is not None and c.hq > 1 and tuple(c.alibi) == geometric_slopes(c.hq),
    "slopes random, both signs": lambda c: (_slopes(c) > 0).any() and (_slopes(c) < 0).any(),
    "slopes per batch and head": lambda c: c.alibi is not None and c.batch > 1 and np.ndim(c.alibi) == 2,
    "ALiBi with Sq != Sk": lambda c: c.alibi is not None and c.sq != c.sk,
    "sinks -inf-like": lambda c: c.sinks is not None and min(c.sinks) <= -1e30,
    "sinks dominant": lambda c: c.sinks is not None and max(c.sinks) >= 1e3,
    "sinks with masked rows": lambda c: c.sinks is not None and not c.visible().any(axis=-1).all(),
    "mask all False": lambda c: c.mask is not None and not c.attn_mask().any(),
    "mask that empties some rows": lambda c: c.mask is not None and c.sq > 1 and 0 < c.visible().any(-1).mean() < 1,
    "mask shared by every batch entry and head": lambda c: c.mask is not None and c.attn_mask().shape[:2] == (1, 1)
    and c.batch * c.hq > 1,
    "mask per batch entry and head": lambda c: c.mask is not None and c.attn_mask().shape[:2] == (c.batch, c.hq)
    and c.batch > 1 and c.hq > 1,
    "mask band": lambda c: c.mask is not None and c.mask[0] == "band" and c.sk > 2 * c.mask[3] + 1,
    "mask equal to a causal mask": lambda c: c.mask is not None and c.mask[0] == "causal",
    "mask with a window and causal": lambda c: c.mask is not None and c.window is not None and c.causal is not None,
    "bias with -inf entries": lambda c: c.bias is not None and np.isneginf(c.attn_bias()).any(),
    "bias whose -inf entries empty a row": lambda c: c.bias is not None and not c.visible().any(-1).all(),
    "bias with finfo.min entries": lambda c: c.bias is not None and c.bias[0] == "min" and c.bias[3] < 1,
    "bias all finfo.min (uniform rows)": lambda c: c.bias is not None and c.bias[0] == "min" and c.bias[3] == 1,
    "bias per batch entry and head": lambda c: c.bias is not None and c.attn_bias().shape[:2] == (c.batch, c.hq)
    and c.batch > 1 and c.hq > 1,
    "bias logit-sized": lambda c: c.bias is not None and c.bias[0] == "normal" and c.bias[3] >= 30,
    "bias with a mask": lambda c: c.bias is not None and c.mask is not None,
    **{f"dropout {p}": (lambda p: lambda c: c.dropout_p == p)(p) for p in DROPOUTS},
    # seven features on at once is one draw in 128: some runs' 3000 draws (CI's, 2026-12-02) held none
    "every feature but at most one at once": lambda c: len(c.features) >= len(fs.FEATURES) - 1,
    "GQA with features": lambda c: c.hq > c.hkv and len(c.features) >= 2,
}


class _Found(Exception):
    pass


def reach(strategy, predicate):
    """The first drawn example that satisfies ``predicate`` (``find`` without shrinking, which is slow)."""
    found = []

    @settings(SEARCH, phases=[Phase.generate])
    @given(strategy)
    def search(case):
        if predicate(case):
            found.append(case)
            raise _Found

    try:
        search()
    except _Found:
        return found[0]
    return None


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_feature_cases_can_reach(region):
    found = reach(fs.cases(features=fs.FEATURES), REGIONS[region])
    assert found is not None and REGIONS[region](found), f"no case in {SEARCH.max_examples} draws is in {region!r}"


@pytest.mark.parametrize("feature", fs.FEATURES)
def test_a_failure_that_needs_a_feature_shrinks_to_that_feature_alone(feature):
    """Shrinking turns every feature the failure does not need off, and the rest of the case plain."""
    found = find(fs.cases(features=fs.FEATURES, dtypes=("float64",)), lambda c: feature in c.features,
                 settings=SEARCH)
    assert found.features == (feature,), f"expected only {feature} left on, got {found!r}"


def test_a_failure_that_needs_no_feature_shrinks_to_every_feature_off():
    found = find(fs.cases(features=fs.FEATURES, dtypes=("float64",)), lambda c: True, settings=SEARCH)
    assert found == Case(block_q=1, block_k=1), f"expected the plainest case, got {found!r}"


@given(data=st.data())
def test_fit_turns_off_exactly_the_undeclared_features(data):
    declared = data.draw(st.sets(st.sampled_from(fs.FEATURES)), label="declared")
    impl = implementation(name="declares-" + "-".join(sorted(declared)), register=False,
                          dtypes=("float64",), **{f: True for f in declared})(lambda q, k, v, **kw: q).__flashcheck__
    case = data.draw(fs.cases(features=fs.FEATURES, dtypes=("float64",)), label="case")
    fitted = fs.fit(impl, case)
    assert set(fitted.features) == set(case.features) & declared, f"{case!r} fitted to {declared}: {fitted!r}"
    assert fs.fit(impl, fitted) == fitted


@given(case=fs.cases(features=fs.FEATURES))
@example(case=Case(sq=3, sk=1, window=(0, 0)))  # rows 0 and 1 end before key 0
@example(case=Case(sq=2, sk=4, causal="top_left", window=(1, -1)))  # top-left causal meets the window's left edge
def test_fit_never_gives_rows_that_see_no_key_to_an_implementation_that_declares_none(case):
    impl = implementation(name="no-masked-rows", register=False, dtypes=("float64",), masked_rows=False,
                          **{f: True for f in fs.FEATURES})(lambda q, k, v, **kw: q).__flashcheck__
    fitted = fs.fit(impl, case)
    assert fitted.visible().any(axis=-1).all(), f"{case!r} fitted to {fitted!r} still has rows that see no key"


@given(case=fs.cases(features=fs.FEATURES))
def test_a_case_with_features_replays_from_its_repr(case):
    again = eval(repr(case), {"AttentionCase": Case})
    assert again == case, f"{case!r} printed as {repr(case)!r} replays as {again!r}"
    for x, y in zip(case.reference_kwargs().values(), again.reference_kwargs().values()):
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y


def test_infinite_sinks_print_as_a_literal_python_reads_back():
    case = Case(hq=2, sinks=(-math.inf, 1.0))
    assert "-1e999" in repr(case) and eval(repr(case), {"AttentionCase": Case}) == case


def test_a_case_without_features_prints_as_before_features_existed():
    assert repr(Case()) == "AttentionCase()"  # every field at its default, features included
    assert repr(Case(sq=3, dtype="float16")) == "AttentionCase(sq=3, dtype='float16')"


@pytest.mark.parametrize("fields, words", [
    (dict(window=(-2, 0)), "window"), (dict(softcap=-1.0), "softcap"), (dict(hq=2, alibi=(1.0,)), "alibi"),
    (dict(hq=2, sinks=(1.0,)), "sinks"), (dict(dropout_p=1.0), "dropout_p"),
])
def test_a_malformed_feature_field_is_named(fields, words):
    with pytest.raises(ValueError, match=words):
        Case(**fields)


def test_the_feature_table_agrees_with_the_case_the_declaration_and_the_strategies():
    from dataclasses import fields

    from flashcheck.contract import Implementation
    from flashcheck.strategies import feature_table
    from flashcheck.strategies.features import STRATEGIES

    defaults = {f.name: f.default for f in fields(Case)}
    wrong = {k: (v, defaults.get(k, "missing")) for k, v in feature_table.OFF.items() if defaults.get(k, object()) != v}
    assert not wrong, f"the table's off values (first) differ from AttentionCase's defaults (second): {wrong}"
    declared = set(Implementation.__dataclass_fields__)
    assert set(feature_table.NAMES) <= declared, f"features with no declaration: {set(feature_table.NAMES) - declared}"
    assert set(STRATEGIES) == set(feature_table.NAMES), f"strategies {sorted(STRATEGIES)} for {feature_table.NAMES}"
    plain = Case(hq=2)
    assert plain.features == () and all(not f.on(plain) for f in feature_table.FEATURES), "a plain case has a feature on"
    for feature in feature_table.FEATURES:
        assert feature.invalid(plain) is None, f"{feature.name} calls the plain case invalid: {feature.invalid(plain)}"
