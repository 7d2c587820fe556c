"""Giant cases: where kernels overflow what their authors tested (properties/test_scale.py).

Three targets, each past a limit real kernels have tripped on (the bug survey: int32 offsets,
grids past 65535 in y or z, very long rows):

- ``grid``: batch x heads = 66560, past CUDA's 65535 grid rows in y and z, at 16 tokens;
- ``elements``: q holds 2.42e9 elements, past 2^31 (int32 offsets wrap), at 1088 tokens and D = 128;
- ``long``: Sq = Sk = 131072 in one head.

The gpu profile draws ``grid`` alone (seconds); the ``gpu-scale`` profile, for nightly runs, all
three. A case that would not fit in the free GPU memory is scaled down (the batch first, then the
lengths), never failed: ``fitted_to_memory``.
"""
from __future__ import annotations

from hypothesis import settings

from flashcheck.strategies.case import AttentionCase

TARGETS = {
    "grid": dict(batch=1024, hq=65, hkv=65, sq=16, sk=16, d=16, dv=16),
    "elements": dict(batch=136, hq=128, hkv=128, sq=1088, sk=1088, d=128, dv=128),
    "long": dict(batch=1, hq=1, hkv=1, sq=131072, sk=131072, d=128, dv=128),
}
NIGHTLY = "gpu-scale"


def targets() -> tuple[str, ...]:
    """The targets this run draws: all of them under the gpu-scale profile, ``grid`` otherwise."""
    current = getattr(settings, "get_current_profile_name", None)
    name = current() if current else getattr(settings, "_current_profile", "default")
    return tuple(TARGETS) if (name or "").startswith(NIGHTLY) else ("grid",)


def nbytes(case: AttentionCase, backward: bool) -> int:
    """What a call holds on the device: q, k, v, O, LSE, and dO with the three gradients, plus a
    quarter again for the kernel's own workspace and the float32 draws the inputs are made from."""
    t = 4 if case.dtype == "float32" else 8 if case.dtype == "float64" else 2
    q = case.batch * case.hq * case.sq * case.d
    kv = case.batch * case.hkv * case.sk * (case.d + case.dv)
    o = case.batch * case.hq * case.sq * case.dv
    held = (q + kv + o) * (2 if backward else 1) + (o if backward else 0)
    return int((held * t + case.batch * case.hq * case.sq * 4) * 1.25 + 4 * max(q, kv, o))


def halved(case: AttentionCase) -> AttentionCase | None:
    """``case`` at half the batch, or once the batch is 1 at half the lengths; None at the smallest."""
    if case.batch > 1:
        return case.replace(batch=case.batch // 2)
    if case.sq > 16:
        return case.replace(sq=max(16, case.sq // 2), sk=max(16, case.sk // 2))
    return None


def fitted_to_memory(case: AttentionCase, free: int, backward: bool) -> AttentionCase:
    """``case`` halved until it fits in ``free`` bytes (or cannot be halved further)."""
    while nbytes(case, backward) > free and halved(case) is not None:
        case = halved(case)
    return case


def tiles(impl) -> tuple[int, ...]:
    """The tile sizes a giant case runs at: the kernel's declared ones; 256 for a kernel that takes
    any (at 131072 tokens its tiles' boundaries are still crossed 512 times, and 16-row tiles would
    keep a tiled loop in Python busy for hours); 16 where the kernel picks its own (unused)."""
    if isinstance(impl.blocks, tuple):
        return impl.blocks
    return (256,) if impl.blocks == "any" else (16,)
