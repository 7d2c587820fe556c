"""FlexAttention on CPU: one pinned case per feature and their combination, for CI.

Eager FlexAttention is too slow on CPU for the whole property suite in CI (impls/flex.py tags
it slow there); ``pytest -m properties --impl flex`` runs every property on it.
"""
import pytest
import torch

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

flex = pytest.importorskip("flashcheck.impls.flex")
pytestmark = pytest.mark.properties

CASES = [
    Case(hq=4, hkv=2, sq=5, sk=7, d=3, dv=2, causal="bottom_right"),
    Case(sq=6, sk=3, d=2, window=(1, 0), dtype="float32"),  # Sq > Sk: rows that see nothing
    Case(sq=4, sk=6, causal="top_left", window=(2, 3)),
    Case(sq=3, sk=5, softcap=0.05, regime="large", dtype="float32"),
    Case(batch=2, hq=2, sq=4, sk=6, alibi=((0.5, -0.25), (1.0, 0.0))),
    Case(hq=2, sq=4, sk=2, causal="bottom_right", sinks=(0.5, -1e30)),
    Case(batch=2, hq=4, hkv=2, sq=5, sk=7, causal="bottom_right", mask=("rows", True, True, 0.5, 3)),  # per entry and head
    Case(hq=2, sq=4, sk=6, window=(2, -1), mask=("random", False, False, 0.5, 1)),  # a shared mask with a window
    Case(hq=2, hkv=1, sq=5, sk=4, d=4, causal="bottom_right", window=(2, -1), softcap=3.0, alibi=(0.25, 0.5),
         sinks=(1.0, -2.0), dtype="float16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "+".join(c.features) or "plain")
def test_flex_on_cpu_matches_dense_float64(case):
    impl = flex.attention.__flashcheck__
    if impl.devices != ("cpu",):
        pytest.skip("flex runs compiled on CUDA here: the gpu lane runs every property on it")
    case = fs.fit(impl, case)
    res = ph.forward(impl, case)
    orc.compare(case, "o", res.o, who="flex")
    orc.compare(case, "lse", res.lse, who="flex")


# Compiled FlexAttention (CUDA) must run compiled on every call. What CPU can check of it runs here
# through dynamo with its "eager" backend (inductor's first compile of flex takes about a minute on
# CPU): the graphs dynamo captures, how many it recompiles, and the guard that fails a fall-back.
# scratch/flex_gpu_check.py checks the same on a GPU, with inductor.
SHAPES = [(2, 3), (4, 6), (7, 7), (9, 2), (17, 33), (5, 5), (6, 3), (8, 8), (10, 11), (12, 13)]


def test_compiled_flex_runs_compiled_for_more_shapes_than_dynamo_s_default_recompile_limit(monkeypatch):
    if flex._CUDA:
        pytest.skip("on CUDA every flex property runs through the guard, compiled by inductor")
    guard = flex.Compiled(flex.flex_attention, backend="eager")
    monkeypatch.setattr(flex, "_runner", lambda q: guard)
    impl = flex.attention.__flashcheck__
    for sq, sk in SHAPES:  # more distinct shapes than dynamo's default limit of 8 recompiles
        case = Case(hq=2, sq=sq, sk=sk, d=4, dv=4, causal="bottom_right", window=(3, -1), dtype="float32")
        res = ph.forward(impl, case)
        orc.compare(case, "o", res.o, who="compiled flex")
    assert guard.runs == len(SHAPES), f"expected every call to run a compiled graph, got {guard.runs} of {len(SHAPES)}"
        # static shapes: a graph per length, past dynamo's default limit of 8, and none run eager
    assert guard.compiles == len(SHAPES), f"expected a graph per length ({len(SHAPES)}), got {guard.compiles}"


def test_a_new_scale_or_softcap_value_compiles_no_new_graph(monkeypatch):
    """The suite draws scales and softcaps freely: captured as Python floats, each value was a dynamo
    guard and a graph of its own, so compiled flex recompiled on nearly every example."""
    if flex._CUDA:
        pytest.skip("on CUDA every flex property runs through the guard, compiled by inductor")
    guard = flex.Compiled(flex.flex_attention, backend="eager")
    monkeypatch.setattr(flex, "_runner", lambda q: guard)
    impl = flex.attention.__flashcheck__
    for scale, softcap in [(0.1, 2.0), (0.7, 3.0), (None, 0.5), (0.0, 40.0)]:
        case = Case(hq=2, sq=5, sk=6, d=4, dv=4, scale=scale, softcap=softcap, dtype="float32")
        orc.compare(case, "o", ph.forward(impl, case).o, who="compiled flex")
    assert guard.compiles == 1, f"expected one graph for four scales and softcaps, got {guard.compiles}"


def test_a_call_that_runs_no_compiled_graph_raises_instead_of_returning_eager_results():
    guard = flex.Compiled(lambda x: x + 1, backend="eager")
    assert guard(torch.ones(3)).tolist() == [2.0] * 3 and guard.runs == 1
    guard.fn = lambda x: x + 1  # dynamo's silent fall-back, as torch runs it past the recompile limit
    with pytest.raises(flex.RanEager, match="returned without running a compiled graph"):
        guard(torch.ones(3))


def test_reaching_dynamo_s_recompile_limit_raises_instead_of_running_eager(monkeypatch):
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
    guard = flex.Compiled(lambda x, word: x + len(word), backend="eager")  # a str argument: a graph per value
    guard(torch.ones(1), "a")
    with pytest.raises(flex.RanEager, match=r"reached dynamo's recompile limit \(1\) and would have run eager"):
        guard(torch.ones(1), "bb")


def test_the_limits_are_raised_and_a_hit_is_an_error_only_inside_a_compiled_call():
    cfg = torch._dynamo.config
    before = (cfg.recompile_limit, cfg.fail_on_recompile_limit_hit)
    with flex._limits():
        assert (cfg.recompile_limit, cfg.accumulated_recompile_limit, cfg.fail_on_recompile_limit_hit) == (
            flex.RECOMPILE_LIMIT, flex.RECOMPILE_LIMIT, True), "expected the raised limits and a hard failure"
    assert (cfg.recompile_limit, cfg.fail_on_recompile_limit_hit) == before, "the user's dynamo settings changed"


@pytest.mark.slow  # inductor's first compile of FlexAttention takes 20-60 s on a 2-core CPU
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the eager reference
def test_inductor_compiles_every_mask_and_score_the_built_in_captures():
    """What compiles on CPU (inference, no LSE) of what CUDA compiles: every number the mods capture
    must lower (a captured Python float did not: "unbacked_bindings"), at several lengths."""
    guard = flex.Compiled(flex.flex_attention)
    slopes = torch.tensor([[0.5, 0.25]])
    for sq, sk, window, cap, alibi, tensor in [(5, 9, (4, -1), 5.0, slopes, False), (17, 33, (4, -1), 30.0, slopes, True),
                                               (40, 12, (-1, 2), 0.0, None, False)]:
        q, k, v = torch.randn(1, 2, sq, 16), torch.randn(1, 2, sk, 16), torch.randn(1, 2, sk, 16)
        attn = (torch.rand(1, 2, sq, sk) < 0.7) if tensor else None  # a mask tensor, per head
        mask = flex.create_block_mask(flex._mask_mod(sq, sk, "bottom_right", window, "cpu", attn),
                                      1 if tensor else None, 2 if tensor else None, sq, sk, device="cpu")
        mod = flex._score_mod(sq, sk, 0.5, cap, alibi, "cpu", torch.float32)
        with torch.no_grad():
            got = guard(q, k, v, block_mask=mask, score_mod=mod, scale=1.0)
            want = flex.flex_attention(q, k, v, block_mask=mask, score_mod=mod, scale=1.0)
        assert torch.allclose(got, want, atol=1e-5), f"compiled and eager flex differ at Sq={sq}, Sk={sk}"
