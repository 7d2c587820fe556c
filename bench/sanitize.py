"""Run the Triton kernels under compute-sanitizer (memcheck and racecheck) on a small case.

    python bench/sanitize.py            # runs both tools on itself, fails on any reported error
    python bench/sanitize.py --child    # the workload alone (what the sanitizer runs)

The workload: float16, GQA (4 query heads over 2 kv heads), ragged lengths (Sq=70 > Sk=45, so
bottom-right causal has rows that see no key), padded head dim 40, inputs sliced out of longer
buffers and contiguous; forward and backward of every causal mode, checked against float64 dense attention.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def child():
    import numpy as np
    import torch

    from flashcheck.oracle import reference
    from flashcheck.impls.triton_fused import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, sq, sk, d = 1, 4, 2, 70, 45, 40

    def mk(*s):
        buf = torch.randn(s[0], s[1], s[2] + 5, s[3] + 8, device="cuda", generator=g).half()
        return buf[:, :, : s[2], : s[3]]

    sliced = mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d), mk(b, hq, sq, d)
    contiguous = tuple(x.contiguous() for x in sliced)  # row stride 40: the unaligned load path
    worst = 0.0
    for (q, k, v, do), causal, blocks in itertools.product((sliced, contiguous), (False, "bottom_right", "top_left"),
                                                           ((None, None), (16, 32))):
        qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
        o, lse = attention(qg, kg, vg, causal=causal, block_q=blocks[0], block_k=blocks[1])
        o.backward(do)
        torch.cuda.synchronize()
        qn, kn, vn, don = (x.double().cpu().numpy() for x in (q, k, v, do))
        o_r, lse_r = reference.dense_forward(qn, kn, vn, causal=causal)
        refs = (o_r, lse_r) + reference.dense_backward(qn, kn, vn, o_r, lse_r, don, causal=causal)
        for got, ref in zip((o, lse, qg.grad, kg.grad, vg.grad), refs):
            got = got.detach().double().cpu().numpy()
            fin = np.isfinite(ref)
            assert np.array_equal(np.isfinite(got), fin)
            worst = max(worst, float(np.abs(got[fin] - ref[fin]).max()) if fin.any() else 0.0)
    assert worst < 5e-2, worst
    print(f"workload ok, worst abs error {worst:.2e}")


def main():
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        print("compute-sanitizer not found")
        return 2
    subprocess.run([sys.executable, __file__, "--child"], check=True)  # warm Triton's compile cache
    bad = 0
    for tool in ("memcheck", "racecheck"):
        cmd = [exe, "--tool", tool, "--error-exitcode", "3", sys.executable, __file__, "--child"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        out = res.stdout + res.stderr
        summary = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: .*", out)
        print(f"{tool}: exit {res.returncode}; {summary[-1] if summary else 'no summary line'}")
        if res.returncode != 0 or not summary or not re.search(r"SUMMARY: 0 ", summary[-1]):
            bad += 1
            print(out[-4000:])
    return 1 if bad else 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    else:
        sys.exit(main())
