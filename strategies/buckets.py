"""Shape buckets: in the gpu lane, every case takes its shape from a small set fixed for the run.

A Triton kernel compiles once per set of compile-time values it sees: its constexprs (block
sizes, padded head dims, flags) and, for plain int arguments, whether each one is 1, a
multiple of 16 or neither. Kernels written as many third-party ones are (lengths and head
dims as constexprs, ``@triton.autotune`` keyed on them) compile and benchmark again for every
new length. Drawn freely, nearly every example of the gpu lane meets a new shape and pays
seconds of compiling for milliseconds of kernel. Here the shape of a case (batch, heads,
lengths, head dims and block sizes, as one tuple) comes instead from a set of about a dozen
shapes chosen once per run and shared by every property, so each compiled kernel serves
many examples. Each shape also comes with its memory layout and, mostly, one dtype per run (both
are compile-time values as well; other runs pair them otherwise). The values, seeds, scales, regimes,
causal flags and features of a case are drawn as freely as ever.

The set always holds the boundary shapes (one query and one key, lengths one either side of
a block, Sq > Sk and Sk > Sq, unequal head dims, exact multiples, a large non-multiple one)
and adds shapes drawn from a seeded generator, so that runs with other seeds cover other
shapes. It is sorted plainest first: ``sampled_from`` shrinks towards its first element, so a
failure still shrinks to the smallest shape in the set that shows it.

A kernel that declares fixed tiles also gets shapes at their boundaries. One that declares
``supports`` is drawn only the shapes it runs, plus shapes at powers of two for any relation between
the lengths that none of those has: a kernel taking multiples of 64 alone still meets Sq > Sk.

- On in the ``gpu`` profile; FLASHCHECK_SHAPE_BUCKETS=0 turns it off there (the draws are then
  those of every other profile), =1 turns it on in any profile.
- FLASHCHECK_BUCKET_SEED=N picks the set. Unset, the pytest plugin takes ``--hypothesis-seed``, else
  0, and hands it to its xdist workers through this variable.
"""
from __future__ import annotations

import functools
import os
import random
import zlib
from dataclasses import astuple, dataclass

from hypothesis import strategies as st

from flashcheck.strategies import context

ENV = "FLASHCHECK_SHAPE_BUCKETS"
SEED_ENV = "FLASHCHECK_BUCKET_SEED"
# Drawn per run, on top of the boundary shapes. Every shape is one more compile per kernel, dtype
# and set of flags: a dozen in all keeps most examples on kernels already built.
RANDOM_SHAPES = 5
RUN_DTYPES = ("float16", "bfloat16", "float32", "float64")  # the order the shapes take a kernel's in (dtypes_of)
LONG_SHAPES = 4  # shapes of the long region (one half-precision draw in eight)
TILES = (16, 32, 64, 128)  # block sizes real kernels use: lengths one either side of them


@dataclass(frozen=True)
class Shape:
    """The compile-relevant part of a case."""

    batch: int
    hkv: int
    group: int  # query heads per key/value head
    sq: int
    sk: int
    d: int
    dv: int
    block_q: int
    block_k: int

    @classmethod
    def of(cls, case) -> "Shape":
        """The shape of a case (anything with AttentionCase's fields)."""
        return cls(case.batch, case.hkv, case.hq // case.hkv, case.sq, case.sk, case.d, case.dv, case.block_q,
                   case.block_k)

    @property
    def fields(self) -> dict:
        """The AttentionCase fields this shape fixes."""
        return dict(batch=self.batch, hq=self.hkv * self.group, hkv=self.hkv, sq=self.sq, sk=self.sk, d=self.d,
                    dv=self.dv, block_q=self.block_q, block_k=self.block_k)

    def plainness(self):
        """Sort key, plainest first: the work a case of this shape takes, then its fields."""
        return (self.batch * self.hkv * self.group * self.sq * self.sk * max(self.d, self.dv), astuple(self))


def active(profile: str) -> bool:
    """Whether cases drawn under ``profile`` take their shapes from the buckets."""
    switch = os.environ.get(ENV, "")
    if switch not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 (off) or 1 (on), got {switch!r}")
    return switch == "1" or (switch == "" and profile == "gpu")


def seed() -> int:
    """The run's bucket seed (FLASHCHECK_BUCKET_SEED; the plugin sets it once per run)."""
    value = os.environ.get(SEED_ENV, "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{SEED_ENV} must be an integer, got {value!r}") from None


def _clip(n: int, top: int) -> int:
    return min(max(n, 1), top)


