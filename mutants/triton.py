"""Broken builds of the fused Triton kernel, one constexpr switch each (impls/triton_kernels.py).

On a machine without CUDA they run in Triton's interpreter, so CPU CI kills them too.
"""
from flashcheck.impls import triton_fused

BUGS = {
    "no_rescale": "online-softmax rescale skipped (Triton)",
    "lse_base2": "LSE returned in base 2 (Triton)",
    "drop_partial_tile": "last partial key tile dropped (Triton)",
    "bwd_no_delta": "backward drops the rowsum(dO * O) term (Triton)",
}

globals().update({bug: triton_fused.make_mutant(bug) for bug in BUGS})
