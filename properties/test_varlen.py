"""Packed batches (varlen=True): each sequence is attention over its own keys, and nothing else."""
import numpy as np
import pytest
from hypothesis import assume, example, given, note
from hypothesis import strategies as st

from flashcheck import oracle as orc
from flashcheck.contract import call, packed
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import draw as fs_draw
from flashcheck.strategies import varlen as fv
from flashcheck.strategies.varlen import Packed

pytestmark = [pytest.mark.properties, pytest.mark.requires("varlen")]

picks = st.integers(0, fv.MAX_SEQUENCES - 1)


def every_dtype(test):
    """One ragged pin per dtype, on the coverage shapes: an empty side on each side, the lengths
    swapped in a third sequence (Tq != Tk), the regimes rotating."""
    for i, c in enumerate(reversed(ph.cover_cases())):
        if i % 7 == 0:
            test = example(p=Packed(c.replace(batch=1), ((c.sq, c.sk), (4, 0), (0, 3), (c.sk, c.sq))))(test)
    return test


def run(impl, p: Packed, q=None, k=None, v=None, backward=True):
    pq, pk, pv, do = p.inputs()
    return packed.run_packed(impl, p.case, pq if q is None else q, pk if k is None else k, pv if v is None else v,
                             do if backward and impl.has_backward else None, p.lengths_q, p.lengths_k)


def _names(res):
    return [n for n in ("o", "lse", "dq", "dk", "dv") if getattr(res, n) is not None]


def _slice(res, name, qs, ks):
    """One sequence's part of a packed result: lse is (Hq, Tq), the rest token-major."""
    x = getattr(res, name)
    return x[:, qs] if name == "lse" else x[ks] if name in ("dk", "dv") else x[qs]


def check_sequence(impl, p: Packed, b: int, res, who: str):
    """Sequence b of a packed result against its own float64 truth; an empty side exactly."""
    c, (qs, ks) = p.sequence(b), p.spans()[b]
    label = f"{impl.name} ({who}, sequence {b} of {len(p.lengths)}, lengths {p.lengths[b]})"
    for name in _names(res):
        part = _slice(res, name, qs, ks)
        if c.sq == 0 or c.sk == 0:  # no query, or no key: zeros, and -inf for the LSE of a row without keys
            want = np.full(part.shape, -np.inf if name == "lse" else 0.0)
            assert np.array_equal(part, want), (
                f"{label}: {name} of a sequence with {c.sq} queries and {c.sk} keys: expected "
                f"{'-inf' if name == 'lse' else 0} everywhere, got {part[part != want][:5]}\n  packed: {p!r}")
            continue
        dense = part[None] if name == "lse" else packed.unpack(part, 1, part.shape[0])
        orc.compare(c, name, dense, who=label)


@given(p=fv.packed_batches())
@every_dtype
@example(p=Packed(Case(sq=3, sk=5), ((3, 5),)))  # one sequence: the dense case
@example(p=Packed(Case(sq=2, sk=2, causal="bottom_right"), ((2, 2), (0, 4), (3, 0), (1, 1))))  # empty sides
@example(p=Packed(Case(sq=17, sk=17, d=16, dv=16, dtype="float32"), ((17, 17), (16, 16), (1, 33))))  # tile edges
@example(p=Packed(Case(sq=1, sk=1, hq=2, hkv=1), ((1, 1), (40, 40), (2, 3))))  # one long among short
@example(p=Packed(Case(sq=5, sk=9, causal="bottom_right"), ((5, 9), (9, 5))))  # causal per sequence, both ways
def test_each_packed_sequence_matches_its_own_dense_float64(impl, p):
    p = fv.fit(impl, p)
    check_each = run(impl, p)
    for b in range(len(p.lengths)):
        check_sequence(impl, p, b, check_each, "packed")


