"""Batches against a KV cache (kvcache kernels; flashcheck/contract/cache.py).

A ``Cached`` is a template AttentionCase (heads, head dims, Sq, dtype, causal, scale, features,
logit regime) and one cache length per sequence, with how the cache is laid out: new keys
appended or not, pages of some size in some order, spare slots and unused blocks, and the number
of splits. Sequence b is the template with Sk = its cache length (plus Sq when appending), at its
own seed: its inputs, truth and bounds are a dense case's, so the oracle's rule applies per
sequence unchanged, from its own magnitudes.

The draws shrink towards one sequence at the template's length, no appending, contiguous pages
in order, no spare room and one split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from flashcheck.contract import cache as layout
from flashcheck.strategies import context
from flashcheck.strategies import draw as fs_draw
from flashcheck.strategies.case import AttentionCase, quantize

MAX_SEQUENCES = 4
PAGE_SIZES = (16, 1, 2, 3, 64, 256)  # the common size first; 1..256 as the issue's caches have them


@dataclass(frozen=True)
class Cached:
    case: AttentionCase  # the template: batch 1; its sk is the first sequence's cache length
    lengths: tuple[int, ...]  # cache_seqlens: positions filled before the call
    append: bool = False  # Sq new keys passed as k_new / v_new
    page_size: int | None = None  # None: a contiguous cache
    order: int | None = None  # the blocks' order: None in order, else a permutation's seed
    spare: int = 0  # slots past the longest sequence, or unused blocks
    num_splits: int = 1

    def __repr__(self):
        extra = "".join(f", {f}={getattr(self, f)!r}" for f, default in
                        (("append", False), ("page_size", None), ("order", None), ("spare", 0), ("num_splits", 1))
                        if getattr(self, f) != default)
        return f"Cached({self.case!r}, lengths={self.lengths!r}{extra})"

    def replace(self, **kw) -> "Cached":
        return Cached(**{**self.__dict__, **kw})

    def keys(self, b: int) -> int:
        """How many keys sequence b's queries see."""
        return self.lengths[b] + (self.case.sq if self.append else 0)

    def sequence(self, b: int) -> AttentionCase:
        """Sequence b as a dense case of batch 1 (its Sk may be 0: see ``sequence_inputs``)."""
        return self.case.replace(sk=self.keys(b), seed=(self.case.seed + b) % 2**32)

    def sequence_inputs(self, b: int):
        """q, k, v of sequence b, each (1, H, S, D); a sequence without keys gets normal queries."""
        c = self.sequence(b)
        if c.sk:
            return c.inputs()[:3]
        rng = np.random.default_rng(c.seed)
        shapes = ((c.hq, c.sq, c.d), (c.hkv, 0, c.d), (c.hkv, 0, c.dv))
        return tuple(quantize(rng.standard_normal((1, *s)), c.dtype) for s in shapes)

    def layout(self) -> layout.Layout:
        need = max(self.keys(b) for b in range(len(self.lengths)))
        if self.page_size is None:
            return layout.Layout.contiguous(need, self.spare)
        return layout.Layout.paged(len(self.lengths), need, self.page_size, self.spare, self.order)

    def call(self) -> layout.Call:
        """The call's inputs: the cache holds each sequence's first lengths[b] keys, NaN elsewhere;
        appending, the last Sq keys of each sequence are k_new / v_new."""
        parts = [self.sequence_inputs(b) for b in range(len(self.lengths))]
        q = np.concatenate([p[0] for p in parts], axis=0)
        lay, c = self.layout(), self.case
        kept = [[p[i][0, :, :n] for p, n in zip(parts, self.lengths)] for i in (1, 2)]
        call = layout.Call(q, layout.lay_out(kept[0], lay, len(parts), c.hkv, c.d),
                           layout.lay_out(kept[1], lay, len(parts), c.hkv, c.dv), self.lengths, lay,
                           num_splits=self.num_splits)
        if self.append:
            call.k_new, call.v_new = (np.stack([p[i][0, :, n:] for p, n in zip(parts, self.lengths)])
                                      for i in (1, 2))
        return call


