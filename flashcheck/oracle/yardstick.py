"""The naive rule's yardstick for a head too long for the host: plain dense attention in t against
float64, computed with torch where the head lies (the GPU), one chunk of query rows at a time.

The naive rule (rule.naive_terms) allows K x the largest error that plain dense attention in t makes
anywhere in the problem, plus a floor from the problem's largest logit and magnitudes. Those are
maxima over every row, so the sampled oracle cannot find them from its rows alone; for O, LSE and
dQ each is a maximum over rows of what that row alone gives, and a row chunk at a time costs
O(chunk x Sk) memory. At 131072 tokens that is 64 chunks of float64 products on the device.

Only what the scale property draws: one batch entry and kv head with its query heads, causal or
not, no other feature. Anything else is refused by name.
"""
from __future__ import annotations

from flashcheck.oracle import rule
from flashcheck.strategies.case import AttentionCase

NAMES = ("o", "lse", "dq")


def _visible(torch, case: AttentionCase, rows, device):
    """(rows, Sk) True where query row i sees key j (rule: the case's causal alignment)."""
    i, j = rows[:, None], torch.arange(case.sk, device=device)[None, :]
    if case.causal == "top_left":
        return j <= i
    if case.causal == "bottom_right":
        return j <= i + (case.sk - case.sq)
    return torch.ones(len(rows), case.sk, dtype=torch.bool, device=device)


def _dense(torch, q, k, v, do, vis, scale):
    """Plain dense O, LSE and dQ (autograd) in the inputs' dtype, for (H, R, D) rows against (Sk, D) keys."""
    q = q.detach().requires_grad_()
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    o = p @ v
    lse = torch.logsumexp(s, dim=-1)
    (dq,) = torch.autograd.grad(o, q, do)
    return o.detach(), lse.detach(), dq


def _truth(torch, q, k, v, do, vis, scale):
    """Float64 O, LSE, dQ, the logits' largest magnitude and the naive rule's magnitudes M per result."""
    q, k, v, do = (x.double() for x in (q, k, v, do))
    s = (q @ k.T) * scale
    s_vis = torch.where(vis, s, torch.zeros_like(s))
    lse = torch.logsumexp(s.masked_fill(~vis, float("-inf")), dim=-1)
    p = torch.where(vis, torch.exp(s - lse[..., None]), torch.zeros_like(s))
    o = p @ v
    dp = do @ v.T
    delta = (do * o).sum(-1, keepdim=True)
    dq = scale * ((p * (dp - delta)) @ k)
    abs_ds = p * (do.abs() @ v.abs().T + delta.abs())
    fin = lse[torch.isfinite(lse)]
    mag = {"o": (p @ v.abs()).max(), "lse": (fin.abs().max() if fin.numel() else lse.new_zeros(())) + 1,
           "dq": abs(scale) * (abs_ds @ k.abs()).max()}
    return {"o": o, "lse": lse, "dq": dq}, float(s_vis.abs().max()), {n: float(m) for n, m in mag.items()}


def naive_terms(torch, case: AttentionCase, q, k, v, do, chunk: int = 2048) -> dict:
    """rule.naive_terms for O, LSE and dQ of one kv head's problem: ``q``, ``do`` (Hq, Sq, .) and
    ``k``, ``v`` (Sk, .) as tensors in the case's dtype, on any device; a float per result."""
    if case.features or case.batch != 1 or case.hkv != 1:
        raise ValueError(f"the device yardstick of the naive rule takes one batch entry and kv head, causal or not, "
                         f"and no other feature; got {case!r}")
    q, k, v, do = (x.detach() for x in (q, k, v, do))  # the kernel's own graph, where its inputs carry one
    scale = case.effective_scale
    err = dict.fromkeys(NAMES, 0.0)
    mag = dict.fromkeys(NAMES, 0.0)
    logit_max = 0.0
    for r0 in range(0, case.sq, chunk):
        rows = torch.arange(r0, min(r0 + chunk, case.sq), device=q.device)
        vis = _visible(torch, case, rows, q.device)
        qc, doc = q[:, rows], do[:, rows]
        plain = dict(zip(NAMES, _dense(torch, qc, k, v, doc, vis, scale)))
        want, top, m = _truth(torch, qc, k, v, doc, vis, scale)
        broken = [n for n in NAMES if (torch.isfinite(want[n]) & ~torch.isfinite(plain[n])).any()]
        if broken:  # plain dense overflows in t: float32 rounded to t stands in, as in rule.naive_terms
            wide = dict(zip(NAMES, _dense(torch, *(x.float() for x in (qc, k, v, doc)), vis, scale)))
            plain.update({n: wide[n].to(getattr(torch, rule.result_dtype(case.dtype, n))) for n in broken})
        logit_max = max(logit_max, top)
        for n in NAMES:
            mag[n] = max(mag[n], m[n])
            if case.dtype != "float64":
                err[n] = max(err[n], _max_error(torch, plain[n], want[n], rule.result_dtype(case.dtype, n)))
    return rule.naive_from(case, err, logit_max, mag)


def _max_error(torch, got, want, dtype: str) -> float:
    """rule.max_error on tensors: the largest error where the truth is finite in ``dtype``."""
    held = torch.isfinite(want.to(getattr(torch, dtype))) & torch.isfinite(got)
    err = torch.where(held, (got.double() - want).abs(), torch.zeros_like(want))
    return float(err.max()) if err.numel() else 0.0
