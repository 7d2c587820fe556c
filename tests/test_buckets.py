"""The gpu lane's shape buckets (strategies/buckets.py): a bounded set per run, the boundary shapes in
every set, shrinking to the plainest shape, and no change at all to the CPU profiles' draws."""
import itertools
import types

import pytest
from hypothesis import HealthCheck, find, given, settings

from flashcheck import strategies as fs
from flashcheck.strategies import buckets, context

pytestmark = pytest.mark.properties

SAMPLE = settings(max_examples=50, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
LIM = dict(batch=3, heads=4, seq=300, dim=256, long=2048)  # the gpu profile's limits
DIMS = tuple(x for x in fs.draw.DIMS if x <= LIM["dim"])


@pytest.fixture
def on(monkeypatch):
    """Buckets on in whatever profile runs, from a fixed seed."""
    monkeypatch.setenv(buckets.ENV, "1")
    monkeypatch.setenv(buckets.SEED_ENV, "7")
    return buckets.run_shapes()


def _shape_of(case):
    return buckets.Shape(case.batch, case.hkv, case.hq // case.hkv, case.sq, case.sk, case.d, case.dv,
                         case.block_q, case.block_k)


@pytest.mark.parametrize("kind", ["plain", "masked_rows", "masked_keys", "equal_lengths", "features", "long"])
def test_every_drawn_shape_comes_from_the_runs_set(on, kind):
    kwargs = {"plain": {}, "long": dict(dtypes=("float16",)), "features": dict(features=fs.FEATURES)}.get(
        kind, {kind: True})
    allowed = set(on) | set(buckets.run_long_shapes())
    drawn = []

    @SAMPLE
    @given(fs.cases(**kwargs))
    def collect(case):
        assert _shape_of(case) in allowed, f"expected a shape of the run's set, drew {case!r}"
        assert buckets.RELATIONS.get(kind, buckets.RELATIONS["any"])(_shape_of(case)), (
            f"expected a {kind} shape, drew {case!r}")
        drawn.append(case)

    collect()
    assert len({_shape_of(c) for c in drawn}) > 1, "expected several shapes of the set, drew one"
    if kind == "long":
        assert any(_shape_of(c) in buckets.run_long_shapes() for c in drawn), "expected the long region, drew none"
    for c in drawn:  # the layout is compile-relevant: it comes with the shape
        shape = _shape_of(c)
        want = buckets.layout(shape, on if shape in on else buckets.run_long_shapes())
        assert c.memory == want, f"expected the layout of {shape} ({want}), drew {c.memory}"
    # what the buckets leave free still varies: scales, seeds, regimes
    for field in ("scale", "seed", "regime"):
        assert len({getattr(c, field) for c in drawn}) > 2, f"expected {field} to vary, got one value"


def test_every_layout_meets_some_shape_of_the_run_and_the_plainest_is_contiguous(on):
    from flashcheck.contract.memory import MEMORY

    got = [buckets.layout(s, on) for s in on]
    assert got[0] == "contiguous", f"expected the plainest shape contiguous, got {got[0]}"
    assert set(got) == set(MEMORY), f"expected every layout among the run's shapes, got {sorted(set(got))}"


def test_each_shape_takes_one_second_tiling_another_of_the_runs_and_the_run_meets_them_all(on):
    pairs = buckets.tiling_values(on)
    assert len(pairs) > 2, f"expected the run's shapes to carry several tilings, got {pairs}"
    seconds = {}

    @SAMPLE
    @given(fs.cases(), fs.draw.tilings())
    def second(case, drawn):
        tiling = fs.draw.second_tiling(case, drawn)
        assert tiling in pairs, f"expected a tiling among {pairs}, got {tiling}"
        assert tiling != (case.block_q, case.block_k), f"expected a tiling other than the case's own, got {tiling}"
        got = seconds.setdefault(_shape_of(case), tiling)
        assert got == tiling, f"expected {_shape_of(case)} to take one second tiling in a run, got {got} and {tiling}"

    second()
    paired = {buckets.second_tiling(types.SimpleNamespace(**s.fields)) for s in on}
    assert paired == set(pairs), f"expected the run's shapes to meet every tiling of the run, met {sorted(paired)}"
    assert fs.draw.second_tiling(fs.AttentionCase(), (2, 3)) == (2, 3), "expected a drawn tiling kept as drawn"
    long = fs.AttentionCase(sq=2048, sk=2048, d=8, dv=8)
    got = fs.draw.second_tiling(long, (1, 5))
    assert got == (16, 16), f"expected a long case's drawn tiling kept to the long region's tiles, (16, 16), got {got}"


@pytest.mark.parametrize("run_seed", range(6))
def test_every_set_holds_the_boundary_shapes_within_the_limits(run_seed):
    shapes = buckets.shapes(run_seed, tuple(sorted(LIM.items())), fs.draw.BLOCKS, DIMS)
    assert set(buckets._boundary(LIM)) <= set(shapes)
    assert len(shapes) == len(buckets._boundary(LIM)) + buckets.RANDOM_SHAPES
    assert list(shapes) == sorted(shapes, key=buckets.Shape.plainness), "expected the plainest shape first"
    assert shapes[0] == buckets.Shape(1, 1, 1, 1, 1, 1, 1, 16, 16)
    for s in shapes:
        assert 1 <= min(s.sq, s.sk) and max(s.sq, s.sk) <= LIM["seq"], f"length past the limit: {s}"
        wide = s.group in fs.draw.WIDE_GROUPS and s.hkv == 1  # the one wide GQA group every set holds
        assert max(s.d, s.dv) <= LIM["dim"] and s.batch <= LIM["batch"] and max(s.hkv, 1 if wide else s.group) \
            <= LIM["heads"], s
    for relation in ("masked_rows", "masked_keys", "equal_lengths"):
        assert sum(map(buckets.RELATIONS[relation], shapes)) >= 2, f"expected two {relation} shapes at least"


def test_a_kernel_with_fixed_tiles_gets_shapes_at_their_boundaries(on, monkeypatch):
    monkeypatch.setattr(context, "current", lambda: context.Test(impl=types.SimpleNamespace(tiles=(32, 48))))
    shapes = buckets.run_shapes()
    assert set(on) < set(shapes)
    assert {(s.sq, s.sk) for s in shapes} >= {(31, 49), (33, 47), (65, 97)}, "expected lengths one off each tile"
    assert max(s.sk for s in shapes) == 97, "expected two key tiles and one key (past the profile's limit in ci)"


def test_a_kernel_that_takes_some_lengths_only_is_drawn_shapes_it_runs(on, monkeypatch):
    """A kernel taking only lengths in multiples of 64 (jax's cuDNN attention) met a set in which
    no shape it runs had Sq > Sk or Sk > Sq, and those properties skipped in the gpu lane. Here
    multiples of 16, which the CPU profiles' lengths reach."""
    from flashcheck import implementation

    @implementation(name="sixteens", register=False, causal=("bottom_right", "top_left"), gqa=True,
                    dtypes=("float16",), supports=lambda c: c.sq % 16 == 0 and c.sk % 16 == 0 or "multiples of 16")
    def attention(q, k, v, *, causal=False, scale=None):
        return q

    impl = attention.__flashcheck__
    monkeypatch.setattr(context, "current", lambda: context.Test(impl=impl))
    shapes = buckets.run_shapes()
    assert all(s.sq % 16 == 0 and s.sk % 16 == 0 for s in shapes), f"expected only shapes it runs, got {shapes}"
    for relation in ("equal_lengths", "masked_rows", "masked_keys"):
        assert any(map(buckets.RELATIONS[relation], shapes)), f"expected a {relation} shape it runs, got {shapes}"

    @SAMPLE
    @given(fs.cases(masked_rows=True))
    def drawn(case):
        assert fs.draw.supported(impl, case)[0] is not None, f"expected a case it runs, drew {case!r}"

    drawn()


def test_other_seeds_give_other_sets():
    sets = {buckets.shapes(s, tuple(sorted(LIM.items())), fs.draw.BLOCKS, DIMS) for s in range(5)}
    assert len(sets) == 5, "expected five seeds to give five sets"


def test_shrinking_reaches_the_plainest_shape_that_fails(on):
    found = find(fs.cases(), lambda c: c.sq > 20, settings=SAMPLE)
    want = next(s for s in on if s.sq > 20)
    assert _shape_of(found) == want, f"expected the plainest shape with Sq > 20, {want}, got {found!r}"
    assert (found.scale, found.seed, found.regime, found.causal) == (None, 0, "plain", None), found


def test_the_cpu_profiles_never_reach_the_buckets(monkeypatch):
    monkeypatch.delenv(buckets.ENV, raising=False)
    assert not any(buckets.active(p) for p in ("default", "ci", "thorough"))
    assert buckets.active("gpu")
    monkeypatch.setenv(buckets.ENV, "0")
    assert not buckets.active("gpu")

    def refuse():
        raise AssertionError("a CPU profile drew from the buckets")

    monkeypatch.setenv(buckets.ENV, "")
    monkeypatch.setattr(buckets, "run_shapes", refuse)
    monkeypatch.setattr(buckets, "run_long_shapes", refuse)
    SAMPLE(given(fs.cases(), fs.draw.tilings())(lambda case, tiling: None))()


def test_a_malformed_switch_or_seed_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv(buckets.ENV, "yes")
    with pytest.raises(ValueError, match=buckets.ENV):
        buckets.choose_seed(None)
    monkeypatch.setenv(buckets.ENV, "1")
    monkeypatch.setenv(buckets.SEED_ENV, "seven")
    with pytest.raises(ValueError, match=buckets.SEED_ENV):
        buckets.choose_seed(None)


def test_the_seed_is_chosen_once_and_kept(monkeypatch):
    monkeypatch.delenv(buckets.SEED_ENV, raising=False)
    buckets.choose_seed(None)
    assert buckets.seed() == 0, "expected the same set in every run without a seed"
    monkeypatch.delenv(buckets.SEED_ENV)
    buckets.choose_seed(1234)
    assert buckets.seed() == 1234
    buckets.choose_seed(99)  # a worker inherits the controller's choice
    assert buckets.seed() == 1234


def test_a_key_range_is_cut_at_few_points_in_a_bucketed_run(monkeypatch):
    """Free draws cut what the earlier cuts left anywhere; bucketed ones at the first, 16th, middle
    and last key of the whole range, so that many cuts still make a few chunk lengths per shape."""
    anything = lambda n: True  # noqa: E731
    monkeypatch.setenv(buckets.ENV, "0")
    assert buckets.key_chunks(40, [0, 0], anything) == [(0, 1), (1, 2), (2, 40)]
    assert buckets.key_chunks(40, [38], anything) == [(0, 39), (39, 40)]
    assert buckets.key_chunks(2, [0, 5], anything) == [(0, 1), (1, 2)]  # one key left: no second cut
    monkeypatch.setenv(buckets.ENV, "1")
    lengths = set()
    for cuts in itertools.product(range(4), repeat=3):
        bounds = buckets.key_chunks(40, list(cuts), anything)
        assert bounds[0][0] == 0 and bounds[-1][1] == 40 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert {b for _, b in bounds[:-1]} <= {1, 16, 20, 39}, f"expected cuts at 1, 16, 20 or 39, got {bounds}"
        lengths |= {b - a for a, b in bounds}
    assert lengths == {1, 4, 15, 16, 19, 20, 23, 24, 38, 39}, f"expected few chunk lengths, got {sorted(lengths)}"
    even = lambda n: n % 2 == 0  # noqa: E731  (a kernel that runs even lengths only)
    assert buckets.key_chunks(40, [1, 2], even) == [(0, 16), (16, 20), (20, 40)]
    assert buckets.key_chunks(40, [0], even) == [(0, 16), (16, 40)]  # the cuts it runs: 16 and 20, not 1 or 39
    assert buckets.key_chunks(1, [0], anything) == [] and buckets.key_chunks(40, [0], lambda n: False) == []
    by64 = lambda n: n % 64 == 0  # noqa: E731  (none of 1, 16, 96 or 191 fits: its own first, middle, last)
    assert {tuple(buckets.key_chunks(192, [c], by64)) for c in range(3)} == {((0, 64), (64, 192)),
                                                                           ((0, 128), (128, 192))}
    assert buckets.key_chunks(192, [0, 1], by64) == [(0, 64), (64, 128), (128, 192)]


def _kernel(dtypes):
    from flashcheck import implementation

    @implementation(name="three-dtypes", register=False, causal=("bottom_right", "top_left"), dtypes=dtypes,
                    blocks="any")
    def attention(q, k, v, *, causal=False, scale=None, block_q=None, block_k=None):
        return q

    return attention.__flashcheck__


def test_each_relation_between_the_lengths_meets_every_dtype_in_a_run_and_most_shapes_take_one(on, monkeypatch):
    """A shape's dtype is compile-relevant: most shapes take one per run, yet the shapes of each
    relation (Sq < Sk, Sq == Sk, Sq > Sk: what the masked-row and masked-key properties draw from)
    meet every dtype in every run, and every shape meets every dtype over three seeds."""
    three, halves = ("float16", "bfloat16", "float32"), ("float16", "bfloat16")
    impl = _kernel(three)
    monkeypatch.setattr(context, "current", lambda: context.Test(impl=impl))
    met = {s: set() for s in on}
    for run_seed in ("7", "8", "9"):
        monkeypatch.setenv(buckets.SEED_ENV, run_seed)
        got = {s: buckets.dtypes_of(s, on, three) for s in on}
        for relation in ("equal_lengths", "masked_rows", "masked_keys"):
            kin = [s for s in on if buckets.RELATIONS[relation](s)]
            assert set().union(*(got[s] for s in kin)) == set(three) or not kin, \
                f"seed {run_seed}: expected the {relation} shapes to meet every dtype, got {[got[s] for s in kin]}"
        assert sum(len(d) for d in got.values()) <= len(on) + 2 * len(three), \
            f"expected one dtype for most shapes, got {sorted(got.values())}"
        for s in on:  # a property that allows fewer takes the shape's own where it can
            own, fewer = tuple(d for d in got[s] if d in halves), buckets.dtypes_of(s, on, halves)
            assert fewer == own if own else len(fewer) == 1 and fewer[0] in halves, \
                f"{s}: expected {own or 'the next of ' + str(halves)}, got {fewer}"
            met[s] |= set(got[s])
    assert all(d == set(three) for d in met.values()), f"expected every shape to meet every dtype, got {met}"
    monkeypatch.setenv(buckets.SEED_ENV, "7")

    @SAMPLE
    @given(fs.cases(dtypes=three))
    def drawn(case):
        shape, long = _shape_of(case), buckets.run_long_shapes()  # the long region: half precision only
        want = buckets.dtypes_of(shape, on, three) if shape in on else buckets.dtypes_of(shape, long, halves)
        assert case.dtype in want, f"expected one of the shape's dtypes {want}, drew {case!r}"

    drawn()
