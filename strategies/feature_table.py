"""The feature matrix, one record per feature (docs/features.md): every part of the suite reads it.

A record says which AttentionCase fields the feature adds (with their "off" values), when a case
turns it on, what a kernel that declares it receives (``Implementation.<name> = True``), what
the dense reference receives, and what a valid value is. Its strategy lives in
strategies/features.py, keyed by the same name. Adding a feature means one record here, its
case fields, its strategy, and the kernels that implement it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Feature:
    name: str  # the declaration (Implementation.<name>) and the case's name for it
    off: dict  # the AttentionCase fields it adds, at their "off" values
    on: Callable  # case -> bool
    call: Callable  # (case, tensor) -> the keywords a declaring kernel receives (off values when off)
    reference: Callable  # case -> the keywords of the dense reference, when on
    invalid: Callable  # case -> what is wrong with its fields, or None
    random: bool = False  # its result depends on a random mask: checked by its own properties


def _window_invalid(c):
    w = c.window
    if w is not None and not (len(w) == 2 and all(s >= -1 for s in w)):
        return f"window must be (left, right) with each side >= -1, got {w!r}"
    return None


def _alibi_invalid(c):
    import numpy as np

    if c.alibi is not None and np.shape(c.alibi) not in ((c.hq,), (c.batch, c.hq)):
        return f"alibi must hold {c.hq} slopes, or {c.batch} tuples of them, got {c.alibi!r}"
    return None


def _tensor_invalid(c, name: str, out_of_range, ranges: str):
    """What is wrong with a mask or bias description (kind, per_batch, per_head, param, seed), or None."""
    from flashcheck.strategies.case import BIAS_KINDS, MASK_KINDS

    kinds = MASK_KINDS if name == "mask" else BIAS_KINDS
    x = getattr(c, name)
    if x is None:
        return None
    ok = (isinstance(x, tuple) and len(x) == 5 and x[0] in kinds and all(isinstance(y, bool) for y in x[1:3])
          and isinstance(x[3], (int, float)) and x[3] >= 0 and isinstance(x[4], int))
    if not ok or out_of_range(x[0], x[3]):
        return f"{name} must be (kind, per_batch, per_head, param, seed) with kind in {kinds}, param {ranges}, got {x!r}"
    return None


def _mask_invalid(c):
    return _tensor_invalid(c, "mask", lambda kind, p: (kind in ("random", "rows") and p > 1)
                           or (kind == "causal" and p not in (0, 1)),
                           "a probability (random, rows), a width >= 0 (band) or 0/1 (causal)")


def _bias_invalid(c):
    return _tensor_invalid(c, "bias", lambda kind, p: kind != "normal" and p > 1,
                           "a scale >= 0 (normal) or a fraction of entries (ninf, min)")


FEATURES = (
    Feature("window", {"window": None}, lambda c: c.window is not None,
            lambda c, t: {"window": (-1, -1) if c.window is None else tuple(c.window)},
            lambda c: {"window": c.window}, _window_invalid),
    Feature("softcap", {"softcap": 0.0}, lambda c: c.softcap > 0,
            lambda c, t: {"softcap": float(c.softcap)},
            lambda c: {"softcap": c.softcap},
            lambda c: None if c.softcap >= 0 else f"softcap must be >= 0 (0 = off), got {c.softcap!r}"),
    Feature("alibi", {"alibi": None}, lambda c: c.alibi is not None,
            lambda c, t: {"alibi_slopes": None if c.alibi is None else t(c.alibi_slopes())},
            lambda c: {"alibi_slopes": c.alibi_slopes()}, _alibi_invalid),
    Feature("sinks", {"sinks": None}, lambda c: c.sinks is not None,
            lambda c, t: {"sinks": None if c.sinks is None else t(c.sink_logits())},
            lambda c: {"sinks": c.sink_logits()},
            lambda c: None if c.sinks is None or len(c.sinks) == c.hq
            else f"sinks must hold one logit per query head ({c.hq}), got {c.sinks!r}"),
    Feature("mask", {"mask": None}, lambda c: c.mask is not None,
            lambda c, t: {"attn_mask": None if c.mask is None else t(c.attn_mask())},
            lambda c: {"attn_mask": c.attn_mask()}, _mask_invalid),
    Feature("bias", {"bias": None}, lambda c: c.bias is not None,
            lambda c, t: {"attn_bias": None if c.bias is None else t(c.bias_argument())},
            lambda c: {"attn_bias": c.attn_bias()}, _bias_invalid),
    # dropout's mask is the implementation's own (properties/test_dropout.py): the reference gets none
    Feature("dropout", {"dropout_p": 0.0, "dropout_seed": 0}, lambda c: c.dropout_p > 0,
            lambda c, t: {"dropout_p": float(c.dropout_p), "dropout_seed": int(c.dropout_seed)},
            lambda c: {},
            lambda c: None if 0 <= c.dropout_p < 1 else f"dropout_p must be in [0, 1), got {c.dropout_p!r}",
            random=True),
)
NAMES = tuple(f.name for f in FEATURES)
DETERMINISTIC = tuple(f.name for f in FEATURES if not f.random)  # checked against the truth directly
BY_NAME = {f.name: f for f in FEATURES}
OFF = {field: value for f in FEATURES for field, value in f.off.items()}  # every feature field, off
