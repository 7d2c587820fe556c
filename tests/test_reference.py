"""The dense float64 reference (the oracle's truth) against computations that share none of its code.

numpy-dense *is* the oracle's code, so comparing it with the truth proves nothing; the
properties skip it there. Here it meets (1) torch's softmax and autograd in float64 and
(2) plain Python with exactly rounded sums (math.fsum) on small cases, row by row.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, note

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.oracle import reference as dense
from flashcheck.properties import helpers as ph
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties

F64 = dict(dtypes=("float64",))


def small(case):
    return case.replace(batch=1, sq=min(case.sq, 5), sk=min(case.sk, 5), d=min(case.d, 6), dv=min(case.dv, 6))


def reference(case):
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    o, lse = dense.dense_forward(q, k, v, **kw)
    return (o, lse) + tuple(dense.dense_backward(q, k, v, o, lse, do, **kw))


def torch_attention(case):
    """Masked softmax attention written directly in torch (float64), gradients by autograd."""
    q, k, v, do = (torch.from_numpy(x).requires_grad_() for x in case.inputs())
    g = case.hq // case.hkv
    s = case.effective_scale * (q @ k.repeat_interleave(g, 1).transpose(-1, -2))
    s = s.masked_fill(~torch.from_numpy(case.visible()), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)  # a row that sees nothing: all zero
    o = p @ v.repeat_interleave(g, 1)
    o.backward(do)
    return tuple(t.detach().numpy() for t in (o, lse, q.grad, k.grad, v.grad))


def python_rows(case):
    """O and LSE one query row at a time, in plain Python floats with exactly rounded sums."""
    q, k, v, _ = (x.tolist() for x in case.inputs())
    g, sc, vis = case.hq // case.hkv, case.effective_scale, case.visible()
    o = np.zeros((case.batch, case.hq, case.sq, case.dv))
    lse = np.full((case.batch, case.hq, case.sq), -math.inf)
    for b in range(case.batch):
        for h in range(case.hq):
            kh, vh = k[b][h // g], v[b][h // g]
            for i, qi in enumerate(q[b][h]):
                seen = [j for j in range(case.sk) if vis[i, j]]
                if not seen:
                    continue
                s = {j: sc * math.fsum(a * c for a, c in zip(qi, kh[j])) for j in seen}
                top = max(s.values())
                w = {j: math.exp(s[j] - top) for j in seen}
                total = math.fsum(w.values())
                lse[b, h, i] = top + math.log(total)
                o[b, h, i] = [math.fsum(w[j] * vh[j][c] for j in seen) / total for c in range(case.dv)]
    return o, lse


def assert_close(name, got, want, case, rel=1e-10):
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite) and np.array_equal(got[~finite], want[~finite]), (
        f"reference {name}: non-finite entries differ from the independent result\n  case: {case!r}")
    # float64 rounding grows with the logits' size (1 + L): a "negative" or "large" regime case
    # carries it through exp and dS into every result
    size = (np.abs(want[finite]).max(initial=0) + 1) * (1 + orc.truth(case).logit_max)
    err = np.abs(got[finite] - want[finite]).max(initial=0)
    assert err <= rel * size, f"reference {name}: off by {err:.3e} (allowed {rel * size:.3e})\n  case: {case!r}"


@given(case=fs.cases(**F64))
def test_dense_reference_matches_torch_autograd_in_float64(case):
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), reference(case), torch_attention(case)):
        assert_close(name, got, want, case)


@given(case=fs.cases(**F64).map(small))
def test_dense_reference_matches_exactly_summed_python_rows(case):
    o, lse = python_rows(case)
    ref_o, ref_lse = reference(case)[:2]
    assert_close("o", ref_o, o, case)
    assert_close("lse", ref_lse, lse, case)


@pytest.mark.parametrize("check", [test_dense_reference_matches_torch_autograd_in_float64,
                                   test_dense_reference_matches_exactly_summed_python_rows])
def test_a_reference_with_its_scale_doubled_is_caught(check, monkeypatch):
    real = dense.dense_forward

    def doubled(q, k, v, *, causal=False, scale=None, **rest):  # rest: what the oracle passes (probs=)
        return real(q, k, v, causal=causal, scale=2 * (1 / math.sqrt(q.shape[-1]) if scale is None else scale), **rest)

    monkeypatch.setattr(dense, "dense_forward", doubled)
    with pytest.raises(AssertionError, match="reference (o|lse)"):
        check()


@given(case=fs.cases(dtypes=("float64",)))
@example(case=Case(sq=3, sk=2, causal="bottom_right"))
@example(case=Case(hq=2, hkv=1, sq=2, sk=3, d=2, dv=3, scale=0.7))
@example(case=Case(hq=3, hkv=1, sk=1, d=32, dv=32, scale=30.0, regime="heavy", seed=482))  # once cancelled badly
def test_analytic_backward_agrees_with_central_differences(case):
    """The reference's analytic gradients against central differences of its own forward, in float64."""
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    o, lse = dense.dense_forward(q, k, v, **kw)
    grads = dense.dense_backward(q, k, v, o, lse, do, **kw)
    checks = ph.central_differences(case, lambda q, k, v: dense.dense_forward(q, k, v, **kw)[0], grads)
    ph.assert_agree("numpy-dense", case, checks)


