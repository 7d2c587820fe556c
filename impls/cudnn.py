"""What cuDNN's fused attention gets wrong, measured on an H200, for the built-ins that call it
(sdpa-cudnn through torch, jax-cudnn through jax): one declaration, one predicate."""
from __future__ import annotations

import numpy as np

from flashcheck.contract import KnownIssue

# A row's dQ is NaN where exp of every logit of the row falls below the input type's smallest
# subnormal (e^-16.6 in fp16, e^-92.2 in bf16): measured NaN from -16 to -20 (fp16) and -88 to -96
# (bf16), finite above. Declared a margin above those edges.
LOW_ROW = {"float16": -10.0, "bfloat16": -60.0}


# Above this many q elements a case's inputs are not built on the host only to judge it (a giant case
# of properties/test_scale.py is drawn on the device, in the plain regime, whose rows peak above zero).
HOST_LIMIT = 2**24
# The regimes that can put every logit of a row far below zero at any size: judged by name above HOST_LIMIT.
LOW_REGIMES = ("negative", "equal", "ties")


def lowest_row_max(case) -> float:
    """The smallest, over the rows that see a key, of a row's largest visible logit (the case's own inputs)."""
    q, k, _, _ = case.inputs()
    k = np.repeat(k, case.hq // case.hkv, axis=1)
    vis = np.broadcast_to(case.visible(), (case.batch, case.hq, case.sq, case.sk))
    lowest = np.inf
    for b in range(case.batch):  # one batch entry's logits at a time: a race case has 60
        top = np.where(vis[b], case.effective_scale * (q[b] @ np.swapaxes(k[b], -1, -2)), -np.inf).max(axis=-1)
        lowest = min(lowest, top[vis[b].any(axis=-1)].min(initial=np.inf))
    return float(lowest)


def has_low_rows(case) -> bool:
    """Does some row of ``case`` have every logit below the type's exp range (LOW_ROW)?"""
    if case.batch * case.hq * case.sq * case.d > HOST_LIMIT:
        return case.regime in LOW_REGIMES
    return lowest_row_max(case) < LOW_ROW[case.dtype]


def low_row_dq_nan(path: str) -> KnownIssue:
    """Found by the gpu lane (jax 0.11 and torch 2.11 with cuDNN 9.19, one H200) and measured with each
    framework alone (docs/findings.md): with Sk not a multiple of 128 (NaN at 64, 192, 320, 448, 576;
    none at 128 to 1024), the backward's dQ is NaN on every row whose logits all lie below the type's
    exp range; O, dK, dV and the other rows are right. Lengths that are not multiples of 64 were not
    probed: the rule declares every Sk that is not a multiple of 128."""
    return KnownIssue(
        f"{path}: with Sk not a multiple of 128, dQ is NaN on rows whose every logit is strongly negative "
        "(below about -16 in fp16, -96 in bf16)",
        applies=lambda c: c.dtype in LOW_ROW and c.sk % 128 != 0 and has_low_rows(c),
        witness=dict(sq=128, sk=64, d=16, dv=16, dtype="float16", regime="negative"),
        failure=r"got \S*nan")
