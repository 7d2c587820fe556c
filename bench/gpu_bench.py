"""TFLOP/s of triton-fused beside torch SDPA's FLASH_ATTENTION, CUDNN_ATTENTION and EFFICIENT_ATTENTION.

    python bench/gpu_bench.py --out DIR            # the table, DIR/bench.json, DIR/bench.png
    python bench/gpu_bench.py --out DIR --sweep    # small launch-config sweep (N=4096, fp16)
    python bench/gpu_bench.py --out DIR --features # window and softcap rows beside FlexAttention / SDPA

bf16 and fp16, D in {64, 128}, Sq = Sk = N in {1024, 4096, 16384}, causal and not; batch * N = 32768
tokens and heads = 2048 / D. Medians of triton.testing.do_bench. FLOPs: forward 4 * B * H * N^2 * D
(halved when causal), backward 2.5x forward. Also the peak memory of forward + backward at N = 32768.

--features (bf16, D = 128, H = 16, B * N = 32768, causal; N = 8192 unless --lengths): plain causal,
a causal sliding window of 1024 keys (window=(1023, 0)) and a softcap of 30 (Gemma 2's), for
triton-fused, FlexAttention (torch.compile(flex_attention), block_mask / score_mod), SDPA's
EFFICIENT and CUDNN backends with the window as a boolean attn_mask, and SDPA FLASH on the plain
row. FLOPs count only the visible (query, key) pairs. Each row first checks that triton-fused and
FlexAttention agree on O (max |difference| printed). Writes DIR/features.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashcheck.impls import triton_fused as tf  # noqa: E402

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION}


def flops(b, h, n, d, causal, mode):
    f = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return f * (2.5 if mode == "bwd" else 1.0)


def inputs(b, h, n, d, dtype, grad):
    mk = lambda: torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=grad)  # noqa: E731
    return mk(), mk(), mk()


def bench_fn(name, q, k, v, causal, configs=None):
    if name == "triton":
        return lambda: tf.flash_attention(q, k, v, causal=causal, configs=configs)[0]
    def f():
        with sdpa_kernel(SDPA[name]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def time_pair(name, b, h, n, d, dtype, causal, configs=None, do_bwd=True):
    """(fwd ms, bwd ms) medians; None where the backend refuses."""
    res = []
    try:
        q, k, v = inputs(b, h, n, d, dtype, False)
        f = bench_fn(name, q, k, v, causal, configs)
        f()
        res.append(do_bench(f, warmup=25, rep=100, return_mode="median"))
        if do_bwd:
            q, k, v = inputs(b, h, n, d, dtype, True)
            o = bench_fn(name, q, k, v, causal, configs)()
            do = torch.randn_like(o)
            bw = lambda: o.backward(do, retain_graph=True)  # noqa: E731
            bw()
            res.append(do_bench(bw, warmup=25, rep=100, return_mode="median", grad_to_none=[q, k, v]))
        else:
            res.append(None)
    except Exception as exc:  # a backend that refuses this shape
        print(f"  {name} {dtype} D={d} N={n} causal={causal}: {type(exc).__name__}: {str(exc)[:120]}")
        res += [None] * (2 - len(res))
    return res


def peak_memory(name, n, d, dtype, causal=True):
    b, h = 1, 2048 // d
    torch.cuda.empty_cache()
    q, k, v = inputs(b, h, n, d, dtype, True)
    do = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = bench_fn(name, q, k, v, causal)()
    o.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del q, k, v, do, o
    return peak


def sweep(out):
    n, dtype = 4096, torch.float16
    b = 32768 // n
    fwd_c = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
             (64, 64, 4, 3)]
    dkdv_c = [(32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3)]
    dq_c = [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)]
    rows = []
    for d in (64, 128):
        h = 2048 // d
        for causal in (False, True):
            q, k, v = inputs(b, h, n, d, dtype, False)
            do = torch.randn_like(q)
            for c in fwd_c:
                try:
                    f = lambda: tf.flash_attention(q, k, v, causal=causal, configs={"fwd": c})  # noqa: E731
                    f()
                    ms = do_bench(f, warmup=25, rep=80, return_mode="median")
                    rows.append(("fwd", d, causal, c, flops(b, h, n, d, causal, "fwd") / ms * 1e-9))
                except Exception as exc:
                    rows.append(("fwd", d, causal, c, 0.0)); print("fwd", c, exc)
                print(rows[-1], flush=True)
            o, lse = tf.flash_attention(q, k, v, causal=causal)
            align = "bottom_right" if causal else None
            scale = d ** -0.5
            for kind, cands in (("dkdv", dkdv_c), ("dq", dq_c)):
                for c in cands:
                    try:
                        cfg = tf._config(None, None, d, {kind: c})
                        g = lambda: tf._backward(do, q, k, v, o, lse, align, scale, "ieee", cfg, 0)  # noqa: E731
                        g()
                        ms = do_bench(g, warmup=25, rep=80, return_mode="median")
                        rows.append((kind, d, causal, c, flops(b, h, n, d, causal, "bwd") / ms * 1e-9))
                    except Exception as exc:
                        rows.append((kind, d, causal, c, 0.0)); print(kind, c, exc)
                    print(rows[-1], flush=True)
    with open(os.path.join(out, "sweep.json"), "w") as fh:
        json.dump(rows, fh)
    print("\nbest per (kernel, D, causal):")
    best = {}
    for kind, d, causal, c, t in rows:
        key = (kind, d, causal)
        if t > best.get(key, (None, -1))[1]:
            best[key] = (c, t)
    for key, (c, t) in sorted(best.items()):
        print(f"  {key}: {c} {t:.0f} TFLOP/s")


def full(out, lengths, dims, dtypes):
    results = []
    for dtname in dtypes:
        dtype = getattr(torch, dtname)
        for d in dims:
            h = 2048 // d
            for causal in (False, True):
                for n in lengths:
                    b = max(1, 32768 // n)
                    row = {"dtype": dtname, "D": d, "N": n, "B": b, "H": h, "causal": causal}
                    for name in ("triton", "flash", "cudnn", "efficient"):
                        fwd, bwd = time_pair(name, b, h, n, d, dtype, causal)
                        row[f"{name}_fwd"] = None if fwd is None else flops(b, h, n, d, causal, "fwd") / fwd * 1e-9
                        row[f"{name}_bwd"] = None if bwd is None else flops(b, h, n, d, causal, "bwd") / bwd * 1e-9
                    results.append(row)
                    print(json.dumps(row), flush=True)
    mem = {}
    for name in ("triton", "flash"):
        try:
            mem[name] = peak_memory(name, 32768, 128, torch.bfloat16)
        except Exception as exc:
            mem[name] = None
            print("memory", name, exc)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "peak_mem_fwd_bwd_N32768_D128_bf16_H16": mem}
    with open(os.path.join(out, "bench.json"), "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    plot(results, os.path.join(out, "bench.png"))
    fmt = lambda x: "  -  " if x is None else f"{x:5.0f}"  # noqa: E731
    print(f"\n{meta}\n")
    print("dtype    D causal     N | tri_f  fa_f  cud_f eff_f | tri_b  fa_b cud_b eff_b | f/fa  f/cud  b/fa")
    for r in results:
        rf = r["triton_fwd"] / r["flash_fwd"] if r["triton_fwd"] and r["flash_fwd"] else float("nan")
        rc = r["triton_fwd"] / r["cudnn_fwd"] if r["triton_fwd"] and r["cudnn_fwd"] else float("nan")
        rb = r["triton_bwd"] / r["flash_bwd"] if r["triton_bwd"] and r["flash_bwd"] else float("nan")
        print(f"{r['dtype']:8s} {r['D']:3d} {str(r['causal']):5s} {r['N']:6d} | "
              + " ".join(fmt(r[f'{n}_fwd']) for n in ("triton", "flash", "cudnn", "efficient")) + " | "
              + " ".join(fmt(r[f'{n}_bwd']) for n in ("triton", "flash", "cudnn", "efficient"))
              + f" | {rf:4.2f} {rc:5.2f} {rb:5.2f}")
    print("peak memory fwd+bwd N=32768:", {k: (None if v is None else f"{v / 2**20:.0f} MiB") for k, v in mem.items()})


# ------------------------------------------------------------------------------------ features

def visible_pairs(n, causal, window):
    """Number of (query, key) pairs a row-wise mask lets through for Sq = Sk = n."""
    i = torch.arange(n, dtype=torch.int64)
    hi = i if causal else torch.full_like(i, n - 1)
    lo = torch.zeros_like(i)
    if window is not None:
        left, right = window
        if right >= 0:
            hi = torch.minimum(hi, i + right)
        if left >= 0:
            lo = torch.maximum(lo, i - left)
    return int((hi - lo + 1).clamp(min=0).sum())


# name: triton-fused's keyword arguments; every row is causal with Sq = Sk, so a window's right edge
# at 0 and bottom-right alignment add nothing to the causal mask the others express
FEATURES = {"causal": dict(causal=True), "window 1024": dict(causal=True, window=(1023, 0)),
            "softcap 30": dict(causal=True, softcap=30.0)}


def flex_mods(kw):
    """(mask_mod, score_mod) for FlexAttention with the semantics of triton-fused's ``kw``."""
    left = kw.get("window", (-1, -1))[0]
    cap = kw.get("softcap", 0.0)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        return keep & (q_idx - kv_idx <= left) if left >= 0 else keep

    def score_mod(score, b, h, q_idx, kv_idx):  # flex hands in the scaled logit, as softcap expects
        return cap * torch.tanh(score / cap)

    return mask_mod, (score_mod if cap else None)


