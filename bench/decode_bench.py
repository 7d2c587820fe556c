"""GB/s of triton-decode (impls/triton_decode.py) at decoding shapes, beside torch SDPA and FlexAttention.

    python bench/decode_bench.py                 # 12 shapes, about 2-3 minutes on an H200
    python bench/decode_bench.py --quick         # one shape (B = 8, L = 8192)
    python bench/decode_bench.py --sweep-splits  # also num_splits in 1..64 on the contiguous cache
    python bench/decode_bench.py --out FILE.json # the results as JSON too

Sq = 1 (one new token per sequence), Hq = 32, Hkv = 8, D = Dv = 128, float16, B in {1, 8, 64}, every
sequence holding L in {1k, 8k, 32k, 128k} keys (a shape whose caches do not fit in 80% of the free
memory is skipped). triton-decode runs on a contiguous cache (B, Hkv, L, D) and on paged caches of
page size 16 and 256 with the blocks in a random order, num_splits = ceil(SMs / (B * Hkv)) (capped at
the number of 64-key tiles). Timed is ``triton_decode.launch``: the kernels alone, since the checked
entry point reads cache_seqlens and block_table back to the host (at B = 64, L = 128k, page 16 that
is 524k table entries checked in Python). SDPA (flash, efficient, cuDNN backends through
sdpa_kernel) and FlexAttention (torch.compile(flex_attention), no mask) read the contiguous cache,
with GQA folded into the query rows: q (B, Hq, 1, D) as (B, Hkv, G, D), exact without a causal mask,
so that every backend takes it and reads each key once per group, as triton-decode does.

GB/s = (bytes of K and V read + q + o) / median time (triton.testing.do_bench, which flushes L2
before each run), beside the device's copy bandwidth measured in the same run (a 4 GiB
device-to-device copy: 2 * bytes / time). Before timing, triton-decode is checked against a float64
reference at one shape (paged, appended keys, ragged lengths, NaN past every sequence, 8 splits;
and contiguous, 4 splits); the run stops if the error is past 1e-2 (O) or 1e-3 (LSE).

Works with torch 2.11 + triton 3.6 and torch 2.13 + triton 3.9 (stable Triton APIs only). Importable
on a machine without CUDA; running it there says so and exits.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HQ, HKV, D, DTYPE = 32, 8, 128, torch.float16
DEVICE = "cuda"
BATCHES = (1, 8, 64)
LENGTHS = (1024, 8192, 32768, 131072)
PAGES = (16, 256)
SDPA = ("flash", "efficient", "cudnn")


def _do_bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=20, rep=100, return_mode="median")  # ms


def copy_bandwidth(gib=4):
    """GB/s of a device-to-device copy of ``gib`` GiB (read + write)."""
    a = torch.empty(gib << 28, dtype=torch.float32, device=DEVICE)  # 2**28 floats per GiB
    b = torch.empty_like(a)
    ms = _do_bench(lambda: b.copy_(a))
    nbytes = a.numel() * a.element_size()
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def reference(q, k_cache, v_cache, lengths, block_table, causal, scale):
    """Dense float64 attention per sequence over its first lengths[b] keys: (O, LSE)."""
    bsz, hq, sq, d = q.shape
    g = hq // k_cache.shape[1]
    o = torch.zeros(bsz, hq, sq, v_cache.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((bsz, hq, sq), -math.inf, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        t = torch.arange(n, device=q.device)
        if block_table is None:
            k, v = k_cache[b, :, :n], v_cache[b, :, :n]
        else:
            page = k_cache.shape[2]
            blk, slot = block_table[b].long()[t // page], t % page
            k, v = k_cache[blk, :, slot].transpose(0, 1), v_cache[blk, :, slot].transpose(0, 1)
        k, v = (x.double().repeat_interleave(g, dim=0) for x in (k, v))
        s = q[b].double() @ k.transpose(-1, -2) * scale
        if causal:
            hidden = t[None, :] > torch.arange(sq, device=q.device)[:, None] + n - sq
            s = s.masked_fill(hidden, -math.inf)
        lse[b] = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(lse[b].isinf(), 0.0, lse[b])[..., None])
        o[b] = p @ v
    return o, lse


def check_correctness(td):
    """triton-decode against float64 at one shape, paged with appended keys and contiguous; max errors."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=DEVICE, generator=gen).to(DTYPE)  # noqa: E731
    bsz, page, lengths = 3, 16, [1000, 1, 300]
    scale = 1 / math.sqrt(D)
    q, k_new, v_new = rnd(bsz, HQ, 1, D), rnd(bsz, HKV, 1, D), rnd(bsz, HKV, 1, D)
    per = -(-(max(lengths) + 1) // page)
    blocks = bsz * per + 2  # two unused blocks, NaN
    table = torch.randperm(blocks, device=DEVICE, generator=gen)[:bsz * per].view(bsz, per).to(torch.int32)
    kp = torch.full((blocks, HKV, page, D), math.nan, device=DEVICE, dtype=DTYPE)
    vp = torch.full_like(kp, math.nan)
    for b, n in enumerate(lengths):
        t = torch.arange(n, device=DEVICE)
        kp[table[b].long()[t // page], :, t % page] = rnd(n, HKV, D)
        vp[table[b].long()[t // page], :, t % page] = rnd(n, HKV, D)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    errors = {}
    o, lse = td.attention(q, kp, vp, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, block_table=table,
                          causal=True, num_splits=8)
    ro, rl = reference(q, kp, vp, [n + 1 for n in lengths], table, True, scale)  # kp now holds the new keys
    errors["paged, appended, 8 splits"] = ((o.double() - ro).abs().max().item(), (lse.double() - rl).abs().max().item())
    kc = torch.full((bsz, HKV, 1024, D), math.nan, device=DEVICE, dtype=DTYPE)
    vc = torch.full_like(kc, math.nan)
    for b, n in enumerate(lengths):
        kc[b, :, :n], vc[b, :, :n] = rnd(HKV, n, D), rnd(HKV, n, D)
    o, lse = td.attention(q, kc, vc, cache_seqlens=seqlens, num_splits=4)
    ro, rl = reference(q, kc, vc, lengths, None, False, scale)
    errors["contiguous, 4 splits"] = ((o.double() - ro).abs().max().item(), (lse.double() - rl).abs().max().item())
    return errors


def _flex():
    """torch.compile(flex_attention), dynamic shapes first (one compile for every shape), static if that fails."""
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 256)
    return {"dynamic": torch.compile(flex_attention, dynamic=True),
            "static": torch.compile(flex_attention, dynamic=False)}


def baselines(q, kc, vc, flex):
    """name -> a callable over the contiguous cache, GQA folded into the query rows."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bsz = q.shape[0]
    qf = q.view(bsz, HKV, HQ // HKV, D)  # head h = kv_head * G + g: the group's G heads as G query rows
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}

    def sdpa(backend):
        def f():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qf, kc, vc)
        return f

    fns = {f"sdpa-{n}": sdpa(b) for n, b in backends.items()}
    for mode in ("dynamic", "static"):
        if mode in flex:
            fns[f"flex-{mode}"] = (lambda fn: lambda: fn(qf, kc, vc))(flex[mode])
    return fns


def time_or_none(label, fn, results):
    try:
        fn()
        torch.cuda.synchronize()
        return _do_bench(fn)
    except Exception as exc:  # a backend that refuses the shape
        results.setdefault("refused", []).append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return None


def run_shape(td, bsz, length, flex, sweep, results):
    row = {"B": bsz, "L": length}
    nbytes = bsz * HKV * length * 2 * D * 2 + bsz * HQ * 2 * D * 2  # K and V, plus q and o
    row["bytes"] = nbytes
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # about four programs per SM: the sweep's best on an H200 (B = 8: 8 splits; B = 64: 1-2)
    splits = max(1, min(-(-4 * sms // (bsz * HKV)), -(-length // 64)))
    row["splits"] = splits
    q = torch.randn(bsz, HQ, 1, D, device=DEVICE, dtype=DTYPE)
    seqlens = torch.full((bsz,), length, dtype=torch.int32, device=DEVICE)
    times = {}
    kc = torch.randn(bsz, HKV, length, D, device=DEVICE, dtype=DTYPE)
    vc = torch.randn_like(kc)
    times["triton contiguous"] = time_or_none(
        f"triton contiguous B={bsz} L={length}",
        lambda: td.launch(q, kc, vc, seqlens, num_splits=splits, max_keys=length), results)
    if sweep:
        best = None
        for ns in (1, 2, 4, 8, 16, 32, 64):
            ms = time_or_none(f"triton {ns} splits", lambda: td.launch(q, kc, vc, seqlens, num_splits=ns,
                                                                       max_keys=length), results)
            if ms is not None and (best is None or ms < best[1]):
                best = (ns, ms)
        row["best_splits"] = best
    for name, fn in baselines(q, kc, vc, flex).items():
        if name == "flex-static" and times.get("flex-dynamic") is not None:
            continue  # the dynamic compile worked: no second compile per shape
        times[name] = time_or_none(f"{name} B={bsz} L={length}", fn, results)
    if times.get("flex-dynamic") is None:
        flex.pop("dynamic", None)  # failed once: do not compile it again for every shape
    times["flex"] = times.pop("flex-dynamic", None) or times.pop("flex-static", None)
    times.pop("flex-static", None)
    del kc, vc
    torch.cuda.empty_cache()
    for page in PAGES:
        per = -(-length // page)
        table = torch.randperm(bsz * per, device=DEVICE).view(bsz, per).to(torch.int32)
        kp = torch.randn(bsz * per, HKV, page, D, device=DEVICE, dtype=DTYPE)
        vp = torch.randn_like(kp)
        times[f"triton paged {page}"] = time_or_none(
            f"triton paged {page} B={bsz} L={length}",
            lambda: td.launch(q, kp, vp, seqlens, table, num_splits=splits, max_keys=length), results)
        del kp, vp, table
        torch.cuda.empty_cache()
    row["ms"] = times
    row["GB/s"] = {k: (None if ms is None else nbytes / (ms * 1e-3) / 1e9) for k, ms in times.items()}
    line = ", ".join(f"{k} {v:.0f}" for k, v in row["GB/s"].items() if v is not None)
    print(f"B={bsz:3d} L={length:6d} splits={splits:2d}: GB/s {line}", flush=True)
    return row


COLUMNS = ("triton contiguous", "triton paged 16", "triton paged 256", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn",
           "flex")


def table(rows, copy_gbs):
    out = ["| B | L | splits | " + " | ".join(COLUMNS) + " | triton contiguous / copy |",
           "|---|---|---|" + "---|" * len(COLUMNS) + "---|"]
    for r in rows:
        cells = []
        for c in COLUMNS:
            gbs, ms = r["GB/s"].get(c), r["ms"].get(c)
            cells.append("n/a" if gbs is None else f"{gbs:.0f} ({ms * 1e3:.0f} us)")
        frac = r["GB/s"].get("triton contiguous")
        out.append(f"| {r['B']} | {r['L']} | {r['splits']} | " + " | ".join(cells)
                   + f" | {'n/a' if frac is None else f'{frac / copy_gbs:.0%}'} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape: B = 8, L = 8192")
    ap.add_argument("--sweep-splits", action="store_true", help="also time num_splits 1..64 (contiguous)")
    ap.add_argument("--out", help="write the results to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_bench: needs a CUDA GPU (this machine has none)")
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("decode_bench: unset TRITON_INTERPRET to time the compiled kernels")
        return 2
    import triton

    from flashcheck.impls import triton_decode as td

    name = torch.cuda.get_device_name(0)
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    errors = check_correctness(td)
    for label, (eo, el) in errors.items():
        print(f"correctness vs float64 ({label}): max |dO| = {eo:.2e}, max |dLSE| = {el:.2e}", flush=True)
    if any(not (eo <= 1e-2 and el <= 1e-3) for eo, el in errors.values()):
        print("decode_bench: triton-decode is wrong at the check shape; not timing it")
        return 1
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy (4 GiB): {copy_gbs:.0f} GB/s", flush=True)
    shapes = [(8, 8192)] if args.quick else [(b, n) for b in BATCHES for n in LENGTHS]
    flex, results, rows = _flex(), {}, []
    for bsz, length in shapes:
        need = 2 * bsz * HKV * length * D * 2  # one layout's K and V at a time
        free = torch.cuda.mem_get_info()[0]
        if need > 0.8 * free:
            print(f"B={bsz} L={length}: skipped, K and V need {need / 1e9:.1f} GB of {free / 1e9:.1f} GB free")
            continue
        rows.append(run_shape(td, bsz, length, flex, args.sweep_splits, results))
    for line in results.get("refused", []):
        print(f"refused: {line}")
    if args.sweep_splits:
        for r in rows:
            print(f"B={r['B']} L={r['L']}: best num_splits {r['best_splits']}, the heuristic's {r['splits']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__,
                       "copy_GB/s": copy_gbs, "errors": errors, "rows": rows, **results}, f, indent=1)
    print(f"\n{name}: GB/s = (K + V + q + o bytes) / median time; device copy bandwidth {copy_gbs:.0f} GB/s; "
          f"Hq={HQ}, Hkv={HKV}, D={D}, fp16, Sq=1\n")
    print(table(rows, copy_gbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
