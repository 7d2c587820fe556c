"""Triton kernels of the fused FlashAttention (forward; backward dQ, which also stores delta, then dK/dV).

Layout and semantics are docs/design.md's: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv);
query head h reads key/value head h // G with G = Hq // Hkv.

Visibility is a band: query i sees key j iff j <= i + OFF when CAUSAL and j >= i + LOFF when LEFT.
OFF is the tighter of the causal diagonal (Sk - Sq bottom-right, 0 top-left) and a window's right
edge (Sk - Sq + right); LOFF is a window's left edge (Sk - Sq - left). Whole key tiles outside the
band are skipped, tiles inside it run without masks, only the tiles it cuts are masked.

Optional features, each a constexpr flag so that the plain kernel compiles exactly as without them:
- SOFTCAP: the scaled logit s becomes c * tanh(s / c) (cap2 = c * log2(e)); SOFTCAP = 2 (the general
  build) takes cap2 = 0 as no cap at run time, so that one build serves calls with and without one;
- ALIBI: logits get -slope_h * |i + DIAG - j| (DIAG = Sk - Sq), slopes float32 at SLOPES + b * ssb + h
  (the general build always sets it, with slopes of 0 where there are none);
- HAS_SINKS: one float32 logit per query head (SINKS + h) joins each row's softmax denominator.

ONE_LOOP (constexpr, default off): every tile runs through the masked loop instead of the band's cut
tiles alone. The launcher sets it for the general build of small calls (triton_fused.GENERAL_SCORES)
and for IEEE float32, whose dots run on the FMA units and cost far more than the masks: one inlined
loop body instead of two halves the code Triton compiles (at D = 128 the dK/dV kernel took 7-15 s to
compile on a loaded H100), at about the same speed (on an H200: forward 0.91-1.06x, forward + backward
0.98-1.01x). Both builds compute the same formula, but on a GPU their results differ in the last bits:
the compiler orders the float32 operations of the two differently.

IS_VARLEN (constexpr, default off): a packed batch (flashcheck/contract/packed.py), q (Tq, Hq, D),
k (Tk, Hkv, D), v (Tk, Hkv, Dv), the token strides in the sequence-stride slots (sqm, skn, ...), lse and
delta (Hq, Tq). Program (tile, h, b) reads sequence b's start and length from CU_Q / CU_K (int32,
B + 1 offsets), offsets its pointers by the start, masks rows and keys past its own lengths, and returns
at once when its tile starts past them (the grid covers the longest sequence). Sq, Sk then carry the
packed totals Tq, Tk; OFF and LOFF are relative to the sequence's own diagonal Sk_b - Sq_b, and TOP caps
the right edge absolutely (0 for top-left causal, a huge number otherwise); DIAG is Sk_b - Sq_b.

Conventions shared by every kernel:
- head dims are padded to a power of two (D_PAD, DV_PAD >= 16); PAD_D / PAD_DV say whether the
  padding is real, so the column masks vanish at compile time when it is not;
- the last dimension of every tensor has stride 1, the others are passed (so a sliced, longer
  buffer is read in place and its tail must never leak in);
- scores are kept in base 2: s2 = (q . k) * scale * log2(e), so softmax uses exp2;
- LSE is stored in natural log (float32); a row that sees no key stores O = 0, LSE = -inf;
- no atomics: every output element is written by exactly one program.
"""
import inspect

import triton
import triton.language as tl

LOG2E_F = 1.4426950408889634  # host-side float
LOG2E = tl.constexpr(LOG2E_F)   # kernels may read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)

