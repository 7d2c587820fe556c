"""FlexAttention on CPU: one pinned case per feature and their combination, and pinned packed batches
on flex-varlen, for CI.

Eager FlexAttention is too slow on CPU for the whole property suite in CI (impls/flex.py tags
both built-ins slow there); ``pytest -m properties --impl flex`` (or ``--impl flex-varlen``) runs
every property on them.
"""
import numpy as np
import pytest
import torch

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.contract import load, packed
from flashcheck.properties import helpers as ph
from flashcheck.properties import test_known_issues as known
from flashcheck.properties import test_varlen as props
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies.varlen import Packed

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
    Case(batch=2, hq=4, hkv=2, sq=5, sk=7, causal="top_left", bias=("normal", True, True, 3.0, 1)),  # per entry, head
    # -inf hides keys (empties some rows), after the softcap and ALiBi, shared by the batch
    Case(batch=2, hq=2, sq=6, sk=4, softcap=2.0, alibi=(0.5, -0.25), bias=("ninf", False, True, 0.5, 2),
         dtype="float32"),
    Case(sq=3, sk=5, bias=("min", True, False, 1.0, 3), dtype="float16"),  # all finfo.min: uniform rows, not empty
    Case(hq=2, sq=4, sk=6, window=(2, -1), mask=("random", False, False, 0.7, 1), bias=("ninf", False, False, 0.25, 4),
         sinks=(0.5, -1.0)),
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


def test_flex_s_log2_lse_overflow_is_declared_and_still_reproduces():
    """A row of float32 logits at finfo.min: flex's LSE is -inf (impls/flex.py, LSE_LOG2_OVERFLOW)."""
    impl = flex.attention.__flashcheck__
    assert flex.LSE_LOG2_OVERFLOW in impl.known_issues
    known.test_each_known_issue_still_reproduces(impl)
    # a row with one key biased at finfo.min among ordinary ones is outside the issue, and passes
    case = fs.fit(impl, Case(sq=3, sk=5, bias=("min", True, False, 0.3, 3), dtype="bfloat16"))
    assert not flex.LSE_LOG2_OVERFLOW.applies(case), "expected only rows of finfo.min alone to be declared"
    orc.compare(case, "lse", ph.forward(impl, case).lse, who="flex")


# Compiled FlexAttention (CUDA) must run compiled on every call. What CPU can check of it runs here
# through dynamo with its "eager" backend (inductor's first compile of flex takes about a minute on
# CPU): the graphs dynamo captures, how many it recompiles, and the guard that fails a fall-back.
# scratch/flex_gpu_check.py checks the same on a GPU, with inductor.
SHAPES = [(2, 3), (4, 6), (7, 7), (9, 2), (17, 33), (5, 5), (6, 3), (8, 8), (10, 11), (12, 13)]


def test_compiled_flex_runs_compiled_for_more_shapes_than_dynamo_s_default_recompile_limit(monkeypatch):
    if flex._CUDA:
        pytest.skip("on CUDA every flex property runs through the guard, compiled by inductor")
    guard = flex.Compiled(flex.flex_attention, backend="eager")
    monkeypatch.setattr(flex, "_runner", lambda q, **kw: guard)
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
    monkeypatch.setattr(flex, "_runner", lambda q, **kw: guard)
    impl = flex.attention.__flashcheck__
    for scale, softcap in [(0.1, 2.0), (0.7, 3.0), (None, 0.5), (0.0, 40.0)]:
        case = Case(hq=2, sq=5, sk=6, d=4, dv=4, scale=scale, softcap=softcap, dtype="float32")
        orc.compare(case, "o", ph.forward(impl, case).o, who="compiled flex")
    assert guard.compiles == 1, f"expected one graph for four scales and softcaps, got {guard.compiles}"


def test_compiled_flex_compiles_for_dynamic_shapes_except_where_its_known_issue_lives(monkeypatch):
    """A graph per feature combination, whatever the lengths; the GQA + block mask shapes of
    GQA_NO_VALID_CHOICES keep a graph per shape (found and probed that way), and so does every shape
    with FLASHCHECK_FLEX_STATIC=1."""
    if flex._CUDA:
        pytest.skip("on CUDA every flex property runs through the guard, compiled by inductor")
    guards = {}
    monkeypatch.setattr(flex, "_runner", lambda q, dynamic=False: guards.setdefault(
        dynamic, flex.Compiled(flex.flex_attention, backend="eager", dynamic=dynamic)))
    impl = flex.attention.__flashcheck__
    outside = [Case(hq=4, hkv=2, sq=sq, sk=sk, d=4, dv=4, causal="bottom_right", dtype="float32")
               for sq, sk in ((40, 64), (17, 9), (30, 100))]  # Sq G <= 128 (and one 128-row block: a count
    # of 1 is a size dynamo specializes, so more blocks are a second graph)
    inside = Case(hq=4, hkv=2, sq=70, sk=64, d=4, dv=4, causal="bottom_right", dtype="float32")  # 70 < 128 < 140
    for case in outside + [inside]:
        orc.compare(case, "o", ph.forward(impl, case).o, who="compiled flex")
    assert guards[True].compiles == 1 and guards[True].runs == 3, (
        f"expected one dynamic graph for three lengths, got {guards[True].compiles} for {guards[True].runs} calls")
    assert guards[False].runs == 1, "expected the known issue's shape on a static graph"
    monkeypatch.setenv("FLASHCHECK_FLEX_STATIC", "1")
    ph.forward(impl, outside[0])
    assert guards[False].runs == 2, "expected FLASHCHECK_FLEX_STATIC=1 to compile statically"


