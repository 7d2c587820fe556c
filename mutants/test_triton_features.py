"""triton-fused's optional features (window, softcap, ALiBi, sinks) against dense float64 attention.

A fixed grid of small cases, each aimed at a branch of the kernels: tile-skipping windows on either
side, windows that empty rows, saturating and identity softcaps, ALiBi slopes of both signs in both
shapes, sinks from -inf to dominant, each with causal (both alignments), GQA and Sq != Sk; forward
(O, LSE) and backward (dQ, dK, dV and the sinks' gradient).

The truth is dense attention in float64 with torch autograd (``dense`` below: the semantics written
out once). The bound is the oracle's rule (oracle.py): K x the error of the same dense attention
computed in the test's dtype, plus a floor of 8 (eps(float32) (1 + L) + eps(dtype)) times the size
of the result's defining sum, plus half a spacing of the stored dtype per entry.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashcheck import oracle as orc  # noqa: E402
from flashcheck.impls import triton_fused as tf  # noqa: E402
from mutants import triton as triton_mutants  # noqa: E402
from flashcheck.strategies.case import EPS  # noqa: E402

DEVICE = "cpu" if tf.INTERPRET else "cuda"
pytestmark = [pytest.mark.interpreter if tf.INTERPRET else pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason="triton-fused needs CUDA or TRITON_INTERPRET=1")]
NAMES = ("o", "lse", "dq", "dk", "dv", "dsinks")
K = {**orc.K_NAIVE, "dsinks": 3}


def visible(sq, sk, causal, window):
    """(Sq, Sk) boolean: query i sees key j (causal alignment intersected with the window band)."""
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        vis &= j <= i + (sk - sq if causal == "bottom_right" else 0)
    left, right = window or (-1, -1)
    if left >= 0:
        vis &= j >= i + sk - sq - left
    if right >= 0:
        vis &= j <= i + sk - sq + right
    return vis


def dense(q, k, v, do, *, causal=None, scale=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None):
    """O, LSE and the gradients of sum(O * dO) for q, k, v and sinks, computed in q's dtype.

    s = scale q.k, then c tanh(s / c), then - slope |i + Sk - Sq - j|, then the mask; the sink is
    one more logit in each row's softmax that carries no value.
    """
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    sinks = None if sinks is None else sinks.detach().to(q.dtype).requires_grad_()
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = (1 / math.sqrt(d) if scale is None else scale) * (q @ kk.transpose(-1, -2))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        dist = (torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)[None, :]).abs().to(q.dtype)
        s = s - alibi_slopes.to(q.dtype).reshape(-1, hq, 1, 1) * dist
    s = s.masked_fill(~visible(sq, sk, causal, window), -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)  # a row that sees nothing: exp(-inf) = 0, not NaN
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    o = (e[..., :sk] @ vv) / torch.where(z > 0, z, 1.0)
    lse = (m + torch.log(z)).squeeze(-1)
    (o * do).sum().backward()
    p = (e / torch.where(z > 0, z, 1.0)).detach()
    p, p_sink = p[..., :sk], None if sinks is None else p[..., sk:]
    return {"o": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dsinks": None if sinks is None else sinks.grad}, p, p_sink


def magnitudes(q, k, v, do, out, p, p_sink, scale):
    """Absolute-value size of each result's defining sum, as the oracle measures it (float64)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1).abs(), v.repeat_interleave(g, 1).abs()
    delta = (do * out["o"]).sum(-1, keepdim=True).abs()
    abs_ds = p * (do.abs() @ vv.transpose(-1, -2) + delta)
    group = lambda x: x.reshape(x.shape[0], -1, g, *x.shape[2:]).sum(2)  # noqa: E731
    lse = out["lse"][torch.isfinite(out["lse"])].abs()
    mag = {"o": (p @ vv).max(), "lse": (lse.max() if lse.numel() else 0.0) + 1,
           "dv": group(p.transpose(-1, -2) @ do.abs()).max(),
           "dq": abs(scale) * (abs_ds @ kk).max(),
           "dk": abs(scale) * group(abs_ds.transpose(-1, -2) @ q.abs()).max()}
    if p_sink is not None:
        mag["dsinks"] = (p_sink * delta).sum(dim=(0, 2)).max()
    return {n: float(x) for n, x in mag.items()}


