"""Dropout: determinism, p = 0, the keep mask read back from the outputs, and convergence of the
mean over seeds, with bounds derived from the Bernoulli keep model.

The model (FlashAttention's): each visible probability is kept independently with probability
1 - p, and kept ones are scaled by 1 / (1 - p); the softmax itself (and the LSE) ignore dropout.
Every statistical bound below has a false-alarm probability of at most FALSE_ALARM = 1e-9 for
an implementation that follows the model, per Hypothesis example (Bernstein's inequality with
a union bound over the entries it checks); with fixed seeds in CI the verdict is deterministic.
"""
import math

import numpy as np
import pytest
from hypothesis import assume, example, given, note, settings

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.contract import call
from flashcheck.oracle import reference
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties

FALSE_ALARM = 1e-9
SEEDS = 32  # runs averaged per example by the convergence property
FEW = settings(max_examples=min(settings.default.max_examples, 6))  # each example runs SEEDS kernels


def _with_dropout(case, p=0.5):
    return case if case.dropout_p else case.replace(dropout_p=p, dropout_seed=case.seed % 2**31)


def bernstein(variance, bound, events: int):
    """t with P(|X - E X| >= t) <= FALSE_ALARM / events for a sum X of independent zero-mean terms
    of total ``variance``, each at most ``bound`` in size: the root of t^2 = 2 L (variance + bound t / 3),
    L = ln(2 events / FALSE_ALARM)."""
    big_l = math.log(2 * events / FALSE_ALARM)
    return bound * big_l / 3 + np.sqrt((bound * big_l / 3) ** 2 + 2 * variance * big_l)


def _results(impl, case, q, k, v, do):
    res = call.run(impl, case, q, k, v, do if impl.has_backward else None)
    return {n: getattr(res, n) for n in ph.RESULTS if getattr(res, n) is not None}


@pytest.mark.requires("dropout")
@given(case=fs.cases(features=("dropout",)))
@example(case=Case(sq=3, sk=4, dropout_p=0.5, dropout_seed=1))
# the "large" regime's one key per row: seeds 144 and 145 agreed on it (torch-tiled, CI sweep seed 9)
@example(case=Case(hq=6, hkv=3, sq=32, sk=6, d=6, dv=6, causal="bottom_right", block_q=32, block_k=1, regime="large",
                   seed=382, dropout_p=0.1, dropout_seed=144))
def test_the_same_seed_gives_bitwise_the_same_results_and_another_seed_differs(impl, case):
    case = fs.fit(impl, _with_dropout(case))
    run = ph.backward if impl.has_backward else ph.forward
    first, again = run(impl, case), run(impl, case)
    names = ph.RESULTS if impl.has_backward else ("o", "lse")
    for name in names:
        x, y = getattr(first, name), getattr(again, name)
        assert x is None or np.array_equal(x, y, equal_nan=True), (
            f"{impl.name}: the same dropout seed gave different {name} (max difference "
            f"{np.nanmax(np.abs(x - y)):.3e})\n  case: {case!r}")
    # Two independent masks over N visible scores agree with probability (p^2 + (1-p)^2)^N. Every score
    # must show in O for that to hold: with the case's own logits, those of the "large" regime leave one
    # key per row and P = 0 elsewhere, and dropping a zero changes nothing (a CI sweep saw two seeds agree
    # over 126 such scores). With q = 0 every visible key of a row has P = 1 / n.
    n = int(case.visible().sum()) * case.batch * case.hq
    p = case.dropout_p
    if n * -math.log(p * p + (1 - p) ** 2) > -math.log(FALSE_ALARM) and (case.dv > 1 or case.sk > 1):
        _, k, v, _ = case.inputs()
        q0 = np.zeros((case.batch, case.hq, case.sq, case.d))
        one, other = (call.run(impl, c, q0, k, v).o for c in (case, case.replace(dropout_seed=case.dropout_seed + 1)))
        assert not np.array_equal(one, other), (
            f"{impl.name}: dropout seeds {case.dropout_seed} and {case.dropout_seed + 1} gave the same output "
            f"over {n} scores of equal probability\n  case: {case!r}, with q = 0")


@pytest.mark.requires("dropout")
@given(case=fs.cases(features=("dropout",)))
@example(case=Case(sq=2, sk=3, causal="bottom_right", dropout_seed=5))
def test_dropout_p_zero_equals_no_dropout(impl, case):
    case = fs.fit(impl, case.replace(dropout_p=0.0))
    res = ph.backward(impl, case) if impl.has_backward else ph.forward(impl, case)
    for name in ph.RESULTS:
        if getattr(res, name) is not None:
            orc.compare(case, name, getattr(res, name), who=f"{impl.name} (dropout_p=0, seed {case.dropout_seed})")


