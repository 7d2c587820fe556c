"""The composite strategy that draws AttentionCases, and how a case is fitted to an implementation.

Every draw is ordered so that shrinking walks towards the plainest failing case:
integers shrink to their lower bound and ``sampled_from`` to its first element, so a
failure ends at batch 1, one head, the shortest sequences, plain logits, float64,
no causal mask and seed 0, unless the bug needs more.
"""
from __future__ import annotations

import math
import time

from hypothesis import currently_in_test_context, note, reject, settings
from hypothesis import strategies as st

from flashcheck.oracle.rounding import DTYPES, HALF
from flashcheck.strategies import buckets, context
from flashcheck.contract.memory import MEMORY
from flashcheck.strategies.case import REGIMES, AttentionCase
from flashcheck.strategies.features import feature_fields, fit_features

# How large cases get, by Hypothesis profile; "default" also covers unknown profiles.
# race_batch and repeats: the race property's batch and calls per input (FlashAttention's own race
# test repeats 250 times at batch 60; the host's float64 truth is computed once per case); race_seq: its
# longest Sq and Sk. A race needs many programs in flight, which batch x heads gives; at batch 60 and
# 300 tokens the host's truth and bounds took 160 s of one gpu-lane worker for a single case.
LIMITS = {
    "default": dict(batch=2, heads=3, seq=40, dim=48, long=2048, race_batch=4, race_seq=40, repeats=3),
    "ci": dict(batch=2, heads=3, seq=40, dim=48, long=2048, race_batch=4, race_seq=40, repeats=2),
    "thorough": dict(batch=3, heads=4, seq=96, dim=96, long=4096, race_batch=16, race_seq=96, repeats=10),
    # the truth runs on the host
    "gpu": dict(batch=3, heads=4, seq=300, dim=256, long=2048, race_batch=60, race_seq=130, repeats=20),
}
PROFILE_DTYPES = {  # the gpu lane's: no float64 on the device
    "gpu": ("float16", "bfloat16", "float32"),
}
DEFAULT_DTYPES = DTYPES  # float64 first: it shrinks there when the bug is not about precision
SCALES = (None, 0.0, 1e-6, 0.5, 2.0, 30.0)  # default, zero, tiny, plain, large
DIMS = (1, 2, 3, 5, 7, 8, 16, 24, 31, 32, 33, 40, 48, 64, 80, 96, 100, 128, 160, 192, 256)
# One draw, smallest first: a tile bug shrinks to the smallest tile that still shows it
# (a one_of of small integers and large powers of two cannot walk from 16 down to 2).
BLOCKS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128)


def block_sizes():
    return st.sampled_from(BLOCKS)


def tilings():
    """A second tiling (block_q, block_k) for a drawn case: any two block sizes; with shape buckets,
    None, which ``second_tiling`` resolves to the tiling the run pairs with the case's shape."""
    return st.none() if buckets.active(_profile()) else st.tuples(block_sizes(), block_sizes())


LONG_BLOCKS = (16, 32, 64, 128)  # a long case's tiles (long_cases): a one-row tile at 2048 x 2048 is 4M tiles


def second_tiling(case, drawn):
    """The second tiling to run ``case`` at: the drawn one (from ``tilings()``), else the run's pair.
    A long case keeps to the long region's tile sizes, as its own tiling does: a tiled kernel's CPU
    lane cannot afford millions of one-row tiles, and the long region is about length, not tiles."""
    if drawn is None:
        return buckets.second_tiling(case)
    if max(case.sq, case.sk) > limits()["seq"]:
        return tuple(_nearest(b, LONG_BLOCKS) for b in drawn)
    return drawn


def _profile() -> str:
    current = getattr(settings, "get_current_profile_name", None)  # Hypothesis >= 6.9x
    name = current() if current else getattr(settings, "_current_profile", "default")
    return (name or "default").split("-")[0]  # ci-random-nopins draws as ci does


# The refusal that ends a property on time: the plugin passes a property that it ended.
BUDGET_SPENT = "the property's time budget is spent (FLASHCHECK_PROPERTY_SECONDS)"


