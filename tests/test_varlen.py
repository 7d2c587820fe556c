"""Packed batches: the layout round-trips, the strategy reaches the ragged corners and shrinks to
one sequence, and a packed batch's sequences are the dense cases they claim to be."""
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, settings

from flashcheck.contract import packed
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import varlen as fv
from flashcheck.strategies.varlen import Packed

pytestmark = [pytest.mark.properties, ph.CPU_PROFILES_ONLY]

SEARCH = settings(max_examples=2000, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
FIRST_FOUND = settings(SEARCH, phases=[Phase.generate])


def test_pack_then_unpack_gives_back_the_dense_batch():
    x = np.random.default_rng(0).standard_normal((3, 2, 5, 4))
    flat = packed.pack(x)
    assert flat.shape == (15, 2, 4), f"expected (B * S, H, D) = (15, 2, 4), got {flat.shape}"
    assert np.array_equal(flat[5:10], x[1].transpose(1, 0, 2)), "expected sequence 1 at tokens 5..10"
    assert np.array_equal(packed.unpack(flat, 3, 5), x), "expected unpack(pack(x)) == x"


def test_offsets_are_zero_then_the_running_sum():
    assert packed.offsets([3, 0, 2]).tolist() == [0, 3, 3, 5]
    assert packed.offsets([]).tolist() == [0]


def test_each_sequence_of_a_packed_batch_holds_its_own_dense_inputs():
    p = Packed(Case(hq=2, hkv=1, sq=3, sk=4, d=5, dv=2, dtype="float32", regime="large"), ((3, 4), (0, 2), (2, 0)))
    q, k, v, do = p.inputs()
    assert (q.shape, k.shape, v.shape, do.shape) == ((5, 2, 5), (6, 1, 5), (6, 1, 2), (5, 2, 2))
    (qs, ks), *_ = p.spans()
    dense = p.sequence(0).inputs()
    for name, got, want in zip("q k v dO".split(), (q[qs], k[ks], v[ks], do[qs]), dense):
        assert np.array_equal(packed.unpack(got, 1, got.shape[0]), want), f"sequence 0's {name} is not its case's"
    assert p.sequence(1).seed == p.case.seed + 1, "expected sequence b to use the template's seed + b"


REGIONS = {
    "several sequences": lambda p: len(p.lengths) >= 3,
    "a sequence without queries": lambda p: any(a == 0 < b for a, b in p.lengths),
    "a sequence without keys": lambda p: any(b == 0 < a for a, b in p.lengths),
    "Tq != Tk": lambda p: sum(p.lengths_q) != sum(p.lengths_k),
    "a tile edge": lambda p: any(n in (15, 16, 17, 31, 32, 33) for n in p.lengths_q + p.lengths_k),
    "one long among short": lambda p: len(p.lengths) >= 3 and max(p.lengths_k) >= 20
    and sorted(p.lengths_k)[-2] <= 2,
}


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_packed_batches_reach(region):
    found = find(fv.packed_batches(), REGIONS[region], settings=FIRST_FOUND)
    assert REGIONS[region](found), f"expected a packed batch with {region}, got {found!r}"


def test_a_failure_that_needs_two_sequences_shrinks_to_two_short_ones():
    """A bug at a sequence boundary keeps a second sequence, and nothing more."""
    found = find(fv.packed_batches(), lambda p: len(p.lengths) >= 2 and p.lengths[1][1] > 0, settings=SEARCH)
    assert len(found.lengths) == 2 and max(found.lengths_q + found.lengths_k) <= 1, (
        f"expected two sequences of at most one token each, got {found!r}")


def test_a_failure_of_any_batch_shrinks_to_one_sequence():
    found = find(fv.packed_batches(), lambda p: True, settings=SEARCH)
    assert found.lengths == ((1, 1),), f"expected one sequence of one query and one key, got {found!r}"


def test_the_varlen_example_agrees_with_each_sequence_s_truth():
    from flashcheck import oracle as orc
    from flashcheck.contract import load

    impl = load("examples/flash_attn_varlen_style.py:attention")
    p = Packed(Case(hq=2, hkv=1, sq=3, sk=5, d=4, dv=4, causal="bottom_right"), ((3, 5), (4, 2), (0, 3), (2, 0)))
    q, k, v, do = p.inputs()
    res = packed.run_packed(impl, p.case, q, k, v, do, p.lengths_q, p.lengths_k)
    for b, (qs, ks) in enumerate(p.spans()[:2]):
        c = p.sequence(b)
        orc.compare(c, "o", packed.unpack(res.o[qs], 1, c.sq), who=f"{impl.name} sequence {b}")
        orc.compare(c, "dk", packed.unpack(res.dk[ks], 1, c.sk), who=f"{impl.name} sequence {b}")
    assert not res.o[p.spans()[3][0]].any(), "expected O = 0 for a sequence without keys"


def test_the_torch_varlen_attn_plugin_declares_what_its_torch_takes(monkeypatch):
    """examples/torch_varlen_attn.py wraps torch's own varlen FlashAttention (CUDA only): it declares
    GQA, the window and the scale from the signature of the torch it runs on, and maps causal to
    FlashAttention's window right edge of 0."""
    import inspect

    import torch

    from flashcheck.contract import load

    impl = load("examples/torch_varlen_attn.py:attention")
    mod = __import__(impl.fn.__module__)
    takes = set(inspect.signature(mod.varlen_attn).parameters) if mod.varlen_attn is not None else set()
    assert (impl.gqa, impl.window, impl.scale_arg) == ("enable_gqa" in takes, "window_size" in takes,
                                                        "scale" in takes), f"declared against {sorted(takes)}"
    assert impl.devices == ("cuda",) and impl.varlen and impl.causal == ("bottom_right",)
    monkeypatch.setattr(mod, "TAKES", {"scale", "window_size", "enable_gqa"})
    q, k = torch.zeros(4, 4, 8), torch.zeros(6, 2, 8)
    for causal, window, want in [(True, (-1, -1), (-1, 0)), (True, (3, 2), (3, 0)), (False, (3, 2), (3, 2)),
                                 (True, (4, -1), (4, 0)), (False, (-1, -1), (-1, -1))]:
        kw = mod._keywords(q, k, causal, 0.5, window)
        assert kw == {"scale": 0.5, "window_size": want, "enable_gqa": True}, f"causal={causal} {window}: {kw}"
    monkeypatch.setattr(mod, "TAKES", {"is_causal"})  # torch 2.9
    assert mod._keywords(q, k, True, None, (-1, -1)) == {"is_causal": True}


def test_isolates_nan_false_goes_with_varlen():
    from flashcheck.contract import ContractError, implementation

    with pytest.raises(ContractError, match="goes with varlen=True"):
        implementation(name="bad-isolation", register=False, isolates_nan=False)(lambda q, k, v, **_: q)
    ok = implementation(name="document-mask", register=False, varlen=True, isolates_nan=False)(lambda q, k, v, **_: q)
    got = ok.__flashcheck__.isolates_nan
    assert got is False, f"expected the declaration kept, got isolates_nan={got!r}"
