"""Peak extra memory of attention forward + backward on CPU, measured, at growing lengths.

    python bench/memory.py [--lengths 1024 2048 4096 8192] [--dense]

Each measurement runs in a fresh Python process (so no earlier run's freed memory hides this
one's): it warms torch up on a tiny problem (libraries, thread pools), builds q, k, v and dO,
resets the kernel's peak-RSS counter (writing 5 to /proc/self/clear_refs), runs forward +
backward and reads VmHWM. Peak extra = VmHWM - VmRSS just before the run: everything the
attention allocated at its worst moment, outputs and gradients included. glibc is told to
serve every allocation over 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave
RSS at once and RSS follows live memory.

--dense adds torch SDPA's math backend (which materializes Sq x Sk) as a control: the same
instrument must see its quadratic growth.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = (1024, 2048, 4096, 8192)
D = 64


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _worker(which: str, n: int, d: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))

    if which == "torch-tiled":
        from flashcheck.impls.torch_tiled import attention

        def run(q, k, v):
            return attention(q, k, v)[0]
    elif which == "sdpa-math":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v)
    else:
        raise SystemExit(f"unknown implementation {which!r}")

    def inputs(length):
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, 1, length, d, generator=g) for _ in range(4))
        return [x.requires_grad_() for x in (q, k, v)] + [do]

    q, k, v, do = inputs(64)  # warm-up: load kernels, start the thread pool
    run(q, k, v).backward(do)
    q, k, v, do = inputs(n)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    run(q, k, v).backward(do)
    peak = _status("VmHWM")
    return {"impl": which, "n": n, "peak_extra": peak - before, "matrix": 4 * n * n}


def measure(which: str, n: int, d: int = D) -> dict:
    """Peak extra bytes of forward + backward of ``which`` at Sq = Sk = n, from a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, __file__, "--worker", which, str(n), str(d)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--dense", action="store_true", help="also measure SDPA math (quadratic) as a control")
    ap.add_argument("--worker", nargs=3, metavar=("IMPL", "N", "D"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        which, n, d = args.worker
        print(json.dumps(_worker(which, int(n), int(d))))
        return
    impls = ["torch-tiled"] + (["sdpa-math"] if args.dense else [])
    print(f"forward + backward, B = H = 1, D = {D}, float32, CPU; peak extra = VmHWM - VmRSS before the call")
    print("| impl | Sq = Sk | peak extra (MiB) | / one fp32 Sq x Sk matrix | x previous length |")
    print("|---|---|---|---|---|")
    for which in impls:
        prev = None
        for n in args.lengths:
            r = measure(which, n)
            growth = "" if prev is None else f"{r['peak_extra'] / prev:.2f}"
            print(f"| {which} | {n} | {r['peak_extra'] / 2**20:.1f} | {r['peak_extra'] / r['matrix']:.3f} | {growth} |",
                  flush=True)
            prev = r["peak_extra"]


if __name__ == "__main__":
    main()