def _length(rng: random.Random, block: int, top: int) -> int:
    """One length, from the same families the free draws use: anywhere, at a block boundary
    (one and two blocks, +-1), one either side of a common tile, or in the upper range."""
    family = rng.randrange(4)
    if family == 0:
        return rng.randint(1, top)
    if family == 1:
        return _clip(rng.choice((1, 2)) * block + rng.choice((-1, 0, 1)), top)
    if family == 2:
        return _clip(rng.choice(TILES) + rng.choice((-1, 1)), top)
    return rng.randint(max(1, top // 4), top)


def _dim(rng: random.Random, dims) -> int:
    return rng.randint(1, 8) if rng.random() < 0.5 else rng.choice(dims)


def _boundary(lim: dict) -> list[Shape]:
    """Shapes every run holds. Which lengths are drawn with which flags stays free."""
    top, dim, heads, batch = lim["seq"], lim["dim"], lim["heads"], lim["batch"]
    c, dmax = functools.partial(_clip, top=top), functools.partial(_clip, top=dim)
    return [
        Shape(1, 1, 1, 1, 1, 1, 1, 16, 16),  # one query, one key: where a shrink ends
        Shape(1, 1, 1, c(2), 1, dmax(8), dmax(8), 16, 16),  # Sq > Sk by one: a masked row when bottom-right
        Shape(1, 1, 2, 1, c(17), dmax(16), dmax(16), 16, 16),  # Sk > Sq: keys nobody sees when top-left
        Shape(1, 1, min(2, heads), c(15), c(17), dmax(5), dmax(7), 16, 16),  # block - 1, block + 1; GQA; Dv != D
        Shape(1, min(2, heads), 1, c(33), c(31), dmax(32), dmax(32), 32, 16),  # Sq > Sk, two tiles +- 1
        Shape(min(2, batch), 1, 1, c(64), c(64), dmax(64), dmax(64), 64, 64),  # exact multiples, batch 2
        Shape(min(2, batch), 1, min(3, heads), c(top - 3), c(top - 1), dmax(100), dmax(100), 128, 64),  # large
        Shape(1, 1, 7, c(9), c(40), dmax(16), dmax(16), 16, 32),  # a wide GQA group (kernels ship without some)
    ]


@functools.lru_cache(maxsize=8)
def shapes(run_seed: int, lim_items: tuple, blocks: tuple, dims: tuple) -> tuple[Shape, ...]:
    """The run's shapes, plainest first (``lim_items``: the profile's limits as sorted items)."""
    lim = dict(lim_items)
    rng = random.Random(run_seed)
    top = lim["seq"]
    found = set(_boundary(lim))
    while len(found) < len(_boundary(lim)) + RANDOM_SHAPES:
        block_q, block_k = rng.choice(blocks), rng.choice(blocks)
        sk = _length(rng, block_k, top)
        # a third of them square (the properties of equal lengths draw only from those)
        sq = sk if rng.random() < 1 / 3 else _length(rng, block_q, top)
        d = _dim(rng, dims)
        dv = d if rng.random() < 0.5 else _dim(rng, dims)
        found.add(Shape(rng.randint(1, lim["batch"]), rng.randint(1, lim["heads"]), rng.randint(1, lim["heads"]),
                        sq, sk, d, dv, block_q, block_k))
    return tuple(sorted(found, key=Shape.plainness))


@functools.lru_cache(maxsize=8)
def long_shapes(run_seed: int, top: int, dims: tuple, blocks: tuple) -> tuple[Shape, ...]:
    """The long region's shapes (batch 1, few heads, small head dims, as its free draws)."""
    rng = random.Random(run_seed + 1)
    found = {Shape(1, 1, 1, top, top, 8, 8, 64, 64), Shape(1, 1, 2, 17, top // 2 + 1, 16, 16, 128, 32)}
    while len(found) < LONG_SHAPES:
        sk = rng.randint(2, top) if rng.random() < 0.5 else rng.choice((top // 2 - 1, top // 2 + 1, top - 1))
        sq = rng.choice((sk, 1, 17, rng.randint(2, top)))
        d = rng.choice(dims)
        found.add(Shape(1, rng.randint(1, 2), rng.randint(1, 2), sq, sk, d, d, rng.choice(blocks), rng.choice(blocks)))
    return tuple(sorted(found, key=Shape.plainness))


RELATIONS = {
    "any": lambda s: True,
    "masked_rows": lambda s: s.sq > s.sk,  # drawn bottom-right: the first Sq - Sk rows see no key
    "masked_keys": lambda s: s.sk > s.sq,  # drawn top-left: keys past the last query are seen by nobody
    "equal_lengths": lambda s: s.sq == s.sk,
}


def shape_strategy(candidates: tuple[Shape, ...], relation: str = "any"):
    """One shape of the run's set that satisfies ``relation``, plainest first."""
    return st.sampled_from([s for s in candidates if RELATIONS[relation](s)])


def tiling_values(candidates: tuple[Shape, ...]) -> tuple[tuple[int, int], ...]:
    """The tilings (block_q, block_k) the run's shapes carry, smallest first (the second tilings
    ``second_tiling`` pairs with them). Pairs, not every block size against every other: each is one more compile per
    kernel, dtype and set of flags, and the run's shapes already meet each pair."""
    return tuple(sorted({(s.block_q, s.block_k) for s in candidates}))


def run_shapes() -> tuple[Shape, ...]:
    """This run's shapes under the current profile's limits, and at the boundaries of the tiles
    the implementation being drawn for declares (``tiles=``), if it does."""
    from flashcheck.strategies import draw as fs_draw

    lim = fs_draw.limits()
    dims = tuple(x for x in fs_draw.DIMS if x <= lim["dim"])
    found = shapes(seed(), tuple(sorted(lim.items())), fs_draw.BLOCKS, dims)
    tiles = fs_draw.fixed_tiles()
    found = tile_shapes(found, tuple(tiles), fs_draw.tile_reach(tiles)) if tiles else found
    impl = context.current().impl
    return runnable_shapes(found, impl, lim["seq"]) if getattr(impl, "supports", None) is not None else found


_RUNNABLE: dict = {}
POWERS = (16, 32, 64, 128, 256)  # the lengths kernels that take only some of them take


def runnable_shapes(found: tuple[Shape, ...], impl, top: int) -> tuple[Shape, ...]:
    """For an implementation that declares ``supports``: the shapes of ``found`` that it runs, and
    for each relation between the lengths (equal, Sq > Sk, Sk > Sq) that none of those has, the two
    plainest shapes at powers of two (16 up to the profile's longest) that it runs. A kernel that
    takes only some lengths (multiples of 64, powers of two) would otherwise be drawn a set it
    cannot run, and its properties would skip as if it declared nothing they could test."""
    key = (id(impl), impl.name, found, top)  # an implementation lives for the whole run
    if key not in _RUNNABLE:
        runs = [s for s in map(lambda s: _runnable(impl, s), found) if s is not None]
        extra = []
        for relation in ("equal_lengths", "masked_rows", "masked_keys"):
            if any(RELATIONS[relation](s) for s in runs):
                continue
            tried = [Shape(1, 1, group, sq, sk, d, d, 16, 16) for n in POWERS for group in (1, 2) for d in (16, 64)
                     for sq, sk in ((n, n), (2 * n, n), (n, 2 * n)) if max(sq, sk) <= top]
            fits = [s for s in map(lambda s: _runnable(impl, s), tried) if s is not None and RELATIONS[relation](s)]
            extra += sorted(set(fits), key=Shape.plainness)[:2]
        _RUNNABLE[key] = tuple(sorted(set(runs) | set(extra), key=Shape.plainness)) or found
    return _RUNNABLE[key]


def _runnable(impl, shape: Shape) -> Shape | None:
    """``shape`` as ``impl`` runs it (fitted to its declarations), or None when ``supports`` or a
    known issue refuses it."""
    from flashcheck.strategies import draw as fs_draw
    from flashcheck.strategies.case import AttentionCase

    try:
        c, _ = fs_draw.supported(impl, AttentionCase(**shape.fields))
    except ValueError:  # a shape the case itself refuses once fitted
        return None
    if c is None or any(issue.applies(c) for issue in impl.known_issues):
        return None
    return Shape.of(c)


@functools.lru_cache(maxsize=8)
def tile_shapes(found: tuple[Shape, ...], tiles: tuple[int, int], reach: int) -> tuple[Shape, ...]:
    """``found`` and three shapes at a fixed-tile kernel's boundaries: a tile less one query with
    one key past the first tile; one query and one key past a tile; one past two tiles of each."""
    bq, bk = tiles
    c = functools.partial(_clip, top=reach)
    extra = {Shape(1, 1, 1, c(bq - 1), c(bk + 1), 16, 16, bq, bk), Shape(1, 1, 2, c(bq + 1), c(bk - 1), 8, 8, bq, bk),
             Shape(1, 1, 1, c(2 * bq + 1), c(2 * bk + 1), 32, 32, bq, bk)}
    return tuple(sorted(set(found) | extra, key=Shape.plainness))


def run_long_shapes() -> tuple[Shape, ...]:
    from flashcheck.strategies import draw as fs_draw

    return long_shapes(seed(), fs_draw.limits()["long"], (8, 16, 4, 32, 1, 5), (16, 32, 64, 128))


def on() -> bool:
    """Whether the running profile draws from the buckets."""
    from flashcheck.strategies.draw import _profile

    return active(_profile())


def key_chunks(sk: int, cuts: list[int], runs) -> list[tuple[int, int]]:
    """(start, stop) of each chunk a property cuts Sk keys into, one cut per entry of ``cuts`` (drawn
    integers, taken modulo the choices), every chunk a length ``runs(n)`` accepts; [] where no cut
    fits. Each chunk is a new length: for a kernel that compiles per length, a compile. Drawn freely,
    a cut may land on any key of what the earlier cuts left. In a bucketed run the cuts lie at fixed
    keys of the whole range (the first, 16, the middle and the last; for a kernel that runs none of
    those, the first, middle and last cut it does run), so however many cuts a case draws, its chunks
    take a few lengths per shape, the same in every example and every night."""
    bounds, start = [], 0
    if on():
        whole = [n for n in range(1, sk) if runs(n) and runs(sk - n)]  # single cuts that leave two runnable halves
        points = (sorted({1, 16, sk // 2, sk - 1} & set(whole)) or sorted({whole[0], whole[len(whole) // 2], whole[-1]})
                  if whole else [])
        for p in sorted({points[c % len(points)] for c in cuts}) if points else ():
            if runs(p - start):  # what follows p runs: p is in whole
                bounds.append((start, p))
                start = p
    else:
        for cut in cuts:
            rest = sk - start
            splits = [n for n in range(1, rest) if runs(n) and runs(rest - n)]
            if not splits:
                break
            bounds.append((start, start + splits[cut % len(splits)]))
            start = bounds[-1][1]
    return bounds + [(start, sk)] if bounds else []


def layout(shape: Shape, candidates: tuple[Shape, ...]) -> str:
    """The memory layout of a shape's cases. Strides and alignment are compile-time values too
    (Triton specializes on 16-divisibility, torch.compile guards on strides), so the layout belongs
    to the bucket: the shapes take the layouts in turn, plainest shape contiguous, and every layout
    meets a few shapes per run (which ones changes with the seed, as the shapes do)."""
    from flashcheck.contract.memory import MEMORY

    kinds = tuple(MEMORY)
    return kinds[candidates.index(shape) % len(kinds)] if shape in candidates else "contiguous"


def _side(shape: Shape) -> int:
    """Which of the lengths' relations (Sq < Sk, Sq == Sk, Sq > Sk) a shape is in."""
    return (shape.sq > shape.sk) - (shape.sq < shape.sk)


def dtypes_of(shape: Shape, candidates: tuple[Shape, ...], dtypes) -> tuple[str, ...]:
    """The dtypes a shape's cases take in this run, among ``dtypes`` (a property's). The dtype is a
    compile-time value too: each is another build of every kernel, and the run's first properties
    otherwise compile each shape three times over (an autotuned kernel tunes it three times). So
    a shape takes one, or as many as it takes for the shapes of its relation between the lengths
    (the properties of masked rows draw only Sq > Sk) to meet every dtype the kernel declares: the
    shapes of a relation take the dtypes in turn, from a point the seed moves, and over as many
    seeds as dtypes every shape meets every one. A property that allows fewer takes the shape's
    own where it can, else the next in turn. A shape outside the set takes any of ``dtypes``."""
    declared = getattr(context.current().impl, "dtypes", None) or RUN_DTYPES
    every = tuple(d for d in RUN_DTYPES if d in declared)
    if shape not in candidates or len(every) < 2:
        return tuple(dtypes)
    kin = [s for s in candidates if _side(s) == _side(shape)]
    per = -(-len(every) // len(kin))
    turn = kin.index(shape) * per + seed()
    order = [every[(turn + j) % len(every)] for j in range(len(every))]
    return tuple(d for d in order[:per] if d in dtypes) or tuple(d for d in order if d in dtypes)[:1] or tuple(dtypes)


def second_tiling(case) -> tuple[int, int]:
    """The second tiling (block_q, block_k) the run pairs with ``case``'s shape, for a property that
    runs a case at two. A tiling is a compile-time value, like a dtype: drawn per example, it builds
    every kernel of a shape again at each tiling of the run, in every example and every night. So each
    shape of the run takes one tiling of the run other than its own, the shapes taking them in turn
    from a point the seed moves, so that the run meets every tiling (with at least as many shapes as
    tilings) and other seeds pair them otherwise. A case outside the run's shapes takes one by its
    fields' checksum."""
    own, shape, found = (case.block_q, case.block_k), Shape.of(case), run_shapes()
    paired = _second_tilings(found + run_long_shapes(), tiling_values(found), seed())
    if shape in paired:
        return paired[shape]
    others = [t for t in tiling_values(found) if t != own] or [own]
    return others[zlib.crc32(repr(astuple(shape)).encode()) % len(others)]


@functools.lru_cache(maxsize=8)
def _second_tilings(candidates: tuple[Shape, ...], tilings: tuple, run_seed: int) -> dict:
    queue: list = []
    paired = {}
    for shape in candidates:
        own = (shape.block_q, shape.block_k)
        if not [t for t in queue if t != own]:  # what is left is this shape's own tiling, or nothing
            start = run_seed % len(tilings)
            queue += tilings[start:] + tilings[:start]
        pick = next((t for t in queue if t != own), own)  # own only where the run has no other
        if pick in queue:
            queue.remove(pick)
        paired[shape] = pick
    return paired


def _causal(draw, causal):
    return None if causal == "none" else causal or draw(st.sampled_from((None, "bottom_right", "top_left")),
                                                        label="causal")


@st.composite
def cases(draw, dtypes, causal=None, regimes=None, masked_rows=False, masked_keys=False, equal_lengths=False,
          features=()):
    """draw.cases() with the shape from the run's set; everything else drawn as there."""
    from flashcheck.strategies.case import AttentionCase
    from flashcheck.strategies.draw import SCALES, limits
    from flashcheck.strategies.features import feature_fields

    relation = ("masked_rows" if masked_rows else "masked_keys" if masked_keys
                else "equal_lengths" if equal_lengths else "any")
    candidates = run_shapes()
    shape = draw(shape_strategy(candidates, relation), label="shape bucket")
    align = "bottom_right" if masked_rows else "top_left" if masked_keys else _causal(draw, causal)
    scale = draw(st.one_of(st.sampled_from(SCALES), st.floats(0.01, 4.0)), label="scale")
    dtype = draw(st.sampled_from(dtypes_of(shape, candidates, dtypes)), label="dtype")
    regime = draw(st.sampled_from(regimes), label="regime")
    seed_ = draw(st.integers(0, 2**32 - 1), label="seed")
    f = shape.fields
    extra = draw(feature_fields(features, batch=f["batch"], hq=f["hq"], seq=limits()["seq"])) if features else {}
    return AttentionCase(**f, causal=align, scale=scale, dtype=dtype, regime=regime, seed=seed_,
                         memory=layout(shape, candidates), **extra)


@st.composite
def long_cases(draw, dtypes, causal=None, regimes=None):
    """draw.long_cases() with the shape from the run's long set."""
    from flashcheck.strategies.case import AttentionCase
    from flashcheck.strategies.draw import SCALES

    candidates = run_long_shapes()
    shape = draw(shape_strategy(candidates), label="long shape bucket")
    return AttentionCase(**shape.fields, causal=_causal(draw, causal), memory=layout(shape, candidates),
                         scale=draw(st.sampled_from(SCALES), label="scale"),
                         dtype=draw(st.sampled_from(dtypes_of(shape, candidates, dtypes)), label="dtype"),
                         regime=draw(st.sampled_from(regimes), label="regime"),
                         seed=draw(st.integers(0, 2**32 - 1), label="seed"))


def choose_seed(hypothesis_seed=None) -> None:
    """Fix the run's seed in the environment, which xdist's workers inherit, so that every
    process draws from one set: FLASHCHECK_BUCKET_SEED when set, else ``--hypothesis-seed``,
    else 0. A fixed default keeps the set the same from run to run, so that a failure saved in
    the example database replays as the same case, and a Triton cache kept between runs holds
    every kernel the next run needs; a nightly job varies the seed to visit other shapes."""
    active("")  # a malformed switch is refused here, once, rather than in every test
    if os.environ.get(SEED_ENV):
        seed()  # and a malformed seed
        return
    value = 0
    if hypothesis_seed is not None:
        text = str(hypothesis_seed)
        value = int(text) if text.lstrip("-").isdigit() else zlib.crc32(text.encode())
    os.environ[SEED_ENV] = str(value)


def describe() -> str:
    """One line on the run's set, for the timing summary."""
    return (f"shapes from {len(run_shapes())} buckets (+{len(run_long_shapes())} long), "
            f"{SEED_ENV}={seed()} draws the same set again")
