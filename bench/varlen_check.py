"""Check, then time, triton-fused-varlen (impls/triton_varlen.py) on CUDA.

    python bench/varlen_check.py                    # the check, then the timing table
    python bench/varlen_check.py --check-only       # (--time-only: the table alone)
    TRITON_INTERPRET=1 python bench/varlen_check.py --check-only   # tiny batches on CPU, fp16 / fp32

Check: ragged packed batches (sequences without queries or keys, one long among short ones, Tq != Tk,
GQA, causal bottom-right and top-left, a window, a softcap, per-sequence ALiBi slopes, sinks) in fp16
and bf16: O, LSE, dQ, dK, dV of each sequence against its own float64 truth (flashcheck.oracle.reference),
beside torch-tiled-varlen's error on the same inputs (it computes half types in float32). Errors are
max |x - truth| / max(1, max |truth|); a row fails past 2e-2 (fp16) / 5e-2 (bf16) or on a non-finite
mismatch (a sequence without keys must give O = 0, LSE = -inf). Exits 1 on a failure.

Timing (medians of triton.testing.do_bench, D = 128 and 64, H = 2048 / D, 32768 tokens a batch):
- equal lengths N in {1024, 4096}: triton-fused-varlen on the packed batch against dense triton-fused
  on the same tokens (B = 32768 / N), forward and backward;
- ragged (lengths from N / 8 to 2 N, seeded): triton-fused-varlen against SDPA's FLASH_ATTENTION on the
  batch padded to its longest sequence.
TFLOP/s count the visible (query, key) pairs of the real lengths only (forward 4 * H * D per pair,
backward 2.5x), so a padded batch's wasted work shows as a lower rate.
Works with torch 2.11 + triton 3.6 and torch 2.13 + triton 3.9 (stable APIs only).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOL = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 2e-5}
BR, TL = "bottom_right", "top_left"


def _modules():
    from flashcheck.impls import torch_tiled, triton_fused, triton_varlen
    return triton_fused, triton_varlen, torch_tiled


def rel(a, b):
    """max |a - b| / max(1, max |b|) over b's finite entries; inf when the non-finite entries differ."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fin = np.isfinite(b)
    if a.shape != b.shape or not np.array_equal(np.isfinite(a), fin) or not np.array_equal(a[~fin], b[~fin]):
        return math.inf
    return 0.0 if not fin.any() else float(np.abs(a[fin] - b[fin]).max() / max(1.0, np.abs(b[fin]).max()))


def packed_inputs(lengths, hq, hkv, d, dv, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, k, v, do = mk(tq, hq, d), mk(tk, hkv, d), mk(tk, hkv, dv), mk(tq, hq, dv)
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32, device=device)
          for x in ([a for a, _ in lengths], [b for _, b in lengths])]
    lay = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(a for a, _ in lengths),
               max_seqlen_k=max(b for _, b in lengths))
    return (q, k, v, do), lay


def truth(x, lengths, feats):
    """Per sequence float64 (o, lse, dq, dk, dv), packed back: lse (Hq, Tq)."""
    from flashcheck.oracle import reference

    q, k, v, do = (t.double().numpy() for t in x)
    hq, dv = q.shape[1], v.shape[2]
    out = [np.zeros((q.shape[0], hq, dv)), np.full((hq, q.shape[0]), -np.inf), np.zeros(q.shape),
           np.zeros(k.shape), np.zeros(v.shape)]
    q0 = k0 = 0
    for b, (sq, sk) in enumerate(lengths):
        qs, ks = slice(q0, q0 + sq), slice(k0, k0 + sk)
        q0, k0 = q0 + sq, k0 + sk
        if sq == 0 or sk == 0:
            continue
        dense = lambda t, s: np.swapaxes(t[s], 0, 1)[None]  # noqa: E731  (S, H, D) -> (1, H, S, D)
        kw = dict(feats)
        if kw.get("alibi_slopes") is not None:
            kw["alibi_slopes"] = kw["alibi_slopes"][b]
        if kw.get("sinks") is not None:
            kw["sinks"] = kw["sinks"].astype(np.float64)
        args = (dense(q, qs), dense(k, ks), dense(v, ks))
        o, lse = reference.dense_forward(*args, **kw)
        grads = reference.dense_backward(*args, o, lse, dense(do, qs), **kw)
        out[0][qs], out[1][:, qs] = np.swapaxes(o[0], 0, 1), lse[0]
        for i, (g, s) in enumerate(zip(grads[:3], (qs, ks, ks))):
            out[2 + i][s] = np.swapaxes(g[0], 0, 1)
    return out