@given(case=fs.cases(dtypes=("float64",), regimes=("plain", "equal", "ties", "dominant", "heavy"),
                     features=fs.FEATURES))
@example(case=Case(hq=2, hkv=1, sq=4, sk=3, d=2, causal="bottom_right", window=(1, 0), softcap=0.5,
                   alibi=(0.5, -0.25), sinks=(0.3, -1.0), dropout_p=0.5, dropout_seed=3))
@example(case=Case(batch=2, hq=2, hkv=1, sq=4, sk=5, d=2, mask=("rows", True, True, 0.5, 4)))  # per batch and head
def test_reference_backward_with_every_feature_agrees_with_central_differences(case):
    """d/dt f(x + t u) at t = 0, with f = sum(O * dO), against <grad f, u>, in float64, over q, k, v and
    the sink logits; dropout enters as a fixed keep mask drawn from the case's dropout seed. Not with a
    finfo.min bias: s + finfo.min rounds s away in float64 too, so the forward is flat in q and k
    there while the analytic gradient (at the rounded P, as a kernel's is) is not."""
    assume(case.bias is None or case.bias[0] != "min")
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    if case.dropout_p:
        keep = np.random.default_rng(case.dropout_seed).random(do.shape[:3] + (case.sk,)) >= case.dropout_p
        kw.update(dropout_p=case.dropout_p, dropout_mask=keep)
    sinks = kw.pop("sinks", None)
    sinks = None if sinks is None else sinks.astype(np.float64)
    o, lse = dense.dense_forward(q, k, v, sinks=sinks, **kw)
    grads = dense.dense_backward(q, k, v, o, lse, do, sinks=sinks, **kw)

    def forward(q, k, v, sinks=None):
        return dense.dense_forward(q, k, v, **kw, **({} if sinks is None else {"sinks": sinks}))[0]

    for name, numeric, analytic, bound in ph.central_differences(case, forward, grads, sinks):
        note(f"d{name}: central difference {float(numeric)!r}, analytic {float(analytic)!r}, allowed {bound:.3e}")
        assert abs(numeric - analytic) <= bound, (
            f"reference d{name} along a random direction: central difference {numeric:.12g}, analytic "
            f"{analytic:.12g}, |diff| {abs(numeric - analytic):.3e} > allowed {bound:.3e}\n  case: {case!r}")


@pytest.mark.parametrize("bias", [("normal", True, True, 1.0, 1), ("normal", False, True, 3.0, 2),
                                  ("ninf", True, False, 0.25, 3)])
def test_the_bias_gradient_agrees_with_central_differences(bias):
    """d/dt sum(O(bias + t u) * dO) at t = 0 against <dbias, u>: dbias is dS summed over the
    dimensions the bias is broadcast along (u is 0 on the -inf entries, which hide their keys)."""
    case = Case(batch=2, hq=4, hkv=2, sq=5, sk=7, d=4, dv=3, causal="bottom_right", softcap=2.0, bias=bias)
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    o, lse = dense.dense_forward(q, k, v, **kw)
    dbias = dense.dense_backward(q, k, v, o, lse, do, **kw)[-1]
    b = kw.pop("attn_bias")
    u = np.where(np.isfinite(b), np.random.default_rng(0).standard_normal(b.shape), 0.0)
    f = lambda t: float((dense.dense_forward(q, k, v, attn_bias=b + t * u, **kw)[0] * do).sum())  # noqa: E731
    h = 1e-5
    numeric, analytic = (f(h) - f(-h)) / (2 * h), float((dbias * u).sum())
    assert dbias.shape == b.shape, f"expected dbias of the bias's shape {b.shape}, got {dbias.shape}"
    assert abs(numeric - analytic) <= 1e-7 * (1 + abs(analytic)), (
        f"dbias along a random direction: central difference {numeric!r}, from the gradient {analytic!r}")
