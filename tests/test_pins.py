"""The pin shrinker (flashcheck/pins.py): each step is plainer, valid, and reaches what a pin holds."""
from flashcheck import pins
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies.kvcache import Cached
from flashcheck.strategies.varlen import Packed


def test_slopes_per_batch_entry_shrink_with_the_batch():
    c = Case(batch=2, hq=2, hkv=1, sq=5, sk=3, alibi=((0.3, -0.05), (-0.2, 0.1)))
    steps = list(pins.simpler(c))
    assert Case(hq=2, hkv=1, sq=5, sk=3, alibi=((0.3, -0.05),)) in steps, f"no batch-1 step among {steps}"
    assert Case(batch=2, sq=5, sk=3, alibi=((0.3,), (-0.2,))) in steps, f"no one-head step among {steps}"
    assert all(pins._size(s) <= pins._size(c) for s in steps)


def test_shorter_lengths_are_tried_under_other_mask_draws():
    c = Case(sq=1, sk=37, mask=("rows", True, True, 0.5, 1))
    steps = list(pins.simpler(c))
    assert Case(sq=1, sk=18, mask=("rows", True, True, 0.5, 2)) in steps, "no redrawn mask at a shorter length"
    assert not [s for s in steps if s.sk == 37 and s.mask not in (None, c.mask)], "a redraw alone is not plainer"


def test_a_packed_batch_shrinks_by_sequences_and_lengths_keeping_its_template_first():
    p = Packed(Case(hq=3, hkv=3, sq=23, sk=40), ((23, 40), (4, 0), (0, 3), (40, 23)))
    steps = list(pins._simpler_any(p))
    assert steps, "a four-sequence packed batch has plainer forms"
    assert Packed(p.case, p.lengths[:2] + p.lengths[3:]) in steps, "dropping the third sequence is a step"
    assert Packed(Case(sq=23, sk=40), p.lengths) in steps, "one head in the template is a step"
    for s in steps:
        assert pins._size_of(s) < pins._size_of(p), f"{s} is not plainer than {p}"
        assert (s.case.sq, s.case.sk) == s.lengths[0] and min(s.lengths[0]) >= 1, \
            f"{s}: template is not the first sequence"


def test_a_report_names_the_pinned_packed_batch_it_shrank_from():
    from types import SimpleNamespace

    from flashcheck import report

    impl = SimpleNamespace(blocks=None, tiles=None)
    pin = Packed(Case(hq=3, hkv=3, sq=23, sk=40), ((23, 40), (4, 0)))
    assert report._pin_code(pin, impl) == "Packed(AttentionCase(hq=3, hkv=3, sq=23, sk=40), lengths=((23, 40), (4, 0)))"
    assert report._pin_code(Case(sq=2), impl) == "AttentionCase(sq=2)"


def test_a_cached_batch_shrinks_its_other_sequences_and_its_layout_keeping_its_template():
    c = Cached(Case(sq=2, sk=20), (20, 3), page_size=3, num_splits=17, spare=2)
    steps = list(pins._simpler_any(c))
    assert c.replace(lengths=(20,)) in steps, f"dropping the second sequence is a step: {steps}"
    assert c.replace(num_splits=1) in steps and c.replace(page_size=None, order=None) in steps
    assert c.replace(case=Case(sq=2, sk=10), lengths=(10, 3)) in steps, "a shorter template shortens its own cache"
    for s in steps:
        assert pins._size_of(s) < pins._size_of(c), f"{s} is not plainer than {c}"
        assert s.case.sk - (s.case.sq if s.append else 0) in s.lengths, f"{s}: the template lost its sequence"