def limits() -> dict:
    return LIMITS.get(_profile(), LIMITS["default"])


# The tile sizes real kernels use: lengths one either side of them hold partial-tile bugs
TILE_SIZES = (16, 32, 48, 64, 96, 128, 256)


def other_length(top: int):
    """The length of one more sequence of a batch (packed, or in a cache): empty, one token, a
    common tile's edge, anywhere, or in the upper half (one long sequence among short ones)."""
    edges = sorted({n for t in TILE_SIZES for n in (t - 1, t, t + 1) if n <= top})
    return st.one_of(st.sampled_from((0, 1)), st.sampled_from(edges or [top]), st.integers(0, top),
                     st.integers(max(1, top // 2), top))


def lengths(block: int, top: int, reach: int | None = None):
    """A sequence length: small first, then the boundaries around one and two blocks, and
    lengths around the tile sizes real kernels use.

    The same draws whatever the block, so that shrinking the block does not reinterpret them.
    ``reach`` lets the block boundaries go past ``top`` (a kernel's declared fixed tiles).
    """
    reach = reach or top

    def edge(tiles, delta):  # an edge past the range becomes its nearest end, 1 only at block 1
        return min(max(tiles * block + delta, 1 if delta >= 0 else 2), reach)

    # within the kernel's own max_seq too: lengths past it are clamped, and a masked-rows case
    # clamped to Sq = Sk has no masked row left (every draw of such a property would be refused)
    impl = context.current().impl
    cap = min(top, getattr(impl, "max_seq", None) or top)
    common = [n for t in TILE_SIZES for n in (t - 1, t, t + 1) if n <= cap]
    # the third branch keeps one-by-one problems a small minority of what is drawn
    return st.one_of(st.integers(1, top), st.builds(edge, st.sampled_from((1, 2)), st.sampled_from((0, -1, 1))),
                     st.integers(max(1, top // 4), top), st.sampled_from(common or [top]))


def fixed_tiles():
    """The (block_q, block_k) tiles the implementation being drawn for declares, or None."""
    return getattr(context.current().impl, "tiles", None)


def tile_reach(tiles) -> int:
    """How long a length goes to show a declared tile's boundaries: two tiles and one, as far as the
    float64 truth affords on the host (the long region's length)."""
    return min(2 * max(tiles) + 1, limits()["long"])


@st.composite
def cases(draw, *, dtypes=None, causal=None, regimes=REGIMES, masked_rows=False, masked_keys=False,
          equal_lengths=False, features=()):
    """Draw an AttentionCase.

    ``causal`` fixes the alignment (or "none"); ``masked_rows=True`` forces a
    bottom-right case with query rows that see no key, ``masked_keys=True`` a top-left
    case with keys no query sees; ``regimes`` narrows the logits; ``features`` names the
    features (strategies/features.py) that may be drawn on, each shrinking to off.
    """
    if _bucketed():  # the layout comes with the shape's bucket (strategies/buckets.py)
        return draw(_cases(dtypes, causal, regimes, masked_rows, masked_keys, equal_lengths, features))
    # how a torch kernel's inputs lie in memory, independent of their values (contract/memory.py)
    memory = draw(st.sampled_from(tuple(MEMORY)), label="memory")
    return draw(_cases(dtypes, causal, regimes, masked_rows, masked_keys, equal_lengths, features)).replace(memory=memory)


def _bucketed() -> bool:
    return buckets.active(_profile()) and not fixed_tiles()


@st.composite
def _cases(draw, dtypes, causal, regimes, masked_rows, masked_keys, equal_lengths, features):
    lim = limits()
    dtypes = dtypes or PROFILE_DTYPES.get(_profile(), DEFAULT_DTYPES)
    half = [t for t in dtypes if t in HALF]
    # the long region is for accumulation over length, a property of plain attention: the feature
    # properties (two runs and two truths per case, or many dropout seeds) stay short
    if half and not (masked_rows or masked_keys or equal_lengths or features) and draw(LONG_ODDS, label="long"):
        return draw(long_cases(half, causal, regimes))
    # the gpu lane: shapes from a small set per run (strategies/buckets.py); a kernel's declared tiles
    # need the lengths around them instead
    if _bucketed():
        return draw(buckets.cases(dtypes, causal, regimes, masked_rows, masked_keys, equal_lengths, features))
    batch = draw(st.integers(1, lim["batch"]), label="batch")
    hkv = draw(st.integers(1, lim["heads"]), label="hkv")
    hq = hkv * draw(st.integers(1, lim["heads"]), label="group")
    if draw(WIDE_ODDS, label="wide group"):  # one or two kv heads (one for 16: the truth's cost is per head)
        group = draw(st.sampled_from(WIDE_GROUPS), label="wide group size")
        hkv = 1 if group == 16 else min(hkv, 2)
        hq = hkv * group
    tiles = fixed_tiles()
    if tiles:  # lengths around the kernel's own tiles, which it does not take as arguments
        (block_q, block_k), reach = tiles, tile_reach(tiles)
    else:
        block_q = draw(block_sizes(), label="block_q")
        block_k = draw(block_sizes(), label="block_k")
        reach = None
    sk = draw(lengths(block_k, lim["seq"], reach), label="sk")
    if masked_rows:
        # bottom-right with Sq > Sk: the first Sq - Sk query rows see no key at all
        sq = sk + draw(st.integers(1, lim["seq"]), label="masked rows")
        align = "bottom_right"
    elif masked_keys:
        # top-left with Sk > Sq: keys past the last query are seen by nobody
        sq = draw(lengths(block_q, lim["seq"], reach), label="sq")
        sk = sq + draw(st.integers(1, lim["seq"]), label="masked keys")
        align = "top_left"
    else:
        sq = sk if equal_lengths else draw(lengths(block_q, lim["seq"], reach), label="sq")
        align = None if causal == "none" else causal or draw(
            st.sampled_from((None, "bottom_right", "top_left")), label="causal")
    dims = st.one_of(st.integers(1, 8), st.sampled_from([x for x in DIMS if x <= lim["dim"]]))
    d = draw(dims, label="d")
    dv = draw(dims, label="dv") if draw(st.booleans(), label="dv differs") else d
    scale = draw(st.one_of(st.sampled_from(SCALES), st.floats(0.01, 4.0)), label="scale")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    regime = draw(st.sampled_from(regimes), label="regime")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    if max(sq, sk) > lim["seq"]:  # past a tile of a kernel's own: one batch entry and few heads keep the truth cheap
        batch, hkv, hq = 1, min(hkv, 2), min(hkv, 2) * min(hq // hkv, 2)
    extra = draw(feature_fields(features, batch=batch, hq=hq, seq=lim["seq"])) if features else {}
    return AttentionCase(batch=batch, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, dv=dv, causal=align, scale=scale,
                         dtype=dtype, block_q=block_q, block_k=block_k, regime=regime, seed=seed, **extra)


# About one draw in eight goes to the long region; shrinking leaves it for the short one.
LONG_ODDS = st.sampled_from((False,) * 7 + (True,))
# Query heads per kv head past the profile's few: kernels instantiate a template per group size and
# have shipped without some (FlashInfer's decode at 5, 6, 7 and 16), or wrong at one (group 7, bf16)
WIDE_GROUPS = (5, 6, 7, 8, 16)
WIDE_ODDS = st.sampled_from((False,) * 11 + (True,))


@st.composite
def long_cases(draw, dtypes, causal=None, regimes=REGIMES):
    """Long sequences in half precision, at small batch x heads x head dim: rounding that grows
    with length (O or dV accumulated in the input type, an unnormalized running sum) shows only
    here, and the float64 truth stays cheap."""
    if buckets.active(_profile()):
        return draw(buckets.long_cases(dtypes, causal, regimes))
    top = limits()["long"]
    edges = st.sampled_from(sorted({top // 2 - 1, top // 2, top // 2 + 1, top - 1, top}))
    sk = draw(st.integers(2, top) | edges, label="long sk")
    sq = draw(st.sampled_from((sk, 1, 17)) | st.integers(2, top), label="long sq")
    hkv = draw(st.integers(1, 2), label="hkv")
    block = st.sampled_from(LONG_BLOCKS)
    align = None if causal == "none" else causal or draw(
        st.sampled_from((None, "bottom_right", "top_left")), label="causal")
    d = draw(st.sampled_from((8, 16, 4, 32, 1, 5)), label="d")
    return AttentionCase(batch=1, hq=hkv * draw(st.integers(1, 2), label="group"), hkv=hkv, sq=sq, sk=sk,
                         d=d, dv=d, causal=align, scale=draw(st.sampled_from(SCALES), label="scale"),
                         dtype=draw(st.sampled_from(dtypes), label="dtype"), block_q=draw(block, label="block_q"),
                         block_k=draw(block, label="block_k"), regime=draw(st.sampled_from(regimes), label="regime"),
                         seed=draw(st.integers(0, 2**32 - 1), label="seed"))


# Precision distance: an unsupported dtype is replaced by the nearest one supported.
_PRECISION = {"float64": 3, "float32": 2, "bfloat16": 1, "float16": 1.1}


def _nearest(value, allowed):
    return min(allowed, key=lambda a: (abs(math.log2(a) - math.log2(value)), a))


class PinNotAsWritten(UserWarning):
    """An @example pin was refitted to an implementation's declarations, or could not run on it."""


def within(impl, case: AttentionCase) -> AttentionCase:
    """The nearest case inside ``impl``'s declared limits (``supports`` aside)."""
    c = fit_features(impl, case).replace(precision=impl.precision)
    if c.dtype not in impl.dtypes:
        c = c.replace(dtype=min(impl.dtypes, key=lambda t: abs(_PRECISION[t] - _PRECISION[c.dtype])))
    if c.causal is None and impl.causal_only:
        c = c.replace(causal=impl.causal[0])
    if c.causal is not None and c.causal not in impl.causal:
        c = c.replace(causal=impl.causal[0] if impl.causal else None)
    if not impl.gqa and c.hkv != c.hq:
        c = c.replace(hkv=c.hq)
    d = impl.nearest_head_dim(c.d)
    c = c.replace(d=d, dv=d if impl.equal_head_dims else impl.nearest_head_dim(c.dv))
    reach = max(tile_reach(impl.tiles) if impl.tiles else 0, limits()["seq"])
    if c.dtype not in HALF and max(c.sq, c.sk) > reach:
        reject()  # the long region is for fp16/bf16 kernels; cutting it short would stall the shrinker
    m = impl.seq_multiple
    lo = -(-impl.min_seq // m) * m
    top = (impl.max_seq or max(c.sq, c.sk, lo)) // m * m
    sq, sk = (min(max(lo, -(-n // m) * m), top) for n in (c.sq, c.sk))
    if impl.equal_lengths:
        sk = sq
    if not impl.masked_rows and c.causal == "bottom_right" and sq > sk:
        sq = sk
    c = c.replace(sq=sq, sk=sk)
    if not impl.masked_rows and c.window is not None and not c.visible().any(axis=-1).all():
        c = c.replace(window=None)  # a window that empties rows, for one that declares it cannot have them
    for tensor in ("mask", "bias"):  # and a mask tensor, or a bias's -inf entries, that do
        if not impl.masked_rows and getattr(c, tensor) is not None and not c.visible().any(axis=-1).all():
            c = c.replace(**{tensor: None})
    if impl.tiles:  # the case shows the tiles the kernel runs with
        c = c.replace(block_q=impl.tiles[0], block_k=impl.tiles[1])
    if isinstance(impl.blocks, tuple):
        c = c.replace(block_q=_nearest(c.block_q, impl.blocks), block_k=_nearest(c.block_k, impl.blocks))
    if not impl.scale_arg:
        c = c.replace(scale=None)
    if impl.framework != "torch" or impl.varlen or impl.kvcache:
        c = c.replace(memory="contiguous")  # a layout's own call builds its tensors
    elif c.memory not in impl.layouts:
        c = c.replace(memory="contiguous" if "contiguous" in impl.layouts else impl.layouts[0])
    return c


def supported(impl, case: AttentionCase) -> tuple[AttentionCase | None, str | None]:
    """(the case fitted to the declared limits, None), or (None, why) when ``supports`` refuses it.

    A refused case is not bent further (that could take away what a property drew it for,
    e.g. its logit regime); the strategies draw another one instead.
    """
    c = within(impl, case)
    why = impl.unsupported(c)
    return (c, None) if why is None else (None, why)


def runs_as_is(impl, case: AttentionCase) -> bool:
    """Does ``case`` (one a property derives from a fitted case: half the keys, one head group)
    lie inside every declaration of ``impl``, and outside its known issues? A sub-call inside a
    known issue would report a declared failure as a new one."""
    return supported(impl, case)[0] == case and not any(issue.applies(case) for issue in impl.known_issues)


def fit(impl, case: AttentionCase) -> AttentionCase:
    """The nearest case inside what ``impl`` declares it can run; unchanged when it fits.

    Fitting, not filtering, keeps every draw useful and lets an ``@example`` pin one
    case for every implementation. A pin that had to change, or cannot run at all, is
    reported (the test context's pin_reports), so that it never passes without testing what it names.
    """
    test = context.current()
    generated = test.budget is not None and case not in test.pins
    # The budget is for generated cases, counted from the first one that runs, so a property whose
    # pins alone outlast it still runs one: Hypothesis reads a property with no generated case as
    # one whose every draw was refused (Unsatisfiable), not as one that ran out of time.
    # Once a case has failed, Hypothesis replays and shrinks it: the budget then refuses nothing.
    spent = generated and not test.failed and test.generated_from is not None
    if spent and time.monotonic() > test.generated_from + test.budget:
        test.last_refusal = BUDGET_SPENT
        raise context.BudgetSpent(BUDGET_SPENT)  # the property ends here: a night sized by time
    c, why = supported(impl, case)
    if c is None:
        _pin_report(case, f"not run: {why}")
        _note(f"{impl.name} cannot run {case!r}: {why}")
        test.last_refusal = why
        reject()
    if generated and test.generated_from is None:
        test.generated_from = time.monotonic()
    if c != case.replace(precision=impl.precision):  # a precision alone is not worth a note
        _note(f"fitted to {impl.name}: {c!r}")
        changed = [f for f in FIELDS if getattr(case, f) != getattr(c, f) and f not in _incidental(case, impl)]
        if changed:
            _pin_report(case, "refitted: " + ", ".join(f"{f} {getattr(case, f)!r} -> {getattr(c, f)!r}"
                                                     for f in changed))
    for issue in impl.known_issues:
        if issue.applies(c):
            _pin_report(case, f"not run: known issue {issue.text!r}")
            test.last_refusal = f"known issue {issue.text!r}"
            reject()  # a declared, already-reported failure: test the rest of the space
    if test.first_pass and case in test.coverage:
        if test.first_pass is not True and test.first_pass != case:
            reject()  # the plugin's first pass: the hand-written pins, and one of the coverage pins
        test.first_pass = case
    test.last_fitted = (impl, c)
    return c


def _note(text: str):
    if currently_in_test_context():
        note(text)


FIELDS = tuple(AttentionCase.__dataclass_fields__)


def _short(case: AttentionCase) -> str:
    """The case as it is pinned (its repr leaves fields at their defaults out)."""
    return "Case" + repr(case).removeprefix("AttentionCase")


def _incidental(case, impl):
    """Fields a pin leaves at their defaults are not what it is about, nor block sizes a kernel
    does not take: refitting them is no news."""
    return ({"precision"} | ({"dtype"} if case.dtype == AttentionCase.dtype else set())
            | ({"block_q", "block_k"} if impl.blocks is None else set()))


def _pin_report(case, what: str):
    test = context.current()
    line = f"@example {_short(case)} {what}"
    if case in test.pins and case not in test.coverage and line not in test.pin_reports:
        test.pin_reports.append(line)
