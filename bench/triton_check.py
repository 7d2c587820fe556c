"""Quick differential check of impls.triton_fused against the float64 NumPy dense reference.

CPU (interpreter):  TRITON_INTERPRET=1 python bench/triton_check.py
GPU:                python bench/triton_check.py --gpu
Prints one line per case and exits non-zero on any mismatch. Tolerances: relative max error
against float64 truth, 2e-5 float32 (IEEE), 2e-2 float16, 5e-2 bfloat16 (these are loose
sanity bounds; the property suite holds the implementation to the FlashAttention rule).
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flashcheck.oracle import reference  # noqa: E402
from flashcheck.impls.triton_fused import flash_attention  # noqa: E402
from mutants.triton import make_mutant  # noqa: E402

TOL = {"float32": 2e-5, "float16": 2e-2, "bfloat16": 5e-2}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    if np.isnan(a).any():
        return float("nan")
    fin = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), fin) or not np.array_equal(a[~fin], b[~fin]):
        return float("inf")
    if not fin.any():
        return 0.0
    return float(np.abs(a[fin] - b[fin]).max() / max(1.0, np.abs(b[fin]).max()))


def case(dev, dtype, b, hq, hkv, sq, sk, d, dv, causal, scale, bq, bk, rng, fn=flash_attention, grad=True):
    tdt = getattr(torch, dtype)
    q = torch.from_numpy(rng.standard_normal((b, hq, sq, d))).to(tdt)
    k = torch.from_numpy(rng.standard_normal((b, hkv, sk, d))).to(tdt)
    v = torch.from_numpy(rng.standard_normal((b, hkv, sk, dv))).to(tdt)
    do = torch.from_numpy(rng.standard_normal((b, hq, sq, dv))).to(tdt)
    qn, kn, vn, don = (x.double().numpy() for x in (q, k, v, do))
    o_ref, lse_ref = reference.dense_forward(qn, kn, vn, causal=causal, scale=scale)
    qt, kt, vt = (x.to(dev).requires_grad_(grad) for x in (q, k, v))
    o, lse = fn(qt, kt, vt, causal=causal, scale=scale, block_q=bq, block_k=bk)
    errs = {"o": rel(o.detach().double().cpu(), o_ref), "lse": rel(lse.double().cpu(), lse_ref)}
    if grad:
        o.backward(do.to(dev))
        g_ref = reference.dense_backward(qn, kn, vn, o_ref, lse_ref, don, causal=causal, scale=scale)
        for name, t, r in zip(("dq", "dk", "dv"), (qt, kt, vt), g_ref):
            errs[name] = rel(t.grad.double().cpu(), r)
    return errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dev = "cuda" if args.gpu else "cpu"
    rng = np.random.default_rng(args.seed)
    pyr = random.Random(args.seed)
    dtypes = ["float32", "float16"] + (["bfloat16"] if args.gpu else [])
    fixed = [  # (b, hq, hkv, sq, sk, d, dv, causal, scale, bq, bk)
        (1, 1, 1, 1, 1, 1, 1, False, None, None, None),
        (1, 2, 1, 5, 17, 3, 3, "bottom_right", None, 16, 16),
        (1, 2, 2, 33, 7, 16, 16, "bottom_right", None, 16, 32),  # rows that see no key
        (1, 4, 1, 40, 40, 40, 40, "top_left", 0.0, 32, 16),
        (2, 3, 1, 17, 40, 16, 3, "bottom_right", -0.7, 16, 16),
        (1, 2, 1, 40, 23, 3, 40, False, 3.0, 32, 32),
    ]
    if args.gpu:
        fixed += [(2, 8, 2, 300, 513, 64, 64, "bottom_right", None, None, None),
                  (1, 4, 4, 257, 257, 128, 128, "top_left", None, None, None),
                  (1, 2, 1, 129, 300, 256, 256, False, None, None, None),
                  (1, 2, 2, 200, 100, 96, 80, "bottom_right", None, None, None),
                  (2, 4, 1, 1000, 1000, 128, 128, True, None, 128, 64)]
    cases = []
    for dt in dtypes:
        for c in fixed:
            cases.append((dt,) + c)
    for _ in range(args.n):
        hkv = pyr.choice([1, 2])
        bmax = 1024 if args.gpu else 40
        cases.append((pyr.choice(dtypes), pyr.choice([1, 2]), hkv * pyr.choice([1, 2, 3]), hkv,
                      pyr.randint(1, bmax), pyr.randint(1, bmax), pyr.choice([1, 3, 16, 40] + ([64, 128, 256] if args.gpu else [])),
                      pyr.choice([1, 3, 16, 40]), pyr.choice([False, "bottom_right", "top_left"]),
                      pyr.choice([None, 0.0, 0.3, -1.0]), pyr.choice([None, 16, 32, 64]), pyr.choice([None, 16, 32, 64])))
    bad = 0
    for c in cases:
        dt = c[0]
        errs = case(dev, *c, rng=rng)
        ok = all(e <= TOL[dt] for e in errs.values())  # NaN compares False
        bad += not ok
        print(("ok  " if ok else "FAIL"), c, {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
    # mutants must be caught by this check (on shapes that trigger them)
    for bug in ("no_rescale", "lse_base2", "drop_partial_tile", "bwd_no_delta"):
        errs = case(dev, "float32", 1, 2, 1, 40, 37, 16, 16, False, None, 16, 16, rng, fn=make_mutant(bug))
        caught = any(not e <= TOL["float32"] for e in errs.values())
        bad += not caught
        print("mutant", bug, "caught" if caught else "MISSED", {k: f"{v:.1e}" for k, v in errs.items()})
    print(f"{len(cases)} cases, {bad} failures")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