@st.composite
def cached_batches(draw, impl=None, append=None, **case_kw):
    """A template case (fs.cases(**case_kw), batch 1), up to MAX_SEQUENCES - 1 more cache lengths,
    and the cache's layout, each only where ``impl`` (default: the test's) declares it; ``append``
    True always appends new keys (else drawn, where declared)."""
    impl = impl or context.current().impl
    case = draw(fs_draw.cases(**case_kw), label="template")
    if case.alibi is not None and np.ndim(case.alibi) == 2:
        case = case.replace(alibi=tuple(case.alibi[0]))  # per-batch slopes: one sequence's row
    case = case.replace(batch=1, dropout_p=0.0, dropout_seed=0)
    top = fs_draw.limits()["seq"]
    more = draw(st.lists(fs_draw.other_length(top), max_size=MAX_SEQUENCES - 1), label="more sequences")
    first = draw(st.integers(0, len(more)), label="position of the template") if more else 0
    c = Cached(case, tuple(more[:first] + [case.sk] + more[first:]))
    if append or (append is None and getattr(impl, "kv_append", False) and draw(st.booleans(), label="append")):
        # the template's keys: its cache less the appended ones (all of them new when it is short)
        held = max(0, case.sk - case.sq)
        c = Cached(case.replace(sk=held + case.sq), c.lengths[:first] + (held,) + c.lengths[first + 1:], append=True)
    if getattr(impl, "paged", False):
        sizes = impl.page_sizes or PAGE_SIZES
        order = draw(st.one_of(st.none(), st.integers(0, 2**16)), label="block order")
        # a kernel that takes both layouts gets contiguous caches too (None: first, where shrinking goes)
        both = (None,) if getattr(impl, "contiguous_cache", True) else ()
        page = draw(st.sampled_from(both + tuple(sizes)), label="page size")
        c = c.replace(page_size=page, order=order if page is not None else None)
    c = c.replace(spare=draw(st.integers(0, 3), label="spare"))
    if getattr(impl, "splits", False):
        c = c.replace(num_splits=draw(st.one_of(st.integers(1, 4), st.sampled_from((8, 17, 64))), label="splits"))
    return c


def _pages_for(impl, c: Cached) -> dict:
    """The page size ``impl`` takes: a pin's size outside its page_sizes becomes the nearest declared
    one (the smallest at least as large, else the largest), and a contiguous cache goes on pages in
    order where the kernel takes only paged caches (contiguous_cache=False)."""
    sizes = getattr(impl, "page_sizes", None) or PAGE_SIZES
    if c.page_size is None:
        return {} if getattr(impl, "contiguous_cache", True) else {"page_size": sizes[0]}
    if getattr(impl, "page_sizes", None) and c.page_size not in sizes:
        return {"page_size": min((n for n in sizes if n >= c.page_size), default=sizes[-1])}
    return {}


def fit(impl, c: Cached) -> Cached:
    """The template fitted to ``impl`` (fs.fit), then every other sequence's key count fitted alone;
    a sequence the kernel cannot run (or one inside a known issue) refuses the draw."""
    first = [c.keys(b) for b in range(len(c.lengths))].index(c.case.sk)  # the template's sequence
    case = fs_draw.fit(impl, c.case)
    added = case.sq if c.append else 0
    lengths = list(c.lengths)
    lengths[first] = case.sk - added
    for b, n in enumerate(lengths):
        keys = n + added
        if keys == 0 or (case.causal is not None and case.sq > keys):
            assume(impl.masked_rows)  # rows that see no key
        if b == first or keys == 0:
            continue
        s = fs_draw.supported(impl, case.replace(sk=keys))[0]
        assume(s is not None and not any(issue.applies(s) for issue in impl.known_issues))
        lengths[b] = s.sk - added
    assume(min(lengths) >= 0)
    fitted = c.replace(case=case, lengths=tuple(lengths), **_pages_for(impl, c))
    context.current().last_layout = fitted  # a failure's report shows the whole batch
    fs_draw._note(f"cached: {fitted!r}")
    return fitted