def sdpa_mask(kw, n, device):
    """The same causal (windowed) visibility as a boolean attn_mask, True = attend."""
    i = torch.arange(n, device=device)
    keep = i[None, :] <= i[:, None]
    left = kw.get("window", (-1, -1))[0]
    if left >= 0:
        keep &= i[:, None] - i[None, :] <= left
    return keep


def feature_fns(kw, n, device="cuda"):
    """name -> callable(q, k, v) -> O, for every implementation that can express the row."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_mod, score_mod = flex_mods(kw)
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)
    flex = torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention
    fns = {"triton": lambda q, k, v: tf.flash_attention(q, k, v, **kw)[0],
           "flex": lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)}

    def sdpa(name, **args):
        def f(q, k, v):
            with sdpa_kernel(SDPA[name]):
                return F.scaled_dot_product_attention(q, k, v, **args)
        return f

    if "softcap" not in kw:  # SDPA has no score modification
        mask = sdpa_mask(kw, n, device)
        fns.update(efficient=sdpa("efficient", attn_mask=mask), cudnn=sdpa("cudnn", attn_mask=mask))
    if "softcap" not in kw and "window" not in kw:  # FLASH takes no mask: the plain causal row only
        fns["flash"] = sdpa("flash", is_causal=True)
    return fns


def time_fn(fn, b, h, n, d, dtype):
    """(fwd ms, bwd ms) medians of do_bench; None where the implementation refuses."""
    res = []
    try:
        q, k, v = inputs(b, h, n, d, dtype, False)
        fn(q, k, v)
        res.append(do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median"))
        q, k, v = inputs(b, h, n, d, dtype, True)
        o = fn(q, k, v)
        do = torch.randn_like(o)
        bw = lambda: o.backward(do, retain_graph=True)  # noqa: E731
        bw()
        res.append(do_bench(bw, warmup=25, rep=100, return_mode="median", grad_to_none=[q, k, v]))
    except Exception as exc:
        print(f"  refused: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        res += [None] * (2 - len(res))
    return res


def features(out, lengths, d=128, dtype=torch.bfloat16):
    h, rows = 2048 // d, []
    for n in lengths:
        b = max(1, 32768 // n)
        for feat, kw in FEATURES.items():
            fns = feature_fns(kw, n)
            q, k, v = inputs(b, h, n, d, dtype, False)
            diff = (fns["triton"](q, k, v).float() - fns["flex"](q, k, v).float()).abs().max().item()
            fl = 4.0 * b * h * visible_pairs(n, True, kw.get("window")) * d
            row = {"feature": feat, "N": n, "B": b, "H": h, "D": d, "max_abs_diff_triton_flex": diff}
            for name, fn in fns.items():
                fwd, bwd = time_fn(fn, b, h, n, d, dtype)
                row[f"{name}_fwd"] = None if fwd is None else fl / fwd * 1e-9
                row[f"{name}_bwd"] = None if bwd is None else 2.5 * fl / bwd * 1e-9
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "dtype": str(dtype), "causal": True}
    with open(os.path.join(out, "features.json"), "w") as fh:
        json.dump({"meta": meta, "results": rows}, fh, indent=1)
    names = ("triton", "flex", "flash", "efficient", "cudnn")
    fmt = lambda x: "    -" if x is None else f"{x:5.0f}"  # noqa: E731
    print(f"\n{meta}\nTFLOP/s (visible pairs only), bf16, D={d}, H={h}, causal")
    print(f"{'feature':12s} {'N':>6s} | " + " ".join(f"{n[:5]:>5s}" for n in names) + " (fwd) | "
          + " ".join(f"{n[:5]:>5s}" for n in names) + " (bwd) | max|O_tri - O_flex|")
    for r in rows:
        print(f"{r['feature']:12s} {r['N']:6d} | " + " ".join(fmt(r.get(f"{n}_fwd")) for n in names) + "       | "
              + " ".join(fmt(r.get(f"{n}_bwd")) for n in names) + f"       | {r['max_abs_diff_triton_flex']:.2e}")


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    dts = sorted({r["dtype"] for r in results})
    dims = sorted({r["D"] for r in results})
    fig, axes = plt.subplots(len(dts) * 2, len(dims) * 2, figsize=(4 * len(dims) * 2, 3 * len(dts) * 2),
                             squeeze=False)
    for i, dt in enumerate(dts):
        for mi, mode in enumerate(("fwd", "bwd")):
            for j, d in enumerate(dims):
                for ci, causal in enumerate((False, True)):
                    ax = axes[i * 2 + mi][j * 2 + ci]
                    rows = [r for r in results if r["dtype"] == dt and r["D"] == d and r["causal"] == causal]
                    for name in ("triton", "flash", "cudnn", "efficient"):
                        pts = [(r["N"], r[f"{name}_{mode}"]) for r in rows if r[f"{name}_{mode}"]]
                        if pts:
                            ax.plot(*zip(*pts), marker="o", label=name)
                    ax.set_xscale("log", base=2)
                    ax.set_title(f"{dt} {mode} D={d} {'causal' if causal else 'full'}", fontsize=8)
                    ax.set_xlabel("N"); ax.set_ylabel("TFLOP/s")
                    ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--features", action="store_true")
    ap.add_argument("--lengths", default=None, help="default 1024,4096,16384 (8192 with --features)")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.sweep:
        sweep(args.out)
    elif args.features:
        features(args.out, [int(x) for x in (args.lengths or "8192").split(",")])
    else:
        full(args.out, [int(x) for x in (args.lengths or "1024,4096,16384").split(",")],
             [int(x) for x in args.dims.split(",")], args.dtypes.split(","))


if __name__ == "__main__":
    main()