def run_triton(fn, q, k, v, do, **kw):
    q, k, v = (x.detach().to(DEVICE).requires_grad_() for x in (q, k, v))
    sinks = kw.get("sinks")
    if sinks is not None:
        kw["sinks"] = sinks.detach().to(DEVICE).requires_grad_()
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(DEVICE)
    o, lse = fn(q, k, v, **kw)
    o.backward(do.to(DEVICE, o.dtype))
    got = {"o": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
           "dsinks": None if sinks is None else kw["sinks"].grad}
    return {n: None if x is None else x.detach().cpu().double().numpy() for n, x in got.items()}


def check(fn, case, names=NAMES):
    """Run ``fn`` on the case; raise AssertionError naming the first result outside the bound."""
    shape, dtype, kw = case
    b, hq, hkv, sq, sk, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    dt = getattr(torch, dtype)
    q, k, v, do = (torch.randn(*s, generator=gen, dtype=torch.float64).to(dt).double()
                   for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, hq, sq, d)))
    kw = dict(kw, scale=kw.get("scale", 1 / math.sqrt(d)))
    truth, p, p_sink = dense(q, k, v, do, **kw)
    truth = {n: None if x is None else x.detach() for n, x in truth.items()}
    mag = magnitudes(q, k, v, do, truth, p, p_sink, kw["scale"])
    yard, _, _ = dense(*(x.to(dt) for x in (q, k, v, do)), **kw)
    s = kw["scale"] * (q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2))
    logit_max = float(s.abs().max())
    if kw.get("alibi_slopes") is not None:
        logit_max += float(kw["alibi_slopes"].abs().max()) * (sq + sk)
    got = run_triton(fn, q.to(dt), k.to(dt), v.to(dt), do.to(dt), block_q=16, block_k=16, **kw)
    for name in names:
        if truth[name] is None:
            continue
        want, out = truth[name].numpy(), got[name]
        rdt = "float32" if name == "dsinks" else orc.result_dtype(dtype, name)
        held = np.isfinite(orc.quantize(want, rdt))
        assert np.array_equal(np.isfinite(out), held) and np.array_equal(out[~held], want[~held]), (
            f"{name}: non-finite entries differ: expected {want[~np.isfinite(out) | ~held][:4]}, "
            f"got {out[~np.isfinite(out) | ~held][:4]}\n  case: {case}")
        plain = yard[name].detach().double().numpy()
        assert np.isfinite(plain[held]).all(), f"{name}: dense {dtype} overflows on this case; choose another"
        with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
            dense_err = float(np.abs(plain - want)[held].max(initial=0.0))
            err = np.where(held, np.abs(out - want), 0.0)
        floor = orc.FLOOR_NAIVE * (EPS["float32"] * (1 + logit_max) + EPS[dtype]) * mag[name]
        limit = K[name] * dense_err + floor + orc.half_spacing(want, rdt)
        if not (err <= limit).all():
            idx = np.unravel_index(np.argmax(err - limit), err.shape)
            raise AssertionError(f"{name}: error {err[idx]:.3e} at {tuple(map(int, idx))} exceeds allowed "
                                 f"{limit[idx]:.3e} (expected {want[idx]!r}, got {out[idx]!r}; {K[name]} x dense "
                                 f"{dtype} error {dense_err:.3e} + floor {floor:.3e})\n  case: {case}")
    return truth, got


