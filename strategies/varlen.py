"""Packed batches of sequences of different lengths (varlen kernels; docs/features.md).

A ``Packed`` is a template AttentionCase (heads, head dims, dtype, causal alignment, scale,
features, logit regime) and one (Sq, Sk) pair per sequence. Sequence b is the template at
its own lengths and seed, so its inputs, its float64 truth and its bounds are a dense case's,
computed from its own magnitudes: the oracle's rule applies per sequence unchanged.

The draws shrink towards one sequence, at the template's own lengths: a failure that needs a
second sequence (keys leaking across a boundary, an offset that is one tile off) keeps one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from flashcheck.contract import packed as layout
from flashcheck.strategies import context
from flashcheck.strategies import draw as fs_draw
from flashcheck.strategies.case import AttentionCase

MAX_SEQUENCES = 5


@dataclass(frozen=True)
class Packed:
    case: AttentionCase  # the template: batch 1, and the first sequence's lengths
    lengths: tuple[tuple[int, int], ...]  # (Sq, Sk) per sequence; either may be 0

    def __repr__(self):
        return f"Packed({self.case!r}, lengths={self.lengths!r})"

    @property
    def lengths_q(self) -> list[int]:
        return [a for a, _ in self.lengths]

    @property
    def lengths_k(self) -> list[int]:
        return [b for _, b in self.lengths]

    def sequence(self, b: int) -> AttentionCase:
        """Sequence b as a dense case of batch 1 (its lengths may be 0: see ``inputs``)."""
        sq, sk = self.lengths[b]
        return self.case.replace(sq=sq, sk=sk, seed=(self.case.seed + b) % 2**32)

    def sequence_inputs(self, b: int):
        """q, k, v, dO of sequence b, each (1, H, S, D). An empty side has no rows; a sequence
        without keys gets plain normal queries (every one of its rows sees no key)."""
        c = self.sequence(b)
        if c.sq and c.sk:
            return c.inputs()
        rng = np.random.default_rng(c.seed)
        shapes = ((c.hq, c.sq, c.d), (c.hkv, c.sk, c.d), (c.hkv, c.sk, c.dv), (c.hq, c.sq, c.dv))
        from flashcheck.strategies.case import quantize

        return tuple(quantize(rng.standard_normal((1, *s)), c.dtype) for s in shapes)

    def inputs(self):
        """The packed batch: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), dO (Tq, Hq, Dv), float64."""
        parts = [self.sequence_inputs(b) for b in range(len(self.lengths))]
        return tuple(np.concatenate([layout.pack(p[i]) for p in parts], axis=0) for i in range(4))

    def spans(self):
        """Per sequence: (query token slice, key token slice)."""
        cq, ck = layout.offsets(self.lengths_q), layout.offsets(self.lengths_k)
        return [(slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1])))
                for b in range(len(self.lengths))]


@st.composite
def packed_batches(draw, **case_kw):
    """A template case (fs.cases(**case_kw), batch 1) and up to MAX_SEQUENCES - 1 more sequences.

    Tq != Tk comes from each sequence's own pair; a long sequence among short ones from the
    upper branch of the lengths; one sequence in several repeats its template's lengths."""
    case = draw(fs_draw.cases(**case_kw), label="template")
    if case.alibi is not None and np.ndim(case.alibi) == 2:
        case = case.replace(alibi=tuple(case.alibi[0]))  # per-batch slopes: one sequence's row
    case = case.replace(batch=1, dropout_p=0.0, dropout_seed=0)
    top = fs_draw.limits()["seq"]
    more = draw(st.lists(st.tuples(fs_draw.other_length(top), fs_draw.other_length(top)), max_size=MAX_SEQUENCES - 1),
                label="more sequences")
    first = draw(st.integers(0, len(more)), label="position of the template") if more else 0
    lengths = more[:first] + [(case.sq, case.sk)] + more[first:]
    return Packed(case, tuple(lengths))


def fit(impl, p: Packed) -> Packed:
    """The template fitted to ``impl`` (fs.fit), then every other sequence's lengths fitted alone;
    a sequence the kernel cannot run (or one inside a known issue) refuses the draw."""
    first = p.lengths.index((p.case.sq, p.case.sk))
    case = fs_draw.fit(impl, p.case)
    lengths = list(p.lengths)
    lengths[first] = (case.sq, case.sk)
    for b, (sq, sk) in enumerate(lengths):
        if sq and not sk:
            assume(impl.masked_rows)  # queries without keys: rows that see no key
        if b == first or 0 in (sq, sk):
            continue  # an empty side is the layout's own business: no case to fit
        c = fs_draw.supported(impl, case.replace(sq=sq, sk=sk))[0]
        assume(c is not None and not any(issue.applies(c) for issue in impl.known_issues))
        lengths[b] = (c.sq, c.sk)
    assume(sum(a for a, _ in lengths) > 0 and sum(b for _, b in lengths) > 0)
    fitted = Packed(case, tuple(lengths))
    context.current().last_layout = fitted  # a failure's report shows the whole batch
    fs_draw._note(f"packed: {fitted!r}")
    return fitted
