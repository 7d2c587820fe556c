"""The composite strategy that draws AttentionCases, and how a case is fitted to an implementation.

Every draw is ordered so that shrinking walks towards the plainest failing case:
integers shrink to their lower bound and ``sampled_from`` to its first element, so a
failure ends at batch 1, one head, the shortest sequences, plain logits, float64,
no causal mask and seed 0, unless the bug needs more.
"""
from __future__ import annotations

import math

from hypothesis import note, reject, settings
from hypothesis import strategies as st

from flashcheck.strategies.case import REGIMES, AttentionCase

# How large cases get, by Hypothesis profile; "default" also covers unknown profiles.
LIMITS = {
    "default": dict(batch=2, heads=3, seq=40, dim=48),
    "ci": dict(batch=2, heads=3, seq=40, dim=48),
    "thorough": dict(batch=3, heads=4, seq=96, dim=96),
    "gpu": dict(batch=3, heads=4, seq=300, dim=256),
}
DTYPES = {  # float64 first: it shrinks there when the bug is not about precision
    "gpu": ("float16", "bfloat16", "float32"),
}
DEFAULT_DTYPES = ("float64", "float32", "float16", "bfloat16")
SCALES = (None, 0.0, 1e-6, 0.5, 2.0, 30.0)  # default, zero, tiny, plain, large
DIMS = (1, 2, 3, 5, 7, 8, 16, 24, 31, 32, 33, 40, 48, 64, 80, 96, 100, 128, 160, 192, 256)


def _profile() -> str:
    current = getattr(settings, "get_current_profile_name", None)  # Hypothesis >= 6.9x
    name = current() if current else getattr(settings, "_current_profile", "default")
    return (name or "default").removesuffix("-nopins")


def limits() -> dict:
    return LIMITS.get(_profile(), LIMITS["default"])


def lengths(block: int, top: int):
    """A sequence length: small first, then the boundaries around one and two blocks."""
    edges = sorted({n for b in (block, 2 * block) for n in (b - 1, b, b + 1) if 1 <= n <= top})
    return st.one_of(st.integers(1, top), st.sampled_from(edges or [1]))


@st.composite
def cases(draw, *, dtypes=None, causal=None, regimes=REGIMES, masked_rows=False, masked_keys=False,
          equal_lengths=False):
    """Draw an AttentionCase.

    ``causal`` fixes the alignment (or "none"); ``masked_rows=True`` forces a
    bottom-right case with query rows that see no key, ``masked_keys=True`` a top-left
    case with keys no query sees; ``regimes`` narrows the logits.
    """
    lim = limits()
    batch = draw(st.integers(1, lim["batch"]), label="batch")
    hkv = draw(st.integers(1, lim["heads"]), label="hkv")
    hq = hkv * draw(st.integers(1, lim["heads"]), label="group")
    block_q = draw(st.one_of(st.integers(1, 8), st.sampled_from((16, 32, 64, 128))), label="block_q")
    block_k = draw(st.one_of(st.integers(1, 8), st.sampled_from((16, 32, 64, 128))), label="block_k")
    sk = draw(lengths(block_k, lim["seq"]), label="sk")
    if masked_rows:
        # bottom-right with Sq > Sk: the first Sq - Sk query rows see no key at all
        sq = sk + draw(st.integers(1, lim["seq"]), label="masked rows")
        align = "bottom_right"
    elif masked_keys:
        # top-left with Sk > Sq: keys past the last query are seen by nobody
        sq = draw(lengths(block_q, lim["seq"]), label="sq")
        sk = sq + draw(st.integers(1, lim["seq"]), label="masked keys")
        align = "top_left"
    else:
        sq = sk if equal_lengths else draw(lengths(block_q, lim["seq"]), label="sq")
        align = None if causal == "none" else causal or draw(
            st.sampled_from((None, "bottom_right", "top_left")), label="causal")
    dims = st.one_of(st.integers(1, 8), st.sampled_from([x for x in DIMS if x <= lim["dim"]]))
    d = draw(dims, label="d")
    dv = draw(dims, label="dv") if draw(st.booleans(), label="dv differs") else d
    scale = draw(st.one_of(st.sampled_from(SCALES), st.floats(0.01, 4.0)), label="scale")
    dtype = draw(st.sampled_from(dtypes or DTYPES.get(_profile(), DEFAULT_DTYPES)),
                 label="dtype")
    regime = draw(st.sampled_from(regimes), label="regime")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    return AttentionCase(batch=batch, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, dv=dv, causal=align, scale=scale,
                         dtype=dtype, block_q=block_q, block_k=block_k, regime=regime, seed=seed)


# Precision distance: an unsupported dtype is replaced by the nearest one supported.
_PRECISION = {"float64": 3, "float32": 2, "bfloat16": 1, "float16": 1.1}


def _nearest(value, allowed):
    return min(allowed, key=lambda a: (abs(math.log2(a) - math.log2(value)), a))


LAST_FITTED: list = [None]  # (impl, case) of the latest fit: the case a failure report shows


def fit(impl, case: AttentionCase) -> AttentionCase:
    """The nearest case inside what ``impl`` declares it can run; unchanged when it fits.

    Fitting, not filtering, keeps every draw useful and lets an ``@example`` pin one
    case for every implementation.
    """
    c = case
    if c.dtype not in impl.dtypes:
        c = c.replace(dtype=min(impl.dtypes, key=lambda t: abs(_PRECISION[t] - _PRECISION[c.dtype])))
    if c.causal is not None and c.causal not in impl.causal:
        c = c.replace(causal=impl.causal[0] if impl.causal else None)
    if not impl.gqa and c.hkv != c.hq:
        c = c.replace(hkv=c.hq)
    lo, hi = impl.head_dims
    c = c.replace(d=min(max(c.d, lo), hi), dv=min(max(c.d if impl.equal_head_dims else c.dv, lo), hi))
    top = impl.max_seq or max(c.sq, c.sk)
    m = impl.seq_multiple
    sq, sk = (min(max(m, -(-n // m) * m), top // m * m or m) for n in (c.sq, c.sk))
    if impl.equal_lengths:
        sk = sq
    if not impl.masked_rows and c.causal == "bottom_right" and sq > sk:
        sq = sk
    c = c.replace(sq=sq, sk=sk)
    if isinstance(impl.blocks, tuple):
        c = c.replace(block_q=_nearest(c.block_q, impl.blocks), block_k=_nearest(c.block_k, impl.blocks))
    if c != case:
        note(f"fitted to {impl.name}: {c!r}")
    for issue in impl.known_issues:
        if issue.applies(c):
            reject()  # a declared, already-reported failure: test the rest of the space
    LAST_FITTED[0] = (impl, c)
    return c