def geometric(h):
    """ALiBi's slopes for h heads: 2^(-8 i / h), i = 1..h."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)


SINKS = torch.tensor([-math.inf, 0.5, 3.0, 30.0])
# (B, Hq, Hkv, Sq, Sk, D), dtype, keyword arguments. 16-wide tiles: every length spans several.
CASES = {
    "window-both-sides-skips-tiles": ((1, 2, 1, 40, 40, 16), "float32", dict(window=(3, 2))),
    "window-left-causal-sq-lt-sk": ((1, 2, 2, 29, 53, 16), "float32", dict(window=(7, -1), causal="bottom_right")),
    "window-right-top-left-sq-gt-sk": ((1, 2, 1, 45, 30, 16), "float16", dict(window=(-1, 4), causal="top_left")),
    # bands wider than two tiles: every kernel runs masked, unmasked and masked tiles in turn, and
    # the left edges sit one past a tile boundary (Sk - Sq - left = -17 and -62 = 2 mod 16), where
    # an off-by-one in the tile ranges (not only in the mask) shows
    "window-wide-three-phases": ((1, 2, 1, 64, 70, 16), "float32", dict(window=(23, 20))),
    "window-wide-causal-gqa-sq-gt-sk": ((1, 4, 2, 70, 64, 16), "float16", dict(window=(56, -1), causal="bottom_right")),
    "window-diagonal-empties-rows": ((1, 1, 1, 50, 20, 16), "float32", dict(window=(0, 0))),
    "window-wider-than-sequence": ((1, 1, 1, 20, 33, 16), "float16", dict(window=(40, 40), causal="bottom_right")),
    "softcap-saturating": ((1, 2, 1, 33, 33, 16), "float32", dict(softcap=0.5, scale=1.0, causal="bottom_right")),
    "softcap-below-float32-range": ((1, 1, 1, 20, 20, 16), "float32", dict(softcap=1e-35, causal="bottom_right")),
    "softcap-identity": ((1, 2, 2, 20, 35, 16), "float16", dict(softcap=1e4)),
    "softcap-gqa-sq-gt-sk": ((1, 4, 2, 37, 21, 16), "float32", dict(softcap=3.0, scale=0.6)),
    "alibi-geometric-causal": ((1, 4, 2, 22, 41, 16), "float32",
                               dict(alibi_slopes=geometric(4), causal="bottom_right")),
    "alibi-per-batch-both-signs": ((2, 2, 1, 35, 19, 16), "float16",
                                   dict(alibi_slopes=torch.tensor([[0.3, -0.05], [-0.2, 0.1]]))),
    "sinks-inf-to-dominant-empty-rows": ((1, 4, 2, 40, 23, 16), "float32", dict(sinks=SINKS, causal="bottom_right")),
    "everything-float32": ((1, 4, 2, 38, 51, 16), "float32",
                           dict(window=(9, 3), causal="bottom_right", softcap=2.0, alibi_slopes=geometric(4),
                                sinks=torch.tensor([0.0, -1.0, 2.0, -math.inf]))),
    "everything-float16-top-left": ((1, 2, 1, 41, 26, 16), "float16",
                                    dict(window=(12, 1), causal="top_left", softcap=4.0,
                                         alibi_slopes=torch.tensor([0.25, -0.1]), sinks=torch.tensor([1.0, -2.0]))),
}


@pytest.mark.parametrize("name", CASES)
def test_features_match_dense_float64_forward_and_backward(name):
    check(tf.attention, CASES[name])


def test_row_that_sees_no_key_gives_zero_output_and_the_sink_as_lse():
    case = CASES["sinks-inf-to-dominant-empty-rows"]  # Sq > Sk, bottom-right: the first 17 rows see nothing
    _, got = check(tf.attention, case, names=("o", "lse"))
    empty = slice(0, case[0][3] - case[0][4])
    assert np.all(got["o"][:, :, empty] == 0), "a row that sees no key must output exactly 0"
    want = np.broadcast_to(SINKS.double().numpy()[None, :, None], got["lse"][:, :, empty].shape)
    # the kernel keeps LSE in base 2: sink * log2(e) * ln(2) may land an ulp or two off the sink
    np.testing.assert_allclose(got["lse"][:, :, empty], want, rtol=2 * EPS["float32"], atol=0,
                               err_msg="a row that sees no key has LSE = its sink (-inf without one)")


# Each feature mutant fails the check on a case that exercises its feature.
KILLS = {"window_off_by_one": "window-both-sides-skips-tiles", "softcap_before_scale": "softcap-gqa-sq-gt-sk",
         "softcap_no_tanh_grad": "softcap-saturating", "alibi_sign": "alibi-geometric-causal"}


@pytest.mark.parametrize("bug", triton_mutants.FEATURE_BUGS)
def test_each_feature_mutant_fails_the_check(bug):
    with pytest.raises(AssertionError) as failed:
        check(getattr(triton_mutants, bug), CASES[KILLS[bug]])
    print(f"{bug} killed: {str(failed.value).splitlines()[0]}")


@pytest.mark.parametrize("kw, message", [
    (dict(window=(2,)), "window must be"), (dict(window=(-2, 3)), "window must be"),
    (dict(window=(1.5, 2)), "window must be"), (dict(softcap=-1.0), "softcap must be"),
    (dict(softcap=math.inf), "softcap must be"), (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), "alibi_slopes must be float32"),
    (dict(sinks=torch.ones(1, 2)), "sinks must have shape"), (dict(sinks=[0.0, 1.0]), "sinks must be a torch tensor"),
])
def test_bad_feature_arguments_raise_a_clear_error(kw, message):
    q = torch.zeros(1, 2, 4, 16, device=DEVICE)
    kw = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    with pytest.raises((ValueError, TypeError), match=message):
        tf.attention(q, q[:, :1], q[:, :1], **kw)
