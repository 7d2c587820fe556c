"""Strategies for the feature matrix: sliding window, softcap, ALiBi, attention sinks, mask tensors, dropout.

Each feature is drawn "on" only after a boolean that shrinks to False, so a failing case
shrinks to the feature off whenever the failure does not need it: the report then shows
whether the feature matters. Inside a feature, every draw shrinks towards its mildest form.
"""
from __future__ import annotations

from hypothesis import strategies as st

from flashcheck.strategies.feature_table import BY_NAME, NAMES as FEATURES

# tiny (saturating: every logit pinned near +-c) ... huge (the identity)
SOFTCAPS = (1.0, 1e-3, 0.05, 0.5, 5.0, 30.0, 1e6)
# from -inf-like (exp underflows in every dtype) to dominant (the sink outweighs every key)
SINKS = (0.0, -1e30, -30.0, -3.0, 3.0, 30.0, 1e3)
DROPOUTS = (0.1, 1e-3, 0.5, 0.9)  # 0 is "off"; tiny, 0.1, 0.5 and 0.9 are the issue's


def geometric_slopes(h: int) -> tuple[float, ...]:
    """ALiBi's own slopes for h heads: 2^(-8 i / h), i = 1..h (Press et al., 2022)."""
    return tuple(float(2.0 ** (-8.0 * i / h)) for i in range(1, h + 1))


def _f32(x: float) -> float:
    import numpy as np

    return float(np.float32(x))  # slopes and sinks are float32 tensors: draw what they can hold


@st.composite
def windows(draw, seq: int):
    """(left, right): each side unbounded (-1), 0, narrow, or wider than any sequence drawn.

    Narrow sides on both ends and Sq > Sk empty whole rows (a row's window lies before key 0);
    asymmetric ones come from drawing the sides independently.
    """
    side = st.one_of(st.just(-1), st.integers(0, 3), st.integers(0, seq + 2))
    return draw(side, label="window left"), draw(side, label="window right")


def softcaps():
    return st.one_of(st.sampled_from(SOFTCAPS), st.floats(1e-2, 1e2).map(_f32))


@st.composite
def slopes(draw, batch: int, hq: int):
    """ALiBi slopes: the geometric series, or random ones of both signs, per head or per batch and head."""
    per_batch = draw(st.booleans(), label="slopes per batch")
    rows = batch if per_batch else 1
    if draw(st.booleans(), label="random slopes"):
        one = st.one_of(st.sampled_from((0.0, 0.5, -0.5)), st.floats(-2.0, 2.0).map(_f32))
        table = [tuple(draw(one, label="slope") for _ in range(hq)) for _ in range(rows)]
    else:
        table = [geometric_slopes(hq)] * rows
    return tuple(table) if per_batch else table[0]


@st.composite
def sinks(draw, hq: int):
    one = st.one_of(st.sampled_from(SINKS), st.floats(-10.0, 10.0).map(_f32))
    return tuple(draw(one, label="sink") for _ in range(hq))


@st.composite
def feature_fields(draw, features, *, batch: int, hq: int, seq: int) -> dict:
    """AttentionCase fields for the requested features, each on or off (off first)."""
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {FEATURES}")
    out = {}
    on = [f for f in FEATURES if f in features and draw(st.booleans(), label=f"{f} on")]
    for name in on:
        out.update(draw(STRATEGIES[name](batch=batch, hq=hq, seq=seq)))
    return out


@st.composite
def masks(draw, seq: int):
    """A mask tensor's description (strategies/case.py, mask_array): random densities from all True
    to all False, bands, rows emptied (a row with no True entry), the causal mask as a tensor; shared
    by every batch entry and head first, then per batch entry, per head, or both."""
    kind = draw(st.sampled_from(("random", "band", "rows", "causal")), label="mask kind")
    param = draw({"random": st.sampled_from((1.0, 0.5, 0.9, 0.1, 0.0)) | st.floats(0.0, 1.0),
                  "band": st.integers(0, 3) | st.integers(0, seq),
                  "rows": st.sampled_from((0.25, 0.5, 1.0)),
                  "causal": st.sampled_from((0, 1))}[kind], label="mask param")
    per_batch = draw(st.booleans(), label="mask per batch")
    per_head = draw(st.booleans(), label="mask per head")
    return kind, per_batch, per_head, param, draw(st.integers(0, 2**16), label="mask seed")


@st.composite
def biases(draw):
    """A bias tensor's description (strategies/case.py, bias_array): N(0, s^2) entries from small to
    logit-sized, or N(0, 1) with a fraction of -inf or finfo(t).min entries (all of them included:
    a row of -inf sees nothing, a row of finfo.min is uniform); shared first, then per batch entry,
    per head or both."""
    kind = draw(st.sampled_from(("normal", "ninf", "min")), label="bias kind")
    param = draw(st.sampled_from((1.0, 0.1, 10.0, 30.0)) if kind == "normal"
                 else st.sampled_from((0.25, 0.5, 1.0)), label="bias param")
    per_batch = draw(st.booleans(), label="bias per batch")
    per_head = draw(st.booleans(), label="bias per head")
    return kind, per_batch, per_head, param, draw(st.integers(0, 2**16), label="bias seed")


@st.composite
def _dropout(draw):
    return {"dropout_p": draw(st.sampled_from(DROPOUTS), label="dropout_p"),
            "dropout_seed": draw(st.integers(0, 2**31 - 1), label="dropout_seed")}


# Each feature's strategy, by its name in the feature table: the case fields it turns on.
STRATEGIES = {
    "window": lambda batch, hq, seq: windows(seq).map(lambda w: {"window": w}),
    "softcap": lambda batch, hq, seq: softcaps().map(lambda c: {"softcap": c}),
    "alibi": lambda batch, hq, seq: slopes(batch, hq).map(lambda s: {"alibi": s}),
    "sinks": lambda batch, hq, seq: sinks(hq).map(lambda s: {"sinks": s}),
    "mask": lambda batch, hq, seq: masks(seq).map(lambda m: {"mask": m}),
    "bias": lambda batch, hq, seq: biases().map(lambda b: {"bias": b}),
    "dropout": lambda batch, hq, seq: _dropout(),
}


def fit_features(impl, case):
    """Turn off every feature ``impl`` does not declare."""
    off = {}
    for name in FEATURES:
        if not getattr(impl, name, False):
            off.update({f: v for f, v in BY_NAME[name].off.items() if getattr(case, f) != v})
    return case.replace(**off) if off else case
