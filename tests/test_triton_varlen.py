"""triton-fused-varlen (impls/triton_varlen.py) on pinned packed batches, against each sequence's dense
float64 truth (forward and backward).

Its full property run is opt-in on CPU, where the kernels run in Triton's interpreter
(pytest -m properties --impl triton-fused-varlen); these pins cover what a packed-batch kernel gets
wrong, in seconds: sequences without queries or keys (with sinks too), one long sequence among short
ones (several tiles of the grid past the short ones), Tq != Tk, per-sequence causal diagonals both
ways, windows, softcap and per-sequence ALiBi slopes, NaN in every other sequence, equal-length
sequences against dense triton-fused bit for bit, and the refusals.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashcheck.contract import call, load, packed  # noqa: E402
from flashcheck.properties import test_varlen as props  # noqa: E402
from flashcheck.strategies import AttentionCase as Case  # noqa: E402
from flashcheck.strategies.varlen import Packed  # noqa: E402

tv = pytest.importorskip("flashcheck.impls.triton_varlen")
# on CPU these run in Triton's interpreter: -m "not interpreter" leaves them out there
pytestmark = [pytest.mark.properties, *([pytest.mark.interpreter] if tv.tf.INTERPRET else []),
              pytest.mark.skipif(not tv.tf.INTERPRET and not torch.cuda.is_available(),
                                 reason="needs CUDA, or TRITON_INTERPRET=1 set before triton is imported")]
BR, TL = "bottom_right", "top_left"
DEVICE = "cpu" if tv.tf.INTERPRET else "cuda"


def impl():
    return load("triton-fused-varlen")


def run_and_check(p: Packed, q=None, k=None, v=None, only=None):
    """Every sequence (or sequence ``only``) within its own bound, gradients included; an empty side
    exactly 0 / -inf. Returns the packed result."""
    res = props.run(impl(), p, q, k, v)
    for b in range(len(p.lengths)) if only is None else (only,):
        props.check_sequence(impl(), p, b, res, "pinned")
    return res


GQA = Case(hq=4, hkv=2, sq=5, sk=9, d=8, dv=5, dtype="float32")


@pytest.mark.parametrize("causal", [None, BR, TL])
def test_sequences_without_queries_or_keys(causal):
    # Tq = 12 != Tk = 20; the sequence of 4 queries and no keys gives O = 0, LSE = -inf, dQ = 0,
    # the one of 3 keys and no queries dK = dV = 0
    p = Packed(GQA.replace(causal=causal), ((5, 9), (0, 3), (4, 0), (3, 8)))
    res = run_and_check(p)
    assert (res.lse[:, 5:9] == -np.inf).all() and not res.o[5:9].any() and not res.dq[5:9].any()
    assert not res.dk[9:12].any() and not res.dv[9:12].any()


def test_a_sequence_without_keys_has_lse_minus_inf_even_with_sinks():
    p = Packed(GQA.replace(causal=BR, sinks=(0.5, -1.0, 2.0, -np.inf)), ((5, 9), (4, 0), (7, 3)))
    res = run_and_check(p)  # sequence 2: causal rows 0-3 see no key, and their LSE is the sink
    assert (res.lse[:, 5:9] == -np.inf).all()


@pytest.mark.parametrize("causal", [BR, TL])
def test_one_long_sequence_among_short_ones(causal):
    # 16-wide tiles: the long sequence spans five query and key tiles, the short ones return from
    # every tile past their first; GQA, window and softcap per sequence
    case = Case(hq=2, hkv=1, sq=70, sk=75, d=16, dv=16, dtype="float32", causal=causal, window=(20, 3),
                softcap=2.0)
    run_and_check(Packed(case, ((1, 1), (70, 75), (2, 3), (3, 0))))


def test_per_sequence_alibi_slopes_and_causal_diagonals_both_ways():
    """(B, Hq) slopes: sequence b reads row b; Sq > Sk in one sequence, Sq < Sk in another."""
    slopes = ((0.5, 0.25), (1.0, 0.125), (0.0, 2.0))
    case = Case(hq=2, hkv=2, sq=5, sk=9, d=4, dv=4, dtype="float32", causal=BR)
    p = Packed(case, ((5, 9), (9, 5), (17, 17)))
    lay = packed.layout_kw(p.lengths_q, p.lengths_k)(torch, DEVICE)
    q, k, v = (torch.tensor(x, dtype=torch.float32, device=DEVICE) for x in p.inputs()[:3])
    o, lse = tv.varlen_attention(q, k, v, **lay, causal=True, block_q=16, block_k=16,
                                 alibi_slopes=torch.tensor(slopes, dtype=torch.float32, device=DEVICE))
    for b, row in enumerate(slopes):  # each sequence alone, with its row as (Hq,) slopes: the same tiles
        c = p.sequence(b).replace(alibi=row)
        alone = props.run(impl(), Packed(c, ((c.sq, c.sk),)), backward=False)
        qs = p.spans()[b][0]
        assert np.array_equal(o[qs].double().cpu().numpy(), alone.o), f"sequence {b}: O differs from it alone"
        assert np.array_equal(lse[:, qs].double().cpu().numpy(), alone.lse), f"sequence {b}: LSE differs"
    run_and_check(Packed(case.replace(alibi=slopes[0]), p.lengths))


def test_nan_in_every_other_sequence_never_reaches_one():
    p = Packed(GQA.replace(causal=BR, window=(2, 1)), ((5, 9), (33, 17), (2, 0), (1, 40)))
    q, k, v, _ = p.inputs()
    for keep in (1, 3):
        qs, ks = p.spans()[keep]
        xs = [x.copy() for x in (q, k, v)]
        for x, s in zip(xs, (qs, ks, ks)):
            others = np.ones(x.shape[0], bool)
            others[s] = False
            x[others] = np.nan
        run_and_check(p, *xs, only=keep)


@pytest.mark.parametrize("causal", [None, BR, TL])
def test_equal_length_sequences_equal_dense_triton_fused_bit_for_bit(causal):
    """The same tiles on the same tokens: the packed path and the dense one compute alike."""
    c = Case(batch=2, hq=2, hkv=1, sq=33, sk=20, d=8, dv=8, dtype="float32", causal=causal, window=(5, -1),
             sinks=(0.1, -0.3))
    q, k, v, do = c.inputs()
    dense = call.run(load("triton-fused"), c, q, k, v, do)
    packed_ = packed.run_dense(impl(), c, q, k, v, do)
    for name in ("o", "lse", "dq", "dk", "dv"):
        a, b = getattr(dense, name), getattr(packed_, name)
        assert np.array_equal(a, b), f"{name}: packed differs from dense by {np.nanmax(np.abs(a - b)):.3e}"
    np.testing.assert_allclose(packed_.dsinks, dense.dsinks, rtol=1e-6, err_msg="dsinks")  # summed in another order


BAD = [
    (lambda kw: kw.update(cu_seqlens_q=kw["cu_seqlens_q"].long()), "int32"),
    (lambda kw: kw.update(cu_seqlens_k=kw["cu_seqlens_k"].flip(0)), "rise from 0"),
    (lambda kw: kw.update(max_seqlen_q=2), "max_seqlen_q"),
    (lambda kw: kw.update(alibi_slopes=torch.ones(2, 2, device=DEVICE)), "alibi_slopes"),
    (lambda kw: kw.update(window=(1,)), "window"),
    (lambda kw: kw.update(softcap=-1.0), "softcap"),
    (lambda kw: kw.update(sinks=torch.ones(1, 2, device=DEVICE)), "sinks"),
    (lambda kw: kw.update(block_q=24), "block_q"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_arguments_raise_naming_them(i):
    p = Packed(GQA.replace(hq=2, hkv=1), ((5, 9), (0, 3), (4, 0)))
    args = tuple(torch.tensor(x, dtype=torch.float32, device=DEVICE) for x in p.inputs()[:3])
    kw = packed.layout_kw(p.lengths_q, p.lengths_k)(torch, DEVICE)
    tv.varlen_attention(*args, **kw)
    change, word = BAD[i]
    change(kw)
    with pytest.raises((TypeError, ValueError), match=word):
        tv.varlen_attention(*args, **kw)