def read_mask(impl, case, k):
    """The keep mask of ``case``'s seed, read from one forward run: with q = 0 every visible key of a
    row gets probability 1 / n, and with V the identity (Dv = Sk) O[i, j] = keep_ij / ((1 - p) n).
    Returns (mask on the visible scores, O, what O must be)."""
    vis = case.visible()
    n = vis.sum(axis=1)[:, None]
    q0 = np.zeros((case.batch, case.hq, case.sq, case.d))
    eye = np.broadcast_to(np.eye(case.sk), (case.batch, case.hkv, case.sk, case.sk)).copy()
    o = call.run(impl, case, q0, k, eye).o
    share = np.divide(vis, (1 - case.dropout_p) * n, out=np.zeros(vis.shape), where=n > 0)
    mask = (o > 0.5 * share) & vis
    return mask, o, mask * share


@pytest.mark.requires("dropout")
@given(case=fs.cases(features=("dropout",), regimes=("plain",)))
@example(case=Case(sq=4, sk=5, dv=5, causal="bottom_right", dropout_p=0.5, dropout_seed=2))
@example(case=Case(sq=3, sk=3, dv=3, dropout_p=0.1, dropout_seed=1, block_k=1))
# a dQ entry of 1.38 with dropout, its dropout-free truth far smaller: the old budget missed its fp16 rounding
@example(case=Case(sq=20, sk=17, d=5, dv=17, causal="top_left", scale=0.75, dtype="float16", block_q=1, block_k=1,
                   seed=1738725, dropout_p=0.5, dropout_seed=1738725))
def test_the_keep_mask_read_from_the_output_is_rescaled_kept_at_rate_1_minus_p_and_used_by_the_backward(impl,
                                                                                                        case):
    case = fs.fit(impl, _with_dropout(case).replace(dv=case.sk, d=case.sk if impl.equal_head_dims else case.d))
    assume(case.dv == case.sk and case.dropout_p > 0)
    q, k, v, do = case.inputs()
    mask, o, want = read_mask(impl, case, k)
    p, vis = case.dropout_p, case.visible()
    # every entry is 0 or exactly 1 / ((1 - p) n), up to a few roundings in the case's dtype
    slack = 8 * fs.EPS[case.dtype] * want.max(initial=0) + orc.half_spacing(want, case.dtype)
    assert np.all(np.abs(o - want) <= slack), (
        f"{impl.name}: with q = 0 and V = I, O must be keep / ((1 - p) n) (dropped scores give 0, kept ones "
        f"are rescaled by 1 / (1 - p)); worst entry {float(o.ravel()[np.argmax(np.abs(o - want))])!r} where "
        f"{float(want.ravel()[np.argmax(np.abs(o - want))])!r} was expected\n  case: {case!r}")
    n = int(vis.sum()) * case.batch * case.hq
    kept = mask.sum() / max(n, 1)
    bound = bernstein(p * (1 - p) * n, 1.0, 1) / max(n, 1)
    note(f"kept {kept:.4f} of {n} visible scores; expected {1 - p} +- {bound:.4f}")
    assert abs(kept - (1 - p)) <= bound, (
        f"{impl.name}: kept fraction {kept:.4f} of {n} scores is not 1 - p = {1 - p} within {bound:.4f}\n"
        f"  case: {case!r}")
    if impl.dropout_mask is not None:
        declared = np.asarray(_np(impl.dropout_mask(*_framework(impl, case, q, k, v), p, case.dropout_seed)), bool)
        assert np.array_equal(declared & vis, mask), (
            f"{impl.name}: its declared dropout_mask differs from the mask its kernel applies at "
            f"{np.argwhere((declared & vis) != mask)[:3].tolist()}\n  case: {case!r}")
    # The same seed on the case's own inputs: dense attention with that mask, exactly, forward and backward.
    kw = dict(case.reference_kwargs(), dropout_p=p, dropout_mask=mask)
    res = call.run(impl, case, q, k, v, do if impl.has_backward else None)
    o_true, lse_true = reference.dense_forward(q, k, v, **kw)
    wants = {"o": o_true, "lse": lse_true}
    if impl.has_backward:
        wants.update(zip(("dq", "dk", "dv"), reference.dense_backward(q, k, v, o_true, lse_true, do, **kw)))
    for name, want_x in wants.items():
        got = getattr(res, name)
        if got is not None:
            # P * keep / (1 - p) <= P / (1 - p): every sum that sizes a result grows by at most 1 / (1 - p);
            # the result's own final rounding is that of the dropped-out value, which may be far larger
            # than the dropout-free one the bound was sized on (an fp16 dQ of 1.38 against a truth near 0)
            # (at the largest value the kernel may hold before it rounds: rule.with_output_rounding)
            before = orc.allowed(case, name) / (1 - p)
            final = orc.half_spacing(np.abs(want_x) + before, orc.result_dtype(case.dtype, name))
            orc.compare(case, name, got, want=want_x, budget=before + final,
                        who=f"{impl.name} (dense with its own dropout mask)")


