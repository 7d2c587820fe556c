"""Split-KV flash-decoding in Triton over a contiguous or paged KV cache (flashcheck/contract/cache.py).

``attention(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
causal=False, scale=None, num_splits=1)`` -> (O in q's dtype, natural-log LSE float32 (B, Hq, Sq))

- q (B, Hq, Sq, D); contiguous cache k_cache (B, Hkv, S_max, D), v_cache (B, Hkv, S_max, Dv); paged
  cache k_cache (num_blocks, Hkv, page_size, D) with block_table (B, max_blocks) int32: position t of
  sequence b lies in block block_table[b, t // page_size], slot t % page_size (any page size >= 1).
- k_new / v_new (B, Hkv, Sq, D / Dv) are written into the cache at cache_seqlens[b] onwards, in place
  (torch indexing, before the kernels); the queries then see cache_seqlens[b] + Sq keys.
- causal=True is bottom-right against that length. A row that sees no key gets O = 0, LSE = -inf.
- GQA: one program of ``decode_split`` serves a whole group of G = Hq // Hkv query heads, its
  G * Sq rows stacked into one tile, so each key and value tile is read once per group, not once per
  query head: decoding (Sq = 1) is bound by reading the cache, not by the dots.
- num_splits >= 1 cuts each sequence's keys into that many tile-aligned ranges (the later ones empty
  when there are fewer tiles than splits), each attended by its own program; ``decode_merge`` then
  combines the partial (O, LSE) pairs in one pass from the largest LSE, as flashcheck.merge.merge_splits
  does (one rounding of the LSE, not one per pairwise merge). With one split the first kernel writes
  O and LSE itself and no merge runs.

Every position past a sequence's keys is NaN in the suite's caches: every key load is masked to the
sequence's length with other=0.0 (a NaN value times a zero weight would still be NaN), and hidden
scores are set to -inf before the exponential. Runs on CUDA tensors, or on CPU tensors in Triton's
interpreter (TRITON_INTERPRET=1 set before triton is imported), there without bfloat16.
"""
from __future__ import annotations

import math
import numbers
import os

import torch
import triton
import triton.language as tl