# Triton compiles a variant per integer argument that is 1 or divisible by 16. In the forward, head
# counts, lengths, head dims and band offsets feed only masks, loop bounds and row indices: left
# unspecialized, one compiled forward serves every shape of a (dtype, tiles, flags) combination, at
# the same TFLOP/s on the H200 (bf16, D = 128, N = 4096 and 16384: 501-517 against 497-506).
# The backward kernels keep the shape's own integers specialized: without, they ran 6-11% slower in
# that measurement. The band's offsets are unspecialized everywhere: they only move loop bounds and
# the diagonal's mask, and specialized, each causal alignment and window width compiled its own
# backward (the gpu lane's backward properties spent most of their time compiling those).
SHAPE_INTS = ["Hq", "G", "Sq", "Sk", "D", "Dv", "OFF", "LOFF", "DIAG", "TOP"]
FEATURE_INTS = ["OFF", "LOFF", "DIAG", "TOP"]  # the band's and features' offsets


@triton.jit
def _load2d(ptrs, rows, n_rows, cols, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a tile, masking rows >= n_rows and/or cols >= n_cols (to 0) only where asked."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store2d(ptrs, x, rows, n_rows, cols, n_cols, MASK_COLS: tl.constexpr):
    if MASK_COLS:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
    else:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)