def _framework(impl, case, *arrays):
    if impl.framework == "numpy":
        return tuple(x.astype(case.dtype) for x in arrays)
    import torch

    device = call.device_for(impl)
    return tuple(torch.from_numpy(x).to(device=device, dtype=getattr(torch, case.dtype)) for x in arrays)


def _np(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def spread(case, p):
    """Per-entry variance and largest term of each result's mean over SEEDS dropout masks.

    Every result is linear in the weights w_ij = keep_ij / (1 - p), independent, mean 1, variance
    p / (1 - p), |w - 1| <= max(1, p / (1 - p)): O_i = sum_j P_ij w_ij v_j; dV_j = sum_i P_ij w_ij dO_i;
    with A_ij = P_ij dO_i.v_j, dQ_i = scale sum_j w_ij A_ij (k_j - sum_l P_il k_l) and
    dK_l = scale sum_i q_i sum_m w_im A_im (delta_lm - P_il).
    """
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    pr, _, (qg, kg, vg, scale, _), _ = reference.dense_probs(q, k, v, who="dropout bound", **kw)
    dog = do.reshape(qg.shape[:-1] + (-1,))
    a = pr * (dog @ np.swapaxes(vg, -1, -2))  # A, (B, Hkv, G, Sq, Sk)
    kbar = pr @ kg
    var_w, top_w = p / (1 - p), max(1.0, p / (1 - p))
    sq_k = (kg[..., None, :, :] - kbar[..., :, None, :]) ** 2  # (B, Hkv, G, Sq, Sk, D)
    s_row = (a * a).sum(-1, keepdims=True)
    dk_x = a * a * ((1 - pr) ** 2 - pr ** 2) + pr ** 2 * s_row
    out = {
        "o": (var_w * (pr ** 2 @ vg ** 2), top_w * (pr[..., None] * np.abs(vg[..., None, :, :])).max(initial=0)),
        "dv": (var_w * (np.swapaxes(pr ** 2, -1, -2) @ dog ** 2).sum(2),
               top_w * (pr[..., None] * np.abs(dog[..., :, None, :])).max(initial=0)),
        "dq": (var_w * scale ** 2 * np.einsum("...ij,...ijd->...id", a * a, sq_k),
               top_w * abs(scale) * (np.abs(a)[..., None] * np.sqrt(sq_k)).max(initial=0)),
        "dk": (var_w * scale ** 2 * (np.swapaxes(dk_x, -1, -2) @ qg ** 2).sum(2),
               top_w * abs(scale) * np.abs(qg).max(initial=0) * np.abs(a).max(initial=0)),
    }
    shapes = {"o": do.shape, "dq": q.shape, "dk": k.shape, "dv": v.shape}
    return {n: (var.reshape(shapes[n]), top) for n, (var, top) in out.items()}


@pytest.mark.requires("dropout")
@FEW
@given(case=fs.cases(features=("dropout",), regimes=("plain", "equal", "heavy")))
@example(case=Case(hq=2, hkv=1, sq=3, sk=4, d=2, dv=2, causal="bottom_right", dropout_p=0.5))
def test_the_mean_over_seeds_converges_to_dense_attention_forward_and_backward(impl, case):
    case = fs.fit(impl, _with_dropout(case))
    p = case.dropout_p
    q, k, v, do = case.inputs()
    runs = [_results(impl, case.replace(dropout_seed=case.dropout_seed + r), q, k, v, do) for r in range(SEEDS)]
    stats = spread(case, p)
    names = [n for n in ("o", "dq", "dk", "dv") if n in runs[0]]
    events = sum(runs[0][n].size for n in names)
    for name in names:
        mean = np.mean([r[name] for r in runs], axis=0)
        var, top = stats[name]
        # the mean of SEEDS runs: variance / SEEDS, each term at most top / SEEDS; plus each run's rounding
        bound = bernstein(var / SEEDS, top / SEEDS, events) + orc.allowed(case, name) / (1 - p)
        worst = np.abs(mean - orc.truth(case)[name]) - bound
        idx = tuple(int(i) for i in np.unravel_index(np.argmax(worst), worst.shape))
        note(f"{name}: largest |mean - dense| {np.abs(mean - orc.truth(case)[name]).max():.3e}")
        assert worst[idx] <= 0, (
            f"{impl.name}: the mean {name} over {SEEDS} dropout seeds is {float(mean[idx])!r} at {idx}, dense "
            f"attention gives {float(orc.truth(case)[name][idx])!r}; the model allows {bound[idx]:.3e} "
            f"(false-alarm probability {FALSE_ALARM})\n  case: {case!r}")
