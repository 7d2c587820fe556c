"""Short helpers the property tests share. Import as ``from properties import helpers as ph``."""
from __future__ import annotations

import numpy as np

from impls import call

RESULTS = ("o", "lse", "dq", "dk", "dv")


def forward(impl, case, q=None, k=None, v=None) -> call.Result:
    """Run ``impl`` forward on the case's inputs (or on the given float64 arrays)."""
    cq, ck, cv, _ = case.inputs()
    return call.run(impl, case, cq if q is None else q, ck if k is None else k, cv if v is None else v)


def backward(impl, case) -> call.Result:
    """Forward, then backward through the case's dO."""
    return call.run(impl, case, *case.inputs())


def masked_rows(case) -> np.ndarray:
    """Indices of query rows that see no key."""
    return np.flatnonzero(~case.visible().any(axis=1))


def masked_keys(case) -> np.ndarray:
    """Indices of keys that no query sees."""
    return np.flatnonzero(~case.visible().any(axis=0))


def kv_heads(case, x):
    """Repeat a (B, Hkv, ...) array so query head h finds its kv head at index h."""
    return np.repeat(x, case.hq // case.hkv, axis=1)


def repeat_differences(impl, case, calls: int = 2) -> list[str]:
    """Call ``impl`` ``calls`` times on the case's input; one line per result that is not
    bitwise identical across calls (NaN counts as equal to NaN)."""
    run = backward if impl.has_backward else forward
    first, lines = run(impl, case), []
    for _ in range(calls - 1):
        again = run(impl, case)
        for name in RESULTS:
            a, b = getattr(first, name), getattr(again, name)
            if a is None or b is None:
                continue
            same = (a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))
            if same.all():
                continue
            with np.errstate(invalid="ignore"):
                gap = np.where(same, 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf))
            idx = tuple(int(i) for i in np.unravel_index(np.argmax(gap), gap.shape))
            lines.append(f"{name}: {int((~same).sum())} of {a.size} entries differ; largest difference "
                         f"{gap[idx]:.3e} at {idx} ({a[idx]!r} then {b[idx]!r})")
        if lines:
            break
    return lines


def nondeterminism(impl, case, first: BaseException | None = None) -> str:
    """What to tell a user when one input gave different verdicts (Hypothesis's FlakyFailure):
    the case, the largest difference between repeated calls, and how the failing call failed."""
    lines = repeat_differences(impl, case, calls=3)
    head = (f"{impl.name}: the same input gave different results on repeated calls "
            f"(a race or nondeterminism in the kernel)")
    if lines:
        head += ":\n  " + "\n  ".join(lines)
    else:
        head += "; three more calls on the case below agreed bit for bit, so it is intermittent"
    if first is not None:
        head += "\n  the call that failed: " + (str(first).strip().splitlines() or [type(first).__name__])[0]
    return head + f"\n  case: {case!r}"
