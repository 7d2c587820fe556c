"""Broken builds of the fused Triton kernel, one constexpr switch each (impls/triton_kernels.py).

On a machine without CUDA they run in Triton's interpreter, so CPU CI kills them too.

FEATURE_BUGS break the optional features (window, softcap, ALiBi, sinks); triton-fused declares
them, so the feature properties (properties/test_features.py, with its grid of 16-wide-tile
pins) kill them as they kill any plug-in's.
"""
from flashcheck.impls import triton_fused

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

globals().update({bug: triton_fused.make_mutant(bug) for bug in {**BUGS, **FEATURE_BUGS}})