def test_every_alignment_window_softcap_alibi_batch_and_head_count_shares_one_graph(monkeypatch):
    """Where compiled, flex pads batch and kv heads to multiples of 4 (flex_attention marks heads static,
    dynamo specializes the batch) and keeps one score_mod and one band mask_mod for every combination of
    these features: one graph for all of them, where there was a graph per combination and shape. (The
    group size Hq / Hkv stays a graph of its own, as do the dtype and head dim.)"""
    if flex._CUDA:
        pytest.skip("on CUDA every flex property runs through the guard, compiled by inductor")
    guard = flex.Compiled(flex.flex_attention, backend="eager", dynamic=True)
    monkeypatch.setattr(flex, "_runner", lambda q, dynamic=False: guard)
    monkeypatch.setattr(flex, "PAD", True)
    impl = flex.attention.__flashcheck__
    cases = [Case(sq=5, sk=6, d=4, dv=4, dtype="float32"), Case(batch=2, hq=3, hkv=3, sq=9, sk=4, d=4, dv=4, causal="top_left",
                                                                 dtype="float32"),
             Case(batch=3, hq=2, hkv=2, sq=7, sk=7, d=4, dv=4, causal="bottom_right", window=(2, -1),
                  dtype="float32"),
             Case(hq=4, hkv=4, sq=6, sk=9, d=4, dv=4, window=(-1, 1), softcap=2.0, dtype="float32"),
             Case(batch=2, hq=2, hkv=2, sq=4, sk=5, d=4, dv=4, causal="bottom_right", alibi=(0.5, 0.25), softcap=5.0,
                  dtype="float32")]
    for case in cases:
        case = fs.fit(impl, case)
        orc.compare(case, "o", ph.forward(impl, case).o, who="compiled flex")
        orc.compare(case, "lse", ph.forward(impl, case).lse, who="compiled flex")
    assert guard.compiles == 1, f"expected one graph for {len(cases)} feature combinations, got {guard.compiles}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "+".join(c.features) or "plain")
def test_padding_batch_and_heads_changes_no_bit_of_the_real_ones(case, monkeypatch):
    impl = flex.attention.__flashcheck__
    case = fs.fit(impl, case)
    results = []
    for pad in (False, True):
        monkeypatch.setattr(flex, "PAD", pad)
        results.append(ph.forward(impl, case))
    for name in ("o", "lse"):
        plain, padded = (getattr(r, name) for r in results)
        assert np.array_equal(plain, padded, equal_nan=True), (
            f"expected {name} unchanged by padding, largest difference {np.nanmax(np.abs(plain - padded))}\n  "
            f"case: {case!r}")


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


# flex-varlen: a packed batch as one sequence under a document mask. Pinned batches against each
# sequence's own float64 truth (the varlen properties' check), as tests/test_triton_varlen.py pins
# triton-fused-varlen; the whole property file runs with pytest -m properties --impl flex-varlen.
BR, TL = "bottom_right", "top_left"
GQA = Case(hq=4, hkv=2, sq=5, sk=9, d=8, dv=5, dtype="float32")


def varlen():
    impl = load("flex-varlen")
    if impl.devices != ("cpu",):
        pytest.skip("flex-varlen runs compiled on CUDA here: the gpu lane runs every property on it")
    return impl


def run_and_check(p: Packed, q=None, k=None, v=None, only=None):
    """Every sequence (or sequence ``only``) within its own bound; an empty side exactly 0 / -inf."""
    res = props.run(varlen(), p, q, k, v)
    for b in range(len(p.lengths)) if only is None else (only,):
        props.check_sequence(varlen(), p, b, res, "pinned")
    return res