@triton.jit
def _key_range(m0, Sk, OFF, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """For the query tile [m0, m0 + BLOCK_M): (end of the unmasked full key tiles, end of keys to visit).

    Keys [0, lo) are in bounds and visible to every row of the tile (no mask needed);
    keys [lo, hi) need the bounds / causal mask; keys >= hi are hidden from every row (skipped).
    """
    if CAUSAL:
        lo = tl.minimum(Sk // BLOCK_N, tl.maximum(m0 + OFF + 1, 0) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(Sk, tl.maximum(m0 + BLOCK_M + OFF, 0))
    else:
        lo = (Sk // BLOCK_N) * BLOCK_N
        hi = Sk
    return lo, hi


@triton.jit
def _left_edge(m0, LOFF, lo, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """With a window's left edge, the key range of _key_range splits into three tile-aligned parts:
    [start, full) masked, [full, lo) visible to every row, [lo, hi) masked; returns (start, full, lo).
    Keys before start are hidden from every row of the tile (skipped)."""
    start = (tl.maximum(m0 + LOFF, 0) // BLOCK_N) * BLOCK_N
    full = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + LOFF, 0), BLOCK_N) * BLOCK_N
    # no tile is visible to every row (a narrow band): mask every tile from start to hi
    narrow = full > lo
    full = tl.where(narrow, tl.cdiv(hi, BLOCK_N) * BLOCK_N, full)
    lo = tl.where(narrow, full, lo)
    return start, full, lo


@triton.jit
def _tanh(x):
    """tanh in float32 to a few ulps (libdevice's tanh has no interpreter counterpart): the Taylor
    series below 0.5, where (1 - e) / (1 + e) with e = exp(-2|x|) would cancel, that form above."""
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * LOG2E))
    z = a * a
    series = a * (1.0 + z * (-0.3333333333333333 + z * (0.13333333333333333 + z * (-0.05396825396825397 + z * (
        0.021869488536155203 + z * (-0.008863235529902197 + z * (0.003592128036572481
                                                                 + z * -0.0014558343870513183)))))))
    t = tl.where(a < 0.5, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _logits(qk, qi, kj, qk_scale, cap2, slope2, DIAG, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Base-2 logits of the dot products qk of query rows qi with key columns kj (index tensors that
    broadcast to qk's shape), and t = tanh(scaled logit / cap) for the softcap's derivative 1 - t^2."""
    if SOFTCAP:
        cap = cap2
        if SOFTCAP == 2:  # the general build decides at run time: cap2 = 0 is no cap (and 1 - t^2 = 1)
            cap = tl.where(cap2 > 0, cap2, 1.0)
        t = _tanh(qk * (qk_scale / cap))
        s = t * cap
        if SOFTCAP == 2:
            s = tl.where(cap2 > 0, s, qk * qk_scale)
            t = tl.where(cap2 > 0, t, 0.0)
    else:
        s = qk * qk_scale
        t = s  # unused
    if ALIBI:
        dist = tl.abs(qi + DIAG - kj).to(tl.float32)
        s = s - slope2 * dist
    return s, t


@triton.jit
def _slope(SLOPES, ssb, b, h, ALIBI: tl.constexpr):
    """Head h's ALiBi slope in base 2 (0.0 when ALIBI is off: never read then)."""
    if ALIBI:
        return tl.load(SLOPES + b * ssb + h) * LOG2E
    else:
        return 0.0


@triton.jit
def _sequence(CU, b):
    """IS_VARLEN: (first token as int64, length) of sequence b on one side of the packed batch."""
    start = tl.load(CU + b)
    return start.to(tl.int64), tl.load(CU + b + 1) - start


@triton.jit
def _band(Sq, Sk, OFF, LOFF, TOP):
    """IS_VARLEN: one sequence's (OFF, LOFF, DIAG) from its own lengths (see the module's docstring)."""
    diag = Sk - Sq
    return tl.minimum(diag + OFF, TOP), diag + LOFF, diag


# ----------------------------------------------------------------------------------- forward

@triton.jit
def _kv_tile(q, k_base, v_base, skn, svn, offs_n, offs_m, Sk, D, Dv, OFF, qk_scale, LOFF, DIAG, cap2, slope2,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
             ALIBI: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
             PAD_D: tl.constexpr, PAD_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    """Load one key/value tile and its base-2 logits (and tanh, see _logits); masked keys (past Sk, or
    outside a row's band) get -inf."""
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    k = _load2d(k_base + offs_n[:, None] * skn + offs_d[None, :], offs_n, Sk, offs_d, D, MASKED, PAD_D)
    v = _load2d(v_base + offs_n[:, None] * svn + offs_dv[None, :], offs_n, Sk, offs_dv, Dv, MASKED, PAD_DV)
    s, t = _logits(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), offs_m[:, None], offs_n[None, :],
                   qk_scale, cap2, slope2, DIAG, SOFTCAP, ALIBI)
    if MASKED:
        keep = offs_n[None, :] < Sk
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + OFF)
        if LEFT:
            keep = keep & (offs_n[None, :] >= offs_m[:, None] + LOFF)
        s = tl.where(keep, s, float("-inf"))
    return k, v, s, t


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, svn, lo, hi, offs_m, Sk, D, Dv, OFF, qk_scale,
               LOFF, DIAG, cap2, slope2,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
               DV_PAD: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k, v, s, _ = _kv_tile(q, k_base, v_base, skn, svn, offs_n, offs_m, Sk, D, Dv, OFF, qk_scale,
                              LOFF, DIAG, cap2, slope2, MASKED, CAUSAL, LEFT, SOFTCAP, ALIBI,
                              D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # the running max, with this tile's scores
        if MASKED:
            # a row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])  # this tile's weights, relative to the new max: at most 1
        alpha = tl.exp2(m_i - m_use)  # how much smaller the old max makes what came before
        l_i = l_i * alpha + tl.sum(p, 1)  # the running sum, on the new max's scale
        acc = acc * alpha[:, None]  # rescale what earlier tiles accumulated to the new max
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)  # and add this tile's P V
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=SHAPE_INTS)
def attn_fwd(Q, K, V, O, LSE,
             sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
             Hq, G, Sq, Sk, D, Dv, OFF, qk_scale, LOFF, DIAG, cap2, SLOPES, ssb, SINKS,
             CAUSAL: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
             HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
             DOT_PREC: tl.constexpr, CU_Q=None, CU_K=None, TOP=0, IS_VARLEN: tl.constexpr = False,
             ONE_LOOP: tl.constexpr = False):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query tiles see the most keys: start them first to shorten the tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    # grid (tiles, Hq, B): the order of (tiles, B * Hq), with no axis past 65535 programs (a flat
    # B * Hq in y failed to launch past 65535 heads in all)
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // G
    m0 = pid_m * BLOCK_M
    if IS_VARLEN:  # sequence b's own tokens: Sq, Sk become its lengths
        q_start, seq_q = _sequence(CU_Q, b)
        if m0 >= seq_q:  # a tile past this sequence's queries
            return
        k_start, Sk = _sequence(CU_K, b)
        row_base = h * Sq + q_start  # lse (Hq, Tq)
        Sq = seq_q
        OFF, LOFF, DIAG = _band(Sq, Sk, OFF, LOFF, TOP)
        q_off, k_off, v_off, o_off = q_start * sqm, k_start * skn, k_start * svn, q_start * som
    else:
        row_base = (b * Hq + h) * Sq
        q_off, k_off, v_off, o_off = b * sqb, b * skb, b * svb, b * sob
    q_base = Q + q_off + h * sqh
    k_base = K + k_off + hk * skh
    v_base = V + v_off + hk * svh
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q = _load2d(q_base + offs_m[:, None] * sqm + offs_d[None, :], offs_m, Sq, offs_d, D, True, PAD_D)
    slope2 = _slope(SLOPES, ssb, b, h, ALIBI)

    if HAS_SINKS:
        # the sink starts each row's running max and sum: exp2(sink - m) = 1 (0 for a sink of -inf)
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + h) * LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    lo, hi = _key_range(m0, Sk, OFF, BLOCK_M, BLOCK_N, CAUSAL)
    if LEFT:
        start, full, lo = _left_edge(m0, LOFF, lo, hi, BLOCK_M, BLOCK_N)
    else:
        start = 0
        full = 0
    if ONE_LOOP:  # every key tile through the masked loop (see the module's docstring)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, svn, start, hi, offs_m, Sk, D, Dv,
                                   OFF, qk_scale, LOFF, DIAG, cap2, slope2, True, CAUSAL, LEFT, SOFTCAP, ALIBI,
                                   BLOCK_N, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
    else:
        if LEFT:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, svn, start, full, offs_m, Sk, D,
                                       Dv, OFF, qk_scale, LOFF, DIAG, cap2, slope2, True, CAUSAL, LEFT, SOFTCAP,
                                       ALIBI, BLOCK_N, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, svn, full, lo, offs_m, Sk, D, Dv, OFF,
                                   qk_scale, LOFF, DIAG, cap2, slope2, False, CAUSAL, LEFT, SOFTCAP, ALIBI,
                                   BLOCK_N, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skn, svn, lo, hi, offs_m, Sk, D, Dv, OFF,
                                   qk_scale, LOFF, DIAG, cap2, slope2, True, CAUSAL, LEFT, SOFTCAP, ALIBI,
                                   BLOCK_N, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)

    seen = l_i > 0.0  # with a finite sink every row has l >= 1: O = 0 where it saw no key, LSE = sink
    if IS_VARLEN:
        seen = seen & (Sk > 0)  # but a sequence without keys has LSE = -inf, sink or not
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]  # rows that saw nothing have acc = 0, so O = 0
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))  # back to natural log
    o_base = O + o_off + h * soh
    _store2d(o_base + offs_m[:, None] * som + offs_dv[None, :], o.to(O.dtype.element_ty),
             offs_m, Sq, offs_dv, Dv, PAD_DV)
    tl.store(LSE + row_base + offs_m, lse, mask=offs_m < Sq)