from flashcheck.contract import implementation
from flashcheck.impls import interpreter
from flashcheck.contract.checks import alignment, check_kvcache

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    interpreter.quicken()  # helpers called in every tile, without the interpreter re-swapping tl each time
DTYPES = ("float16", "float32") if INTERPRET else ("float16", "bfloat16", "float32")
# The interpreter runs each program's tiles one by one in NumPy: its lane stops at 256, as triton-fused's.
INTERPRET_MAX_SEQ = 256 if INTERPRET else None
MAX_SPLITS = 65535  # the launch grid's second dimension
MAX_HEAD_DIM = 256
WHO = "triton-decode"
LOG2E_F = 1.4426950408889634  # folded into qk_scale on the host: the kernel works in base 2
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit(do_not_specialize=["Hkv", "G", "D", "Dv", "N_ADD", "PAGE"])
def decode_split(Q, K, V, SEQLENS, TABLE, OP, LP,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, stb,
                 sob, soh, som, sos, sod, slb, slh, slm, sls,
                 Hkv, G, Sq, D, Dv, N_ADD, PAGE, qk_scale,
                 PAGED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 D_PAD: tl.constexpr, DV_PAD: tl.constexpr, DOT_PREC: tl.constexpr):
    """Program (b * Hkv + kv head, split, row tile): the partial O (OP) and LSE (LP) of rows
    r = g * Sq + i (query head kv_head * G + g, query i) over this split's keys."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    n = tl.load(SEQLENS + b) + N_ADD  # the keys this sequence's queries see (the appended ones included)

    offs_r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < G * Sq  # the tile is padded to a power of two >= 16 rows (tl.dot's minimum)
    h = hk * G + offs_r // Sq
    i = offs_r % Sq
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)

    # Splits start on tile boundaries, so only a sequence's last tile is ever partial; a split past
    # the last tile gets start >= n and runs no iteration (O = 0, LSE = -inf: weight 0 in the merge).
    per = tl.cdiv(tl.cdiv(n, BLOCK_N), num_splits) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, n)
    diag = n - Sq  # bottom-right: query i sees key j iff j <= i + n - Sq

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end  # past the sequence's length the cache holds NaN: never read it
        if PAGED:  # logical position -> (physical block, slot); the table is read only where key_ok
            blk = tl.load(TABLE + b * stb + offs_n // PAGE, mask=key_ok, other=0).to(tl.int64)
            slot = (offs_n % PAGE).to(tl.int64)
        else:
            blk = b
            slot = offs_n.to(tl.int64)
        k_rows = K + blk * skb + hk * skh + slot * skn
        v_rows = V + blk * svb + hk * svh + slot * svn
        # other=0.0 is the where() on the loaded values: masked keys and values are 0, never NaN
        k = tl.load(k_rows[:, None] + offs_d[None, :] * skd, mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        v = tl.load(v_rows[:, None] + offs_dv[None, :] * svd, mask=key_ok[:, None] & (offs_dv[None, :] < Dv),
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # base-2 logits: exp2 below
        keep = key_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= i[:, None] + diag)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # the running max, with this tile's scores
        # a row that has seen no key yet keeps m = -inf: shift it by 0 so exp2 gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])  # this tile's weights, relative to the new max: at most 1
        alpha = tl.exp2(m_i - m_use)  # how much the new max shrinks what earlier tiles summed
        l_i = l_i * alpha + tl.sum(p, 1)  # the running sum, on the new max's scale
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)  # rescaled, plus P V
        m_i = m_new

    seen = l_i > 0.0  # any visible key gives l >= 1 (its max contributes exp2(0))
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]  # a row that saw nothing has acc = 0, so O = 0
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))  # back to natural log
    row_o = b * sob + h * soh + i * som + split * sos
    tl.store(OP + row_o[:, None] + offs_dv[None, :] * sod, o.to(OP.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < Dv))
    tl.store(LP + b * slb + h * slh + i * slm + split * sls, lse, mask=row_ok)


@triton.jit(do_not_specialize=["Hq", "Sq", "Dv", "NS"])
def decode_merge(OP, LP, O, LSE, sob, soh, som, sos, sod, slb, slh, slm, sls, oob, ooh, oom, ood, llb, llh, llm,
                 Hq, Sq, Dv, NS,
                 BLOCK_R: tl.constexpr, DV_PAD: tl.constexpr):
    """Program (b * Hq + h, row tile): O and LSE of BLOCK_R rows from their NS partial states.

    As flashcheck.merge.merge_splits: m = max_s lse_s, w_s = exp(lse_s - m), LSE = m + log(sum_s w_s),
    O = sum_s (w_s / sum) O_s. The LSE is rounded once, however many splits there are."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < Sq
    offs_dv = tl.arange(0, DV_PAD)
    lp_rows = LP + b * slb + h * slh + rows * slm
    # Split by split, with no reduction over a (rows, splits) tile: a loop-carried tl.max / tl.sum over
    # chunks of splits failed Triton's TritonGPUOptimizeThreadLocality pass on an H200 (Triton 3.6) at
    # 16 rows x 32 splits ("PassManager::run failed", the gpu lane at Sq = 194, num_splits = 17).
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, NS):
        m = tl.maximum(m, tl.load(lp_rows + s * sls, mask=row_ok, other=float("-inf")))
    empty = m == float("-inf")  # -inf in every split: the row sees no key at all
    m0 = tl.where(empty, 0.0, m)
    total = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, NS):  # each term at most 1; exp(-inf) = 0 for an empty split
        total += tl.exp(tl.load(lp_rows + s * sls, mask=row_ok, other=float("-inf")) - m0)
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    acc = tl.zeros([BLOCK_R, DV_PAD], tl.float32)
    op_rows = OP + b * sob + h * soh + rows * som
    col_ok = row_ok[:, None] & (offs_dv[None, :] < Dv)
    for s in range(0, NS):
        w = tl.exp(tl.load(lp_rows + s * sls, mask=row_ok, other=float("-inf")) - m0) * inv
        acc += w[:, None] * tl.load(op_rows[:, None] + s * sos + offs_dv[None, :] * sod, mask=col_ok, other=0.0)
    lse = tl.where(empty, float("-inf"), m0 + tl.log(tl.where(empty, 1.0, total)))
    tl.store(O + b * oob + h * ooh + rows[:, None] * oom + offs_dv[None, :] * ood, acc.to(O.dtype.element_ty),
             mask=col_ok)
    tl.store(LSE + b * llb + h * llh + rows * llm, lse, mask=row_ok)


