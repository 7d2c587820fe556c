"""Broken builds of the fused Triton kernel, each made by patching impls/triton_kernels.py's source.

The production kernel carries no mutation switch. Each mutant is the kernel source with a few
exact text replacements, each asserted to apply exactly as often as written (so a change to the
kernel that moves a patched line fails loudly here instead of building a mutant that is not
broken). The patched source is written to a file, because Triton reads a kernel's source to
compile it, and imported as a module of its own that triton-fused's entry point launches.

On a machine without CUDA they run in Triton's interpreter, so CPU CI kills them too.
FEATURE_BUGS break the optional features (window, softcap, ALiBi, sinks); triton-fused declares
them, so the feature properties (properties/test_features.py, with its grid of 16-wide-tile
pins) kill them as they kill any plug-in's.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from flashcheck import implementation
from flashcheck.impls import triton_fused, triton_kernels

BUGS = {
    "no_rescale": "online-softmax rescale skipped (Triton)",
    "lse_base2": "LSE returned in base 2 (Triton)",
    "drop_partial_tile": "last partial key tile dropped (Triton)",
    "bwd_no_delta": "backward drops the rowsum(dO * O) term (Triton)",
}
FEATURE_BUGS = {
    "window_off_by_one": "window's left edge one key too far right (Triton)",
    "softcap_before_scale": "softcap applied to q.k before the scale (Triton)",
    "softcap_no_tanh_grad": "backward omits the softcap's 1 - tanh^2 (Triton)",
    "alibi_sign": "ALiBi bias added with the wrong sign (Triton)",
}
# Shown only past 2^31 elements: the gpu-scale profile's "elements" target (properties/test_scale.py)
SCALE_BUGS = {
    "int32_offsets": "batch and head indices kept in int32: b * stride wraps past 2^31 elements (Triton)",
}

# bug -> [(text in the kernel source, its replacement, how many times it occurs)]
PATCHES = {
    "no_rescale": [("        acc = acc * alpha[:, None]  # rescale what earlier tiles accumulated to the new max\n",
                    "", 1)],
    "lse_base2": [('    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))  # back to natural log\n',
                   '    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))\n', 1)],
    "drop_partial_tile": [("    return lo, hi\n", "    hi = tl.minimum(hi, (Sk // BLOCK_N) * BLOCK_N)\n    return lo, hi\n", 1)],
    "bwd_no_delta": [("    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)\n",
                      "    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) * 0.0\n", 1)],
    # i + Sk - Sq - left + 1: in the forward, the dQ kernel (after the slopes) and the dK/dV kernel
    "window_off_by_one": [("\n    slope2 = _slope(SLOPES, ssb, b, h, ALIBI)\n",
                           "\n    slope2 = _slope(SLOPES, ssb, b, h, ALIBI)\n    LOFF = LOFF + 1\n", 2),
                          ("        mid = 0\n    if LEFT:\n", "        mid = 0\n    LOFF = LOFF + 1\n    if LEFT:\n", 1)],
    # c tanh(q.k / c) scale instead of c tanh(q.k scale / c)
    "softcap_before_scale": [("        t = _tanh(qk * (qk_scale / cap))\n        s = t * cap\n",
                              "        t = _tanh(qk * (LOG2E / cap))\n        s = t * (cap * qk_scale / LOG2E)\n", 1)],
    "softcap_no_tanh_grad": [("        if SOFTCAP:  # through the cap: d(c tanh(s / c))/ds = 1 - tanh^2\n",
                              "        if False:\n", 1),
                             ("        if SOFTCAP:  # through the cap (see _dkdv_inner)\n", "        if False:\n", 1)],
    "alibi_sign": [("        s = s - slope2 * dist\n", "        s = s + slope2 * dist\n", 1)],
    "int32_offsets": [
        ("    b = tl.program_id(2).to(tl.int64)\n    h = tl.program_id(1).to(tl.int64)\n",
         "    b = tl.program_id(2)\n    h = tl.program_id(1)\n", 2),
        ("    b = tl.program_id(2).to(tl.int64)  # grid (key tiles, Hkv, B)\n    hk = tl.program_id(1).to(tl.int64)\n",
         "    b = tl.program_id(2)\n    hk = tl.program_id(1)\n", 1)],
}
assert set(PATCHES) == {**BUGS, **FEATURE_BUGS, **SCALE_BUGS}.keys()


def patched_source(bug: str) -> str:
    source = Path(triton_kernels.__file__).read_text()
    for old, new, times in PATCHES[bug]:
        found = source.count(old)
        assert found == times, (f"mutant {bug}: expected {times} occurrence(s) of {old!r} in "
                                f"impls/triton_kernels.py, found {found}; update mutants/triton.py")
        source = source.replace(old, new)
    return source


def build(bug: str):
    """The kernels module of mutant ``bug``, written once per source text to the temp folder."""
    source = patched_source(bug)
    folder = Path(tempfile.gettempdir()) / "flashcheck-mutant-kernels"
    folder.mkdir(exist_ok=True)
    path = folder / f"{bug}_{hashlib.sha256(source.encode()).hexdigest()[:12]}.py"
    if not path.exists():
        partial = path.parent / f"{path.name}.{os.getpid()}.tmp"
        partial.write_text(source)
        partial.replace(path)  # atomic: xdist workers may build the same mutant at once
    spec = importlib.util.spec_from_file_location(f"flashcheck_mutant_kernels_{bug}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_mutant(bug: str):
    """A deliberately broken ``attention``: triton-fused's signature and declarations, not registered."""
    kernels = build(bug)

    @implementation(name=f"triton-fused-mutant-{bug}", register=False, **triton_fused.DECLARED)
    def mutant(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, sinks=None,
               block_q=None, block_k=None, precision="ieee"):
        return triton_fused.flash_attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                            alibi_slopes=alibi_slopes, sinks=sinks, block_q=block_q,
                                            block_k=block_k, precision=precision, kernels=kernels)

    mutant.__name__ = f"attention_mutant_{bug}"
    return mutant


globals().update({bug: make_mutant(bug) for bug in PATCHES})