def run(fn, x, lay, kw, device):
    q, k, v, do = (t.to(device) for t in x)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o, lse = fn(q, k, v, **lay, **kw)
    o.backward(do)
    return [t.detach().double().cpu().numpy() for t in (o, lse, q.grad, k.grad, v.grad)]


def check(tiny):
    tf, tv, tt = _modules()
    device = "cpu" if tf.INTERPRET else "cuda"
    dtypes = [torch.float16, torch.float32] if tf.INTERPRET else [torch.float16, torch.bfloat16]
    if tiny:
        batches = [((3, 5), (0, 4), (6, 0), (40, 37), (1, 1)), ((17, 33), (2, 1), (33, 17))]
        dims = [(4, 2, 16, 16), (2, 2, 24, 8)]
    else:
        batches = [((1, 1), (0, 300), (257, 0), (1000, 1300), (64, 64), (129, 3)),
                   ((513, 200), (7, 7), (1200, 1200), (0, 1), (300, 513))]
        dims = [(8, 2, 64, 64), (4, 4, 128, 128), (6, 3, 96, 80)]
    configs = [dict(causal=False), dict(causal=BR), dict(causal=TL),
               dict(causal=BR, window=(100, 0), softcap=20.0), dict(causal=False, window=(64, 32), alibi=True),
               dict(causal=BR, sinks=True)]
    bad = 0
    print(f"check on {device}: error against float64 per sequence (torch-tiled-varlen's in brackets)")
    runs = [(bt, c, dt) for c in configs for dt in dtypes for bt in batches]
    for i, (lengths, cfg, dtype) in enumerate(runs):
        hq, hkv, d, dv = dims[i % len(dims)]
        x, lay = packed_inputs(lengths, hq, hkv, d, dv, dtype, device, seed=i)
        kw, ref_kw = {"causal": cfg["causal"]}, {"causal": cfg["causal"] or None}
        if "window" in cfg:
            kw["window"] = ref_kw["window"] = cfg["window"]
        if "softcap" in cfg:
            kw["softcap"] = ref_kw["softcap"] = cfg["softcap"]
        if cfg.get("alibi"):
            slopes = torch.rand(len(lengths), hq, generator=torch.Generator().manual_seed(i)) * 0.5
            kw["alibi_slopes"], ref_kw["alibi_slopes"] = slopes.to(device), slopes.double().numpy()
        if cfg.get("sinks"):
            sinks = torch.linspace(-2.0, 3.0, hq)
            kw["sinks"], ref_kw["sinks"] = sinks.to(device), sinks.numpy()
        want = truth(x, lengths, ref_kw)
        got = run(tv.varlen_attention, x, lay, kw, device)
        tiled = run(tt.varlen_attention, x, lay, kw, device)
        errs = {n: (rel(a, w), rel(t, w)) for n, a, t, w in zip(("o", "lse", "dq", "dk", "dv"), got, tiled, want)}
        dname = str(dtype).removeprefix("torch.")
        ok = all(e <= TOL[dname] for e, _ in errs.values())
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {dname:8s} H={hq}/{hkv} D={d}/{dv} {cfg} lengths={lengths}: "
              + " ".join(f"{n} {e:.1e} [{t:.1e}]" for n, (e, t) in errs.items()), flush=True)
    print(f"check: {bad} failure(s)")
    return bad


# ------------------------------------------------------------------------------------------ timing

def visible_pairs(lengths, causal):
    total = 0
    for sq, sk in lengths:
        if causal:  # bottom-right: row i sees min(sk, max(0, i + sk - sq + 1)) keys
            i = np.arange(sq)
            total += int(np.clip(i + sk - sq + 1, 0, sk).sum())
        else:
            total += sq * sk
    return total


def tflops(pairs, h, d, ms, bwd):
    return 4.0 * h * d * pairs * (2.5 if bwd else 1.0) / (ms * 1e-3) / 1e12


def bench(f, grads):
    """(forward ms, backward ms) of f() -> o."""
    from triton.testing import do_bench

    fwd = do_bench(lambda: f(), warmup=25, rep=100, return_mode="median")
    o = f()
    do = torch.randn_like(o)
    bwd = do_bench(lambda: o.backward(do, retain_graph=True), warmup=25, rep=100, return_mode="median",
                   grad_to_none=grads)
    return fwd, bwd