# ---------------------------------------------------------------------------------- backward

@triton.jit
def _row_lse2(LSE, row_base, offs_m, Sq):
    """Base-2 LSE per row with padded rows and rows that saw no key mapped to +inf (so P = 0)."""
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < Sq, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqm, sdom, lo, hi, offs_n,
                Sq, D, Dv, OFF, qk_scale, LOFF, DIAG, cap2, slope2,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
                ALIBI: tl.constexpr, BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                PAD_D: tl.constexpr, PAD_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        q = _load2d(q_base + offs_m[:, None] * sqm + offs_d[None, :], offs_m, Sq, offs_d, D, True, PAD_D)
        do = _load2d(do_base + offs_m[:, None] * sdom + offs_dv[None, :], offs_m, Sq, offs_dv, Dv, True, PAD_DV)
        lse2 = _row_lse2(LSE, row_base, offs_m, Sq)
        delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < Sq, other=0.0)  # stored by attn_bwd_dq
        s_t, t_t = _logits(tl.dot(k, tl.trans(q), input_precision=DOT_PREC), offs_m[None, :], offs_n[:, None],
                           qk_scale, cap2, slope2, DIAG, SOFTCAP, ALIBI)  # (BLOCK_N, BLOCK_M)
        if MASKED:  # hidden scores go to -inf before exp2, so no inf is ever formed
            if LEFT:
                keep = offs_n[:, None] >= offs_m[None, :] + LOFF
                if CAUSAL:
                    keep = keep & (offs_m[None, :] + OFF >= offs_n[:, None])
                s_t = tl.where(keep, s_t, float("-inf"))
            else:
                s_t = tl.where(offs_m[None, :] + OFF >= offs_n[:, None], s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:  # through the cap: d(c tanh(s / c))/ds = 1 - tanh^2
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit(do_not_specialize=FEATURE_INTS)
def attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
                  sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
                  sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                  Hq, Hkv, G, Sq, Sk, D, Dv, OFF, qk_scale, sm_scale, LOFF, DIAG, cap2, SLOPES, ssb,
                  CAUSAL: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                  DOT_PREC: tl.constexpr, CU_Q=None, CU_K=None, TOP=0, IS_VARLEN: tl.constexpr = False,
                  ONE_LOOP: tl.constexpr = False):
    """One program per (key tile, batch, kv head): loops over the group's query heads and query tiles."""
    pid_n = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)  # grid (key tiles, Hkv, B)
    hk = tl.program_id(1).to(tl.int64)
    n0 = pid_n * BLOCK_N
    if IS_VARLEN:  # sequence b's own tokens: Sq, Sk become its lengths
        k_start, seq_k = _sequence(CU_K, b)
        if n0 >= seq_k:  # a tile past this sequence's keys
            return
        q_start, seq_q = _sequence(CU_Q, b)
        Tq = Sq
        Sq, Sk = seq_q, seq_k
        OFF, LOFF, DIAG = _band(Sq, Sk, OFF, LOFF, TOP)
        q_off, do_off, k_off, v_off = q_start * sqm, q_start * sdom, k_start * skn, k_start * svn
        dk_off, dv_off = k_start * sdkn, k_start * sdvn
    else:
        q_off, do_off, k_off, v_off, dk_off, dv_off = b * sqb, b * sdob, b * skb, b * svb, b * sdkb, b * sdvb
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    k = _load2d(K + k_off + hk * skh + offs_n[:, None] * skn + offs_d[None, :], offs_n, Sk, offs_d, D,
                True, PAD_D)
    v = _load2d(V + v_off + hk * svh + offs_n[:, None] * svn + offs_dv[None, :], offs_n, Sk, offs_dv, Dv,
                True, PAD_DV)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], tl.float32)
    if CAUSAL:
        # queries below n0 - OFF see no key of this tile; from n0 + BLOCK_N - 1 - OFF on they see all
        lo = (tl.maximum(n0 - OFF, 0) // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - OFF, lo), BLOCK_M) * BLOCK_M, Sq)
        mid = tl.maximum(mid, lo)
    else:
        lo = 0
        mid = 0
    if LEFT:
        # by the left edge, queries up to n0 - LOFF see every key of this tile, past n0 + BLOCK_N - 1 - LOFF
        # none: rows [mid, full) run unmasked, [full, end) masked (full is aligned, or Sq, or mid)
        end = tl.minimum(Sq, tl.maximum(n0 + BLOCK_N - LOFF, 0))
        full = tl.maximum(tl.minimum((tl.maximum(n0 - LOFF + 1, 0) // BLOCK_M) * BLOCK_M, Sq), mid)
    else:
        end = Sq
        full = Sq
    for g in range(G):
        h = hk * G + g
        q_base = Q + q_off + h * sqh
        do_base = DO + do_off + h * sdoh
        if IS_VARLEN:
            row_base = h * Tq + q_start  # lse, delta (Hq, Tq)
        else:
            row_base = (b * Hq + h) * Sq
        slope2 = _slope(SLOPES, ssb, b, h, ALIBI)
        if ONE_LOOP:  # every query tile in one loop, masked only where there is a band to mask
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqm, sdom, lo, end,
                                 offs_n, Sq, D, Dv, OFF, qk_scale, LOFF, DIAG, cap2, slope2, CAUSAL or LEFT, CAUSAL,
                                 LEFT, SOFTCAP, ALIBI, BLOCK_M, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqm, sdom, lo, mid, offs_n,
                                 Sq, D, Dv, OFF, qk_scale, LOFF, DIAG, cap2, slope2, True, CAUSAL, LEFT, SOFTCAP,
                                 ALIBI, BLOCK_M, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqm, sdom, mid, full,
                                 offs_n, Sq, D, Dv, OFF, qk_scale, LOFF, DIAG, cap2, slope2, False, CAUSAL, LEFT,
                                 SOFTCAP, ALIBI, BLOCK_M, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
            if LEFT:
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqm, sdom, full, end,
                                     offs_n, Sq, D, Dv, OFF, qk_scale, LOFF, DIAG, cap2, slope2, True, CAUSAL,
                                     LEFT, SOFTCAP, ALIBI, BLOCK_M, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
    dk = dk * sm_scale
    _store2d(DK + dk_off + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :], dk.to(DK.dtype.element_ty),
             offs_n, Sk, offs_d, D, PAD_D)
    _store2d(DV + dv_off + hk * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             offs_n, Sk, offs_dv, Dv, PAD_DV)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skn, svn, lo, hi, offs_m, Sk, D, Dv, OFF, qk_scale,
              LOFF, DIAG, cap2, slope2,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
              ALIBI: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
              DV_PAD: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k, v, s, t = _kv_tile(q, k_base, v_base, skn, svn, offs_n, offs_m, Sk, D, Dv, OFF, qk_scale,
                              LOFF, DIAG, cap2, slope2, MASKED, CAUSAL, LEFT, SOFTCAP, ALIBI,
                              D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # through the cap (see _dkdv_inner)
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit(do_not_specialize=FEATURE_INTS)
def attn_bwd_dq(Q, K, V, O, DO, LSE, DELTA, DQ,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, sdob, sdoh, sdom, sdqb, sdqh, sdqm,
                Hq, G, Sq, Sk, D, Dv, OFF, qk_scale, sm_scale, LOFF, DIAG, cap2, SLOPES, ssb,
                CAUSAL: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
                DOT_PREC: tl.constexpr, CU_Q=None, CU_K=None, TOP=0, IS_VARLEN: tl.constexpr = False,
                ONE_LOOP: tl.constexpr = False):
    """One program per (query tile, batch, query head): loops over the key tiles it sees. It runs before
    attn_bwd_dkdv and stores its rows' delta = rowsum(dO * O) for it: a kernel of its own for delta would
    cost a launch per backward and, in a run of many shapes, a compile per shape."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    # grid (tiles, Hq, B): the order of (tiles, B * Hq), with no axis past 65535 programs (a flat
    # B * Hq in y failed to launch past 65535 heads in all)
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // G
    m0 = pid_m * BLOCK_M
    if IS_VARLEN:  # sequence b's own tokens: Sq, Sk become its lengths
        q_start, seq_q = _sequence(CU_Q, b)
        if m0 >= seq_q:  # a tile past this sequence's queries
            return
        k_start, Sk = _sequence(CU_K, b)
        row_base = h * Sq + q_start  # lse, delta (Hq, Tq)
        Sq = seq_q
        OFF, LOFF, DIAG = _band(Sq, Sk, OFF, LOFF, TOP)
        q_off, do_off, k_off, v_off, dq_off = q_start * sqm, q_start * sdom, k_start * skn, k_start * svn, \
            q_start * sdqm
        o_off = q_start * som
    else:
        row_base = (b * Hq + h) * Sq
        q_off, do_off, k_off, v_off, dq_off = b * sqb, b * sdob, b * skb, b * svb, b * sdqb
        o_off = b * sob
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q = _load2d(Q + q_off + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], offs_m, Sq, offs_d, D,
                True, PAD_D)
    do = _load2d(DO + do_off + h * sdoh + offs_m[:, None] * sdom + offs_dv[None, :], offs_m, Sq, offs_dv, Dv,
                 True, PAD_DV)
    o = _load2d(O + o_off + h * soh + offs_m[:, None] * som + offs_dv[None, :], offs_m, Sq, offs_dv, Dv,
                True, PAD_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + row_base + offs_m, delta, mask=offs_m < Sq)
    lse2 = _row_lse2(LSE, row_base, offs_m, Sq)
    slope2 = _slope(SLOPES, ssb, b, h, ALIBI)
    k_base = K + k_off + hk * skh
    v_base = V + v_off + hk * svh
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    lo, hi = _key_range(m0, Sk, OFF, BLOCK_M, BLOCK_N, CAUSAL)
    if LEFT:
        start, full, lo = _left_edge(m0, LOFF, lo, hi, BLOCK_M, BLOCK_N)
    else:
        start = 0
        full = 0
    if ONE_LOOP:  # every key tile through the masked loop (see the module's docstring)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skn, svn, start, hi, offs_m, Sk, D, Dv, OFF,
                       qk_scale, LOFF, DIAG, cap2, slope2, True, CAUSAL, LEFT, SOFTCAP, ALIBI,
                       BLOCK_N, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
    else:
        if LEFT:
            dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skn, svn, start, full, offs_m, Sk, D, Dv, OFF,
                           qk_scale, LOFF, DIAG, cap2, slope2, True, CAUSAL, LEFT, SOFTCAP, ALIBI,
                           BLOCK_N, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skn, svn, full, lo, offs_m, Sk, D, Dv, OFF,
                       qk_scale, LOFF, DIAG, cap2, slope2, False, CAUSAL, LEFT, SOFTCAP, ALIBI,
                       BLOCK_N, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skn, svn, lo, hi, offs_m, Sk, D, Dv, OFF,
                       qk_scale, LOFF, DIAG, cap2, slope2, True, CAUSAL, LEFT, SOFTCAP, ALIBI,
                       BLOCK_N, D_PAD, DV_PAD, PAD_D, PAD_DV, DOT_PREC)
    dq = dq * sm_scale
    _store2d(DQ + dq_off + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             offs_m, Sq, offs_d, D, PAD_D)


# ------------------------------------------------------------------------------- general build

def _unspecialized(kernel):
    """``kernel`` with none of its integers or pointers specialized (on 1, on 16-divisibility, on
    alignment): one compile serves every shape, layout and alignment of a (dtype, tiles, flags)
    combination. triton_fused runs its general build (small calls, GENERAL_SCORES) on these; at those
    sizes a launch costs more than the loads that specialization would have vectorized."""
    names = [p.name for p in inspect.signature(kernel.fn).parameters.values()
             if p.annotation is not tl.constexpr and p.default is not None]
    return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)(kernel.fn)


attn_fwd_general = _unspecialized(attn_fwd)
attn_bwd_dq_general = _unspecialized(attn_bwd_dq)
attn_bwd_dkdv_general = _unspecialized(attn_bwd_dkdv)