@pytest.mark.parametrize("causal", [None, BR, TL])
def test_flex_varlen_sequences_without_queries_or_keys(causal):
    # Tq = 12 != Tk = 20; the sequence of 4 queries and no keys gives O = 0 and LSE = -inf
    res = run_and_check(Packed(GQA.replace(causal=causal), ((5, 9), (0, 3), (4, 0), (3, 8))))
    assert (res.lse[:, 5:9] == -np.inf).all() and not res.o[5:9].any(), "expected O = 0, LSE = -inf without keys"


@pytest.mark.parametrize("causal", [BR, TL])
def test_flex_varlen_window_softcap_and_alibi_per_sequence(causal):
    # Sq > Sk in one sequence and Sq < Sk in another: each its own diagonal; the window empties rows
    case = GQA.replace(hq=2, hkv=1, causal=causal, window=(2, 1), softcap=2.0, alibi=(0.5, -0.25))
    run_and_check(Packed(case, ((5, 9), (9, 5), (1, 1), (6, 2))))


def test_flex_varlen_sequence_without_keys_has_lse_minus_inf_even_with_sinks():
    p = Packed(GQA.replace(causal=BR, sinks=(0.5, -1.0, 2.0, -np.inf), dtype="float16"), ((5, 9), (4, 0), (7, 3)))
    res = run_and_check(p)  # sequence 2: causal rows 0-3 see no key, and their LSE is the sink
    assert (res.lse[:, 5:9] == -np.inf).all(), "expected LSE = -inf for a sequence without keys, sinks or not"


def test_flex_varlen_per_sequence_alibi_slopes():
    """(B, Hq) slopes: sequence b reads row b, against its own truth with that row as its slopes."""
    slopes = ((0.5, 0.25), (1.0, -0.125), (0.0, 2.0))
    p = Packed(Case(hq=2, hkv=2, sq=5, sk=9, d=4, dv=4, dtype="float64", causal=BR), ((5, 9), (9, 5), (3, 3)))
    q, k, v = (torch.tensor(x) for x in p.inputs()[:3])
    o, lse = varlen().fn(q, k, v, **packed.layout_kw(p.lengths_q, p.lengths_k)(torch, "cpu"), causal=True,
                         alibi_slopes=torch.tensor(slopes, dtype=torch.float32))
    for b, (qs, _) in enumerate(p.spans()):
        c = p.sequence(b).replace(alibi=slopes[b])
        orc.compare(c, "o", packed.unpack(o[qs].numpy(), 1, c.sq), who=f"flex-varlen, sequence {b}")
        orc.compare(c, "lse", lse[None, :, qs].numpy(), who=f"flex-varlen, sequence {b}")


def _nan_outside(p: Packed, keep: int, names: str):
    """The batch's q, k, v with every token of every sequence but ``keep`` NaN in the tensors ``names``."""
    q, k, v, _ = p.inputs()
    qs, ks = p.spans()[keep]
    for name, x, s in (("q", q, qs), ("k", k, ks), ("v", v, ks)):
        if name in names:
            others = np.ones(x.shape[0], bool)
            others[s] = False
            x[others] = np.nan
    return q, k, v


NAN_BATCH = Packed(GQA.replace(causal=BR, window=(2, 1)), ((5, 9), (3, 17), (2, 0), (1, 4)))


def test_flex_varlen_nan_in_every_other_sequence_s_queries_and_keys_never_reaches_one():
    for keep in (1, 3):
        run_and_check(NAN_BATCH, *_nan_outside(NAN_BATCH, keep, "qk"), only=keep)


def test_flex_varlen_nan_in_another_sequence_s_values_reaches_every_sequence():
    """A limitation of a document mask, found by the varlen property test_nan_in_every_other_sequence_
    never_reaches_a_sequence: flex hides another sequence's keys by giving them probability 0, and
    0 * NaN = NaN in P V (eager flex multiplies the whole P by V; a fused kernel does so in every
    key block that two sequences share). Finite values never leak. flex-varlen declares it
    (isolates_nan=False); when this stops reproducing, the declaration can go."""
    q, k, v = _nan_outside(NAN_BATCH, 1, "v")
    res = props.run(varlen(), NAN_BATCH, q, k, v)
    qs = NAN_BATCH.spans()[1][0]
    assert np.isnan(res.o[qs]).all(), "expected NaN values of other sequences to reach sequence 1 through 0 * NaN"
    assert np.isfinite(res.lse[:, qs]).all(), "expected the LSE (no values in it) to stay finite"