def timing(dtypes, dims, lengths_n):
    tf, tv, _ = _modules()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens = 32768
    rows = []
    for dtype in dtypes:
        for d in dims:
            h = 2048 // d
            for causal in (False, True):
                for n in lengths_n:
                    for kind in ("equal", "ragged"):
                        rng = np.random.default_rng(n)
                        if kind == "equal":
                            lengths = [(n, n)] * (tokens // n)
                        else:
                            lengths, left = [], tokens
                            while left > 0:
                                s = int(min(left, rng.integers(max(1, n // 8), 2 * n + 1)))
                                lengths.append((s, s))
                                left -= s
                        b, top = len(lengths), max(s for s, _ in lengths)
                        mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, requires_grad=True)  # noqa: E731
                        q, k, v = mk(tokens, h, d), mk(tokens, h, d), mk(tokens, h, d)
                        cu = torch.tensor(np.concatenate([[0], np.cumsum([s for s, _ in lengths])]),
                                          dtype=torch.int32, device="cuda")
                        lay = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=top, max_seqlen_k=top)
                        pairs = visible_pairs(lengths, causal)
                        res = {"varlen": bench(lambda: tv.varlen_attention(q, k, v, causal=causal, **lay)[0],
                                               [q, k, v])}
                        if kind == "equal":  # the same tokens as (B, H, N, D) views
                            qd, kd, vd = (t.detach().view(b, n, h, d).transpose(1, 2).requires_grad_(True)
                                          for t in (q, k, v))
                            res["dense"] = bench(lambda: tf.flash_attention(qd, kd, vd, causal=causal)[0],
                                                 [qd, kd, vd])
                            with torch.no_grad():
                                diff = (tv.varlen_attention(q, k, v, causal=causal, **lay)[0].view(b, n, h, d)
                                        .transpose(1, 2) - tf.flash_attention(qd, kd, vd, causal=causal)[0])
                            res["max|varlen-dense|"] = float(diff.abs().max())
                        else:  # padded to the longest: (B, H, top, D)
                            qp, kp, vp = (torch.zeros(b, h, top, d, device="cuda", dtype=dtype, requires_grad=True)
                                          for _ in range(3))

                            def sdpa():
                                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                                    return F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal)
                            try:
                                res["sdpa-flash padded"] = bench(sdpa, [qp, kp, vp])
                            except RuntimeError as exc:
                                print(f"  sdpa flash refused: {str(exc)[:100]}")
                        line = {"dtype": str(dtype).removeprefix("torch."), "D": d, "H": h, "causal": causal,
                                "N": n, "kind": kind, "B": b}
                        for name, val in res.items():
                            if isinstance(val, tuple):
                                line[name] = (tflops(pairs, h, d, val[0], False), tflops(pairs, h, d, val[1], True))
                            else:
                                line[name] = val
                        rows.append(line)
                        del q, k, v
                        torch.cuda.empty_cache()
                        print_row(line)
    return rows


def print_row(r):
    cols = " | ".join(f"{name} {v[0]:6.1f} / {v[1]:6.1f}" for name, v in r.items() if isinstance(v, tuple))
    extra = f" | max|varlen-dense| {r['max|varlen-dense|']:.1e}" if "max|varlen-dense|" in r else ""
    print(f"{r['dtype']:8s} D={r['D']:3d} H={r['H']:2d} {'causal' if r['causal'] else 'full  '} "
          f"N={r['N']:5d} {r['kind']:6s} B={r['B']:3d} | TFLOP/s fwd / bwd: {cols}{extra}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--time-only", action="store_true")
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    args = ap.parse_args(argv)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpret:
        print("varlen_check: needs CUDA (or TRITON_INTERPRET=1 with --check-only for tiny CPU batches)")
        return 0
    bad = 0
    if not args.time_only:
        bad = check(tiny=interpret)
    if not args.check_only and not interpret:
        if bad:
            print("varlen_check: triton-fused-varlen is wrong on a check batch; timing anyway")
        print(f"\ntorch {torch.__version__}, triton {__import__('triton').__version__}, "
              f"{torch.cuda.get_device_name()}; TFLOP/s of visible pairs, forward / backward")
        timing([getattr(torch, n) for n in args.dtypes], args.dims, args.lengths)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
