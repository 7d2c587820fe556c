"""Shrinking from a failing pinned ``@example``.

Hypothesis runs the pins first and, when one fails, reports it as it is: a boundary case
chosen by hand (``sq=6, sk=6, block_q=3, block_k=3``), not the smallest case that fails.
Here the property is re-run on simpler and simpler cases (or packed and cached batches), one
field at a time, keeping each change that still fails the same way, so the report leads with
the smallest case reached (and names the pin it came from).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from flashcheck.strategies import AttentionCase, feature_table
from flashcheck.strategies.kvcache import Cached
from flashcheck.strategies.varlen import Packed

BUDGET_S = 30.0  # shrinking is a courtesy on top of a failure already found: keep it bounded
MAX_TRIES = 200
_ONCE = settings(database=None, max_examples=1, phases=[Phase.generate], derandomize=True, deadline=None,
                 report_multiple_bugs=False, suppress_health_check=list(HealthCheck))


@dataclass
class PinShrink:
    pin: AttentionCase | Packed | Cached  # the pinned case (or packed or cached batch) that failed
    case: AttentionCase | Packed | Cached  # the smallest failing one reached from it (as drawn; the test fits it)
    error: BaseException  # what the property raised on ``case``
    tries: int


def _is_explicit(exc: BaseException) -> bool:
    notes = [*getattr(exc, "__notes__", ())]
    for sub in getattr(exc, "exceptions", ()):
        notes += [*getattr(sub, "__notes__", ())]
    # "Falsifying explicit example" up to Hypothesis 6.16x, "Failing explicit example" after
    return any(n.startswith(("Falsifying explicit example", "Failing explicit example")) for n in notes)


def _run(inner, kwargs) -> BaseException | None:
    """Run the property once on exactly these arguments, inside Hypothesis (note/reject work)."""
    @_ONCE
    @given(st.just(kwargs))
    def once(kw):
        inner(**kw)

    try:
        once()
    except Exception as exc:  # noqa: BLE001  (any failure of the property counts)
        return exc
    return None


def simpler(c: AttentionCase):
    """Cases one step plainer than ``c``, plainest first."""
    group = c.hq // c.hkv
    steps = [dict(batch=1), dict(hq=c.hkv), dict(hkv=1, hq=group), dict(hkv=1, hq=1)]
    for field in ("sq", "sk", "d"):
        n = getattr(c, field)
        steps += [{field: m} for m in sorted({1, 2, n // 4, n // 2, 3 * n // 4, n - 1}) if 1 <= m < n]
    steps += [dict(dv=c.d)] + [dict(dv=m) for m in (1, c.dv // 2, c.dv - 1) if 1 <= m < c.dv]
    steps += [dict(causal=None), dict(scale=None), dict(dtype="float64"), dict(dtype="float32"),
              dict(regime="plain"), dict(seed=0)]
    steps += [dict(f.off) for f in feature_table.FEATURES]
    for field in ("block_q", "block_k"):
        n = getattr(c, field)
        steps += [{field: 16}] + [{field: m} for m in (1, n // 2, n - 1) if 1 <= m < n]
    # a mask or bias tensor is drawn from its seed at the case's shape: at a shorter length the same
    # seed draws another tensor, which may not hit the bug (a row the mask empties), so shorter
    # lengths are tried again under a few other draws
    for name in ("mask", "bias"):
        spec = getattr(c, name)
        if spec is not None:
            steps += [{**s, name: spec[:-1] + (spec[-1] + k,)} for k in (1, 2, 3)
                      for s in steps if set(s) <= {"sq", "sk"}]
    for change in steps:
        try:
            cand = c.replace(**_trimmed(c, change))
        except ValueError:
            continue
        if cand != c and _size(cand) <= _size(c):
            yield cand


def _trimmed(c: AttentionCase, change: dict) -> dict:
    """``change``, with per-batch ALiBi slopes and per-head slopes and sinks cut to the new batch and
    heads (a pin with slopes per batch entry still shrinks to batch 1)."""
    batch, hq = change.get("batch", c.batch), change.get("hq", c.hq)
    out = dict(change)
    if c.alibi is not None and "alibi" not in change:
        per_batch = isinstance(c.alibi[0], tuple)
        rows = c.alibi[:batch] if per_batch else c.alibi
        out["alibi"] = tuple(r[:hq] for r in rows) if per_batch else rows[:hq]
    if c.sinks is not None and "sinks" not in change:
        out["sinks"] = c.sinks[:hq]
    return out


def simpler_packed(p: Packed):
    """Packed batches one step plainer than ``p``: a sequence fewer, a sequence shorter, or a plainer
    template (its lengths stay the first sequence's)."""
    n, options = len(p.lengths), []
    for b in range(n):
        if n > 1:
            options.append(p.lengths[:b] + p.lengths[b + 1:])
        for side in (0, 1):
            length = p.lengths[b][side]
            for m in (1, length // 2, length - 1):
                if 1 <= m < length:
                    pair = (m, p.lengths[b][1]) if side == 0 else (p.lengths[b][0], m)
                    options.append(p.lengths[:b] + (pair,) + p.lengths[b + 1:])
    for lengths in options:
        if min(lengths[0]) >= 1:  # the template is the first sequence: drawn cases never have an empty side
            yield Packed(p.case.replace(sq=lengths[0][0], sk=lengths[0][1]), lengths)
    for cand in simpler(p.case):
        if (cand.sq, cand.sk) == (p.case.sq, p.case.sk):
            yield Packed(cand, p.lengths)


def _size(c: AttentionCase):
    """An order in which shrinking only ever moves down."""
    plain = (c.causal is not None, c.scale is not None, c.dtype != "float64", c.regime != "plain", c.seed != 0,
             *(f in c.features for f in feature_table.NAMES))
    return (c.batch * c.hq * c.sq * c.sk * max(c.d, c.dv), c.batch, c.hq, c.hkv, c.sq + c.sk, c.d + c.dv,
            sum(plain), abs(c.block_q - 16) + abs(c.block_k - 16), c.seed)


def simpler_cached(c: Cached):
    """Cached batches one step plainer than ``c``: another sequence fewer or shorter, a plainer layout
    (no spare slots, one split, blocks in order, no pages), or a plainer template at its lengths."""
    own = c.lengths.index(c.case.sk - (c.case.sq if c.append else 0))  # the template's sequence
    for b, n in enumerate(c.lengths):
        if b != own:
            yield c.replace(lengths=c.lengths[:b] + c.lengths[b + 1:])
            shorter = sorted({0, n // 2, n - 1} - {n})
            yield from (c.replace(lengths=c.lengths[:b] + (m,) + c.lengths[b + 1:]) for m in shorter if m >= 0)
    yield from (c.replace(**step) for step in (dict(spare=0), dict(num_splits=1), dict(order=None),
                                                dict(page_size=None, order=None)))
    added = c.case.sq if c.append else 0
    for cand in simpler(c.case):
        if (cand.sq, cand.sk) == (c.case.sq, c.case.sk):
            yield c.replace(case=cand)
        elif cand.sq == c.case.sq and cand.sk >= added:  # a shorter template: its own cache shorter
            yield c.replace(case=cand, lengths=c.lengths[:own] + (cand.sk - added,) + c.lengths[own + 1:])


def _size_of(x):
    """_size, for a packed or cached batch too: its tokens and sequences, then its template's size."""
    if isinstance(x, Packed):
        return (sum(a + b for a, b in x.lengths), len(x.lengths), _size(x.case))
    if isinstance(x, Cached):
        layout = (x.spare, x.num_splits, x.order is not None, x.page_size is not None)
        return (sum(x.lengths), len(x.lengths), layout, _size(x.case))
    return _size(x)


def _simpler_any(x):
    if isinstance(x, AttentionCase):
        yield from simpler(x)
    else:
        steps = simpler_packed(x) if isinstance(x, Packed) else simpler_cached(x)
        yield from (c for c in steps if _size_of(c) < _size_of(x))


def shrink_failing_pin(item, impl, exc: BaseException) -> PinShrink | None:
    """When ``exc`` came from a pinned example of ``item``, the smallest failing case reached from it."""
    if not _is_explicit(exc):
        return None
    test = getattr(item, "obj", None)
    inner = getattr(getattr(test, "hypothesis", None), "inner_test", None)
    pins = getattr(test, "hypothesis_explicit_examples", [])
    if inner is None:
        return None
    base = {k: v for k, v in getattr(item, "funcargs", {}).items() if k in ("impl",)}
    want = type(exc)
    for pin in reversed(pins):  # the order Hypothesis runs them in
        kwargs = {**base, **pin.kwargs, "impl": impl}
        key = next((k for k, v in kwargs.items() if isinstance(v, (AttentionCase, Packed, Cached))), None)
        if key is None:
            continue
        err = _run(inner, kwargs)
        if isinstance(err, want):
            break
    else:
        return None
    start, tries, case = time.monotonic(), 0, kwargs[key]
    improved = True
    while improved and tries < MAX_TRIES and time.monotonic() - start < BUDGET_S:
        improved = False
        for cand in _simpler_any(case):
            tries += 1
            failure = _run(inner, {**kwargs, key: cand})
            if isinstance(failure, want):
                case, err, improved = cand, failure, True
                break
            if tries >= MAX_TRIES:
                break
    err = _run(inner, {**kwargs, key: case}) or err  # the last run's fit is the one reported
    return PinShrink(pin=kwargs[key], case=case, error=err, tries=tries)