def test_compiled_flex_varlen_compiles_one_graph_for_any_offsets_causal_mode_and_window(monkeypatch):
    """Compiled (CUDA), the offsets, the causal diagonals and the window reach the mask_mod as one
    band per query token, captured tensors: a batch of the same token counts compiles no new graph.
    Checked here through dynamo's "eager" backend, as flex's own guard is above."""
    if flex._CUDA:
        pytest.skip("on CUDA every flex-varlen property runs through the guard, compiled by inductor")
    guard = flex.Compiled(flex.flex_attention, backend="eager")
    monkeypatch.setattr(flex, "_runner", lambda q, **kw: guard)
    case = GQA.replace(softcap=2.0, alibi=(0.5, 0.25, -0.5, 1.0))
    batches = [Packed(case.replace(causal=BR), ((5, 9), (0, 3), (4, 0), (3, 8))),
               Packed(case.replace(causal=TL, window=(1, 2)), ((5, 9), (7, 11))),
               Packed(case.replace(window=(0, -1)), ((5, 9), (2, 2), (2, 2), (3, 7)))]
    for p in batches:  # 12 query and 20 key tokens each
        run_and_check(p)
    assert guard.runs == len(batches), f"expected every call to run a compiled graph, got {guard.runs}"
    assert guard.compiles == 1, f"expected one graph for one (Tq, Tk), got {guard.compiles}"


def test_compiled_flex_varlen_compiles_one_graph_for_any_token_counts_and_features(monkeypatch):
    """flex-varlen compiles for dynamic shapes (``_run(..., dynamic=True)``) with the softcap and ALiBi
    always in its score_mod: batches of other token counts, with or without a softcap or ALiBi, reuse
    the graph of the first, where static shapes would compile one graph per batch and feature set."""
    if flex._CUDA:
        pytest.skip("on CUDA every flex-varlen property runs through the guard, compiled by inductor")
    guards = {}
    monkeypatch.setattr(flex, "_runner", lambda q, dynamic=False: guards.setdefault(
        dynamic, flex.Compiled(flex.flex_attention, backend="eager", dynamic=dynamic)))
    case = GQA.replace(causal=BR)
    batches = [Packed(case.replace(softcap=2.0), ((5, 9), (0, 3), (4, 0), (3, 8))),
               Packed(case, ((7, 11), (2, 2))),
               Packed(case.replace(alibi=(0.5, 0.25, -0.5, 1.0)), ((1, 1), (6, 13), (9, 4))),
               Packed(case.replace(softcap=0.5, alibi=(0.5, 0.25, -0.5, 1.0)), ((2, 5), (3, 3)))]
    for p in batches:  # 12, 9, 16 and 5 query tokens; softcap, none, ALiBi, both
        run_and_check(p)
    assert set(guards) == {True}, f"expected flex-varlen to ask for dynamic shapes, got {set(guards)}"
    assert guards[True].runs == len(batches), f"expected every call to run a compiled graph, got {guards[True].runs}"
    assert guards[True].compiles == 1, f"expected one graph for four batches, got {guards[True].compiles}"


BAD = [
    (lambda kw: kw.update(cu_seqlens_q=kw["cu_seqlens_q"].long()), "int32"),
    (lambda kw: kw.update(cu_seqlens_k=kw["cu_seqlens_k"].flip(0)), "rise from 0"),
    (lambda kw: kw.update(max_seqlen_k=2), "max_seqlen_k"),
    (lambda kw: kw.update(alibi_slopes=torch.ones(2, 2)), r"alibi_slopes must have shape \(2,\) or \(3, 2\)"),
    (lambda kw: kw.update(alibi_slopes=torch.ones(2, dtype=torch.float64)), "alibi_slopes must be a float32"),
    (lambda kw: kw.update(window=(1,)), "window"),
    (lambda kw: kw.update(softcap=-1.0), "softcap"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_flex_varlen_bad_arguments_raise_naming_them(i):
    p = Packed(GQA.replace(hq=2, hkv=1), ((5, 9), (0, 3), (4, 0)))
    args = tuple(torch.tensor(x, dtype=torch.float32) for x in p.inputs()[:3])
    kw = packed.layout_kw(p.lengths_q, p.lengths_k)(torch, "cpu")
    varlen().fn(*args, **kw)
    change, word = BAD[i]
    change(kw)
    with pytest.raises((TypeError, ValueError), match=word):
        varlen().fn(*args, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="sinks are declared on CPU only")
def test_a_sink_that_outweighs_every_key_keeps_o_within_the_float64_bound():
    """Found by the thorough profile: with the sink merged afterwards through flex's returned LSE, O
    carried that LSE's rounding, 1.14x the float64 bound; as one more key inside flex's softmax it
    rounds as a fused kernel does."""
    impl, case = load("flex"), Case(sq=4, regime="large", sinks=(0.0,))
    res = ph.forward(impl, case)
    for name in ("o", "lse"):
        orc.compare(case, name, getattr(res, name), who="flex (a sink of 0 beside logits near -200)")