def _pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _config(dtype, dpad: int, dvpad: int, rows: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M covers a group's G * Sq rows (decoding: one
    tile), capped so that long query blocks become several row tiles rather than one huge one."""
    if INTERPRET:
        bn, cap, warps, stages = 16, 64, 4, 1  # small key tiles: a split boundary falls inside a short cache
    elif dtype == torch.float32:  # IEEE float32 dots run on the FMA units: keep BLOCK_M*BLOCK_N*D <= 2**17
        bn, warps, stages = 32, 4, 2
        cap = max(16, (1 << 17) // (bn * max(dpad, dvpad)))
    elif max(dpad, dvpad) <= 128:
        # two warps per 64-key tile: 2.6-2.7 TB/s on an H200 at D = 128, against 1.7 with four (scratch sweep
        # of tiles 32-128, warps 2-8, stages 2-4, docs/benchmarks.md)
        bn, cap, warps, stages = 64, 64, 2, 3
    else:
        bn, cap, warps, stages = 32, 64, 4, 3
    return min(_pad(rows), cap), bn, warps, stages


def _check_device(tensors):
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"{WHO}: q, k_cache, v_cache (and k_new, v_new) must be on one device, got "
                         f"{[str(t.device) for t in tensors]}")
    want = "cpu" if INTERPRET else "cuda"
    if dev.type != want:
        raise ValueError(f"{WHO}: needs {want} tensors" + (" (TRITON_INTERPRET=1 runs the kernels on CPU)"
                                                            if INTERPRET else " (or TRITON_INTERPRET=1 for CPU)")
                         + f", got device {dev}")


def _append(cache, new, seqlens, page, block_table):
    """Write new (B, Hkv, Sq, E) at positions seqlens[b] .. seqlens[b] + Sq - 1 of each sequence, in place."""
    bsz, sq = new.shape[0], new.shape[2]
    pos = seqlens.long()[:, None] + torch.arange(sq, device=new.device)  # (B, Sq)
    if block_table is None:
        where, at = torch.arange(bsz, device=new.device)[:, None].expand(bsz, sq), pos
    else:
        where, at = torch.gather(block_table.long(), 1, pos // page), pos % page
    cache[where, :, at] = new.transpose(1, 2)  # (B, Sq, Hkv, E): the two index tensors' dims come first


def decode_attention(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                     causal=False, scale=None, num_splits=1, config=None):
    """The full entry point: validates, appends k_new / v_new in place, then runs ``launch``."""
    lengths, _, _ = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, dtypes=DTYPES,
                                  who=WHO)
    _check_device([q, k_cache, v_cache] + ([k_new, v_new] if k_new is not None else []))
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) \
            or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{WHO}: num_splits must be an int in 1..{MAX_SPLITS}, got {num_splits!r}")
    d, dv = q.shape[3], v_cache.shape[3]
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"{WHO}: head dims up to {MAX_HEAD_DIM} are supported, got D={d}, Dv={dv}")
    if causal not in (False, True, None, "bottom_right"):
        alignment(causal)  # names a malformed value
        raise ValueError(f"{WHO}: a cache's queries are its last positions: causal is bottom-right only, "
                         f"got {causal!r}")
    added = 0
    if k_new is not None:  # only once everything is validated: a refused call leaves the cache as it was
        _append(k_cache, k_new, cache_seqlens, k_cache.shape[2], block_table)
        _append(v_cache, v_new, cache_seqlens, k_cache.shape[2], block_table)
        added = q.shape[2]
    return launch(q, k_cache, v_cache, cache_seqlens, block_table, causal=bool(causal), scale=scale,
                  num_splits=int(num_splits), max_keys=max(lengths) + added, added=added, config=config)


def launch(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal=False, scale=None, num_splits=1,
           max_keys, added=0, config=None):
    """The two kernels alone, on validated inputs (the benchmark times this: ``decode_attention``'s checks
    read cache_seqlens and block_table back to the host). Sequence b's queries see cache_seqlens[b] + added
    keys, at most ``max_keys``. ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the split
    kernel's launch parameters (BLOCK_* powers of two >= 16)."""
    bsz, hq, sq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    g = hq // hkv
    dpad, dvpad = _pad(d), _pad(dv)
    bm, bn, warps, stages = config or _config(q.dtype, dpad, dvpad, g * sq)
    # Splits past the longest sequence's last tile are empty for every sequence: they are not launched.
    # The kernel's ranges are the same either way (a sequence of t <= tiles key tiles gets one tile per split
    # when num_splits >= tiles), so the result does not change; shorter sequences still have empty splits.
    num_splits = max(1, min(num_splits, triton.cdiv(max_keys, bn)))
    o = torch.empty((bsz, hq, sq, dv), device=q.device, dtype=q.dtype)
    lse = torch.empty((bsz, hq, sq), device=q.device, dtype=torch.float32)
    if num_splits == 1:  # the split kernel writes the result itself: split stride 0
        op, lp = o, lse
        o_str, l_str = (*o.stride()[:3], 0, o.stride(3)), (*lse.stride(), 0)
    else:
        op = torch.empty((bsz, hq, sq, num_splits, dv), device=q.device, dtype=torch.float32)
        lp = torch.empty((bsz, hq, sq, num_splits), device=q.device, dtype=torch.float32)
        o_str, l_str = op.stride(), lp.stride()
    paged = block_table is not None
    table = block_table if paged else cache_seqlens  # an unused pointer when contiguous
    decode_split[(bsz * hkv, num_splits, triton.cdiv(g * sq, bm))](
        q, k_cache, v_cache, cache_seqlens, table, op, lp,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), table.stride(0) if paged else 0, *o_str, *l_str,
        hkv, g, sq, d, dv, added, k_cache.shape[2] if paged else 1, scale * LOG2E_F,
        PAGED=paged, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, D_PAD=dpad, DV_PAD=dvpad, DOT_PREC="ieee",
        num_warps=warps, num_stages=stages)
    if num_splits > 1:
        br = min(16, max(2, triton.next_power_of_2(sq)))  # no 1-wide tiles: decoding's Sq = 1 pads to 2 rows
        decode_merge[(bsz * hq, triton.cdiv(sq, br))](
            op, lp, o, lse, *op.stride(), *lp.stride(), *o.stride(), *lse.stride(), hq, sq, dv, num_splits,
            BLOCK_R=br, DV_PAD=dvpad, num_warps=4)
    return o, lse


@implementation(name=WHO, causal=("bottom_right",), dtypes=DTYPES, devices=("cpu",) if INTERPRET else ("cuda",),
                gqa=True, lse=True, kvcache=True, kv_append=True, paged=True, splits=True,
                head_dims=(1, MAX_HEAD_DIM), max_seq=INTERPRET_MAX_SEQ,
                # On CPU, in Triton's interpreter, its property run takes minutes: opt-in there
                # (pytest -m properties --impl triton-decode), as triton-fused's is.
                tags=("interpreter", "slow") if INTERPRET else ())
def attention(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None, causal=False,
              scale=None, num_splits=1):
    """Split-KV decoding against a KV cache; returns (O, LSE)."""
    return decode_attention(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new,
                            block_table=block_table, causal=causal, scale=scale, num_splits=num_splits)