@given(p=fv.packed_batches(), pick=picks)
@example(p=Packed(Case(sq=3, sk=3), ((3, 3), (2, 4))), pick=0)
@example(p=Packed(Case(sq=3, sk=3, causal="bottom_right"), ((2, 4), (3, 3), (0, 2))), pick=1)
def test_nan_in_every_other_sequence_never_reaches_a_sequence(impl, p, pick):
    p = fv.fit(impl, p)
    assume(len(p.lengths) > 1)
    b = pick % len(p.lengths)
    qs, ks = p.spans()[b]
    note(f"kept sequence {b}: query tokens {qs.start}..{qs.stop}, key tokens {ks.start}..{ks.stop}")
    q, k, v, _ = p.inputs()
    # isolates_nan=False (a document mask: hidden keys still enter the products, times 0): values of 64
    # instead, 20-60x the sequence's own, which a probability that is not exactly 0 carries into it; small
    # enough that dO . v stays finite in float16 (64 * D * |dO| < 65504), where a kernel may round dP
    poison = np.nan if impl.isolates_nan else 64.0
    for x, keep in ((q, qs), (k, ks), (v, ks)):
        others = np.ones(x.shape[0], bool)
        others[keep] = False
        x[others] = poison
    res = run(impl, p, q, k, v)
    check_sequence(impl, p, b, res, "every other sequence NaN" if impl.isolates_nan else "every other sequence 64")


@given(p=fv.packed_batches())
@example(p=Packed(Case(sq=4, sk=4, causal="top_left"), ((4, 4), (7, 2), (1, 9))))
def test_a_packed_batch_equals_its_sequences_called_one_by_one(impl, p):
    p = fv.fit(impl, p)
    together = run(impl, p)
    for b, (qs, ks) in enumerate(p.spans()):
        c = p.sequence(b)
        if c.sq == 0 or c.sk == 0:
            continue  # a batch of one empty sequence holds no tokens to call with
        alone = run(impl, Packed(c, ((c.sq, c.sk),)))
        for name in _names(together):
            got = _slice(together, name, qs, ks)
            want = getattr(alone, name)
            as_dense = (lambda x: x[None]) if name == "lse" else (lambda x: packed.unpack(x, 1, x.shape[0]))
            budget = 2 * orc.allowed(c, name)
            orc.compare(c, name, as_dense(got), want=as_dense(want), budget=budget,
                        who=f"{impl.name} (sequence {b} of {len(p.lengths)} in one call, against it alone)")


# name -> a change of exactly one thing in a valid packed call's offsets, and a word our own kernels use
BAD_OFFSETS = {
    "int64": (lambda torch, cu, n: cu.to(torch.int64), "int32"),
    "short_of_the_tokens": (lambda torch, cu, n: torch.cat([cu[:-1], cu[-1:] - 1]), "rise from 0"),
    "past_the_tokens": (lambda torch, cu, n: torch.cat([cu[:-1], cu[-1:] + 1]), "rise from 0"),
    "decreasing": (lambda torch, cu, n: torch.cat([cu[:1], cu[2:3], cu[1:2], cu[3:]]), "rise from 0"),
    "not_starting_at_0": (lambda torch, cu, n: cu + 1, "rise from 0"),
    "one_sequence_fewer": (lambda torch, cu, n: torch.cat([cu[:1], cu[2:]]), "sequences"),
}
OWN = ("torch-tiled-varlen", "triton-fused-varlen")


@pytest.mark.input_validation
@pytest.mark.parametrize("bad", sorted(BAD_OFFSETS))
def test_malformed_cu_seqlens_raise_a_named_error(impl, bad):
    import torch

    case = fs_draw.supported(impl, Case(hq=2, hkv=1, sq=3, sk=4, d=4, dv=4, dtype="float32"))[0]
    if case is None:
        pytest.skip(f"{impl.name}: its supports() refuses the starting case")
    p = Packed(case, ((case.sq, case.sk), (2, 2), (case.sk, case.sq)))
    q, k, v, _ = p.inputs()
    device = call.device_for(impl)
    args = tuple(torch.from_numpy(x).to(device=device, dtype=getattr(torch, p.case.dtype)) for x in (q, k, v))
    kw = {**call.kwargs_for(impl, p.case), **packed.layout_kw(p.lengths_q, p.lengths_k)(torch, device)}
    change, word = BAD_OFFSETS[bad]
    ph.assert_one_change_is_refused(
        impl, args, kw, lambda kw: kw.update(cu_seqlens_k=change(torch, kw["cu_seqlens_k"], len(p.lengths))), word, OWN)
