"""torch's FlexAttention (torch.nn.attention.flex_attention) as an independent implementation of the
feature matrix: causal masks, the sliding window and mask tensors as a ``mask_mod`` (a block mask), the softcap,
the ALiBi bias and bias tensors as a ``score_mod``, sinks as one more key. impls/flex_varlen.py runs a packed
batch through the same code.

Eager on CPU (an unfused reference path: it materializes the scores, forward only: torch has no
CPU backward for FlexAttention), torch.compile'd on CUDA (fused kernels, forward and backward).

What FlexAttention cannot express is not declared: dropout (a score_mod has no random numbers).
Sinks are not a FlexAttention feature; they join as one more key whose score is the sink's logit
and whose value is 0 (``_run``). Their gradient would come through a captured tensor of the
score_mod, not yet checked on CUDA, so they are declared where there is no backward (CPU).

Compiled means compiled for every call (``Compiled``): dynamo's defaults would run eager flex,
silently, once one function has been recompiled 8 times, and a suite that draws hundreds of
shapes and feature combinations passes that in minutes. So every number the mask_mod and
score_mod capture is a tensor (a Python int is a guard: one graph per value; a Python float
under dynamic shapes, a symbolic input inductor cannot lower), lengths are dynamic, batch and heads
are padded to multiples of 4 (``PAD``), one score_mod and one band mask_mod serve every combination of
the causal mask, window, softcap and ALiBi (a graph per dtype, head dim, group size, and mask or bias
tensor; static only where the known issue below lives, and everywhere with FLASHCHECK_FLEX_STATIC=1),
the recompile limits are raised, and a call that ran no compiled graph raises ``RanEager`` instead of
returning.
Eager FlexAttention on CPU is deliberate: inductor's CPU FlexAttention (torch 2.13) returns no LSE
and has no backward ("torch.compile on CPU only supports inference and `return_lse` is not
supported yet"), and its first compile takes about a minute on a 2-core machine.
"""
from __future__ import annotations

import functools
import math
import os
import warnings

import torch

from flashcheck.contract import KnownIssue, implementation, launch
from flashcheck.contract.checks import alignment, check_features, check_inputs, offset

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError as exc:  # torch < 2.5
    raise ImportError(f"flashcheck.impls.flex needs torch.nn.attention.flex_attention: {exc}") from exc

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9 returns the LSE through return_lse=True
    AuxRequest = None

WHO = "flex"
_CUDA = torch.cuda.is_available()
DTYPES = ("float16", "bfloat16", "float32") if _CUDA else ("float64", "float32", "float16", "bfloat16")


# Far above what one run compiles (a graph per feature combination, dtype, head count and
# alignment), and still finite: a guard that fails on every call ends in RanEager.
RECOMPILE_LIMIT = 1024


class RanEager(RuntimeError):
    """A call of a ``Compiled`` function that did not run its compiled graph."""


def _limits():
    """dynamo's config patch: raised recompile limits, and an error where it would fall back to eager."""
    return launch.compile_limits(RECOMPILE_LIMIT)


class Compiled:
    """``fn`` under torch.compile (static shapes, raised limits), checked on every call: the backend
    wraps each graph it compiles so that running it is counted, and a call that ran none (dynamo
    skipped the frame, or fell back to eager) raises RanEager. ``backend`` is dynamo's name of the
    compiler doing the work ("eager" lets the suite test this guard on CPU without inductor)."""

    def __init__(self, fn, backend="inductor", dynamic=False):
        self.name = getattr(fn, "__name__", "fn")
        self.compiles = self.runs = 0  # graphs compiled, and calls that ran one
        self.error = None  # the last error a call raised (a failed compile, say), for RanEager to name
        self._backend = backend
        # Static shapes make each shape a graph of its own: 3-10 s cold on an H200, 0.2-0.5 s from
        # inductor's disk caches, which xdist workers share. Every pin of every property is a shape of
        # its own, and in one gpu lane flex spent 466 of its 492 s compiling. Dynamic shapes compile a
        # graph per feature combination, whatever the lengths: probed on an H200 (torch 2.11) with the
        # causal mask, the window, the softcap, ALiBi and a bias, forward and backward, every later
        # length reused the first graph and matched float64 as closely as static graphs do. (While the
        # softcap was captured as a Python float, dynamic shapes failed with 'unbacked_bindings'; every
        # number is a tensor now.)
        self.fn = torch.compile(fn, backend=self._compile, dynamic=dynamic, fullgraph=True)

    def _compile(self, gm, example_inputs):
        self.compiles += 1
        graph = torch._dynamo.lookup_backend(self._backend)(gm, example_inputs)

        @functools.wraps(graph)  # keeps what dynamo reads off a compiled graph (e.g. _boxed_call)
        def counted(*args):
            self.runs += 1
            return graph(*args)

        return counted

    def __call__(self, *args, **kw):
        before = self.runs
        try:
            with _limits():
                out = self.fn(*args, **kw)
        except Exception as exc:
            self.error = exc
            if "LimitHit" in type(exc).__name__:  # FailOnRecompileLimitHit (FailOnCacheLimitHit before 2.6)
                raise RanEager(f"torch.compile'd {self.name} reached dynamo's recompile limit "
                               f"({RECOMPILE_LIMIT}) and would have run eager: {exc}") from exc
            raise
        if self.runs == before:
            earlier = "" if self.error is None else (f"; an earlier call raised {type(self.error).__name__}: "
                                                     f"{str(self.error).strip()[:200]}")
            raise RanEager(f"torch.compile'd {self.name} returned without running a compiled graph (dynamo "
                           f"ran it eager); {self.compiles} graph(s) compiled so far{earlier}")
        return out


@functools.lru_cache(maxsize=2)
def _compiled(dynamic=False):
    return Compiled(flex_attention, dynamic=dynamic)


def _mask_mod(sq, sk, align, window, device, attn_mask=None):
    # One structure for every alignment and window: the keys row i sees are one band lo[i]..hi[i], two
    # captured tensors. (A Python int captured is a guard on its value, a branch on the window's sides a
    # graph of its own: each compiled graph costs seconds, each band here one more input of the same one.)
    i = torch.arange(sq)
    diag = i + sk - sq  # the bottom-right diagonal
    lo, hi = torch.zeros(sq, dtype=torch.int64), torch.full((sq,), sk - 1)
    if align is not None:
        hi = torch.minimum(hi, i + offset(sq, sk, align))
    if window[0] >= 0:
        lo = torch.maximum(lo, diag - window[0])
    if window[1] >= 0:
        hi = torch.minimum(hi, diag + window[1])
    lo, hi = (x.to(device=device, dtype=torch.int32) for x in (lo, hi))

    def mask(b, h, i, j):
        seen = (j >= lo[i]) & (j <= hi[i])
        if attn_mask is not None:  # (B, Hq, Sq, Sk), contiguous (a stride pattern is a guard too)
            seen = seen & attn_mask[b, h, i, j]
        return seen

    return mask


def _score_mod(sq, sk, scale, softcap, slopes, device, dtype, bias=None):
    # Every number is a tensor: a Python float passed to a compiled flex_attention (its scale=) is
    # a guard on its value, i.e. one graph per drawn scale, and the suite draws scales freely (on an
    # H200 compiling was 90% of flex's lane time). So flex runs at scale 1 and the scale is applied
    # here, to the same float32 product of q and k its kernel would scale. The softcap is a tensor
    # too: under dynamic shapes a captured float is a symbolic input inductor's lowering rejects
    # (torch 2.13: "LoweringException: unbacked_bindings"); the ALiBi distance's offset is one for
    # the reason in _mask_mod. The softcap is always in the graph and ALiBi too where ``slopes`` are
    # given (attention() passes zeros when it is off): one structure for every combination of them.
    diag = None if slopes is None else torch.tensor(sk - sq, dtype=torch.int32, device=device)
    alibi = None if slopes is None else (lambda b, h, i, j: slopes[b, h] * (i + diag - j).abs())
    return _scores(scale, softcap, device, dtype, alibi, bias, always_capped=True)


def _scores(scale, softcap, device, dtype, alibi=None, bias=None, always_capped=False):
    """The logit path after q k^T: scale, softcap, ``alibi(b, h, i, j)`` subtracted, then the bias
    tensor (B, Hq, Sq, Sk) added: -inf there hides a key, as a mask does. ``always_capped``: the
    softcap is in the graph whether or not it is on (a tensor says which), so that a softcap does not
    make a graph of its own; off, the scaled logit passes unchanged, bit for bit."""
    scale = torch.tensor(scale, dtype=dtype, device=device)
    cap = torch.tensor(softcap or 1.0, dtype=dtype, device=device) if softcap or always_capped else None
    on = torch.tensor(bool(softcap), device=device)

    def score(s, b, h, i, j):
        s = s * scale
        if cap is not None:
            s = torch.where(on, cap * torch.tanh(s / cap), s) if always_capped else cap * torch.tanh(s / cap)
        if alibi is not None:
            s = s - alibi(b, h, i, j)
        if bias is not None:
            s = s + bias[b, h, i, j]
        return s

    return score


def _runner(q, dynamic=False):
    """Compiled FlexAttention on CUDA, eager on CPU (see the module's docstring)."""
    return _compiled(dynamic) if q.is_cuda else flex_attention


def _flex(q, k, v, dynamic, **kw):
    run = _runner(q, dynamic=dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager mode warns that it is unfused: that is what we want on CPU
        if AuxRequest is not None:
            o, aux = run(q, k, v, return_aux=AuxRequest(lse=True), **kw)
            return o, aux.lse
        return run(q, k, v, return_lse=True, **kw)


def _check_tensors(q, k, v, who):
    for label, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who}: {label} must be a torch.Tensor, got {type(x).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != ("cuda" if _CUDA else "cpu"):
        raise ValueError(f"{who}: unsupported device {q.device}; supported: {'cuda' if _CUDA else 'cpu'}")


def _compute_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32  # the dtype flex computes scores in


def _run(q, k, v, mod, mask_mod, mask_bh, sinks, dynamic=False):
    """FlexAttention at scale 1 (the score_mod scales), GQA through enable_gqa, ``mask_mod`` (or None) as
    a block mask over (B, H) = ``mask_bh``, compiled for dynamic shapes where ``dynamic``. (B, H, S, *) in
    and out.

    Sinks are one more key, after the last: its score is the sink's logit and its value 0, so flex's own
    softmax takes it in, as a fused kernel's does. (Merging it afterwards through the returned LSE carries
    that LSE's rounding into O: 1.1x the oracle's bound in float64 where the sink dominates a row.) A row
    that sees no key then sees the sink alone: O = 0, LSE = the sink."""
    if sinks is not None:
        sk = k.shape[2]
        k, v = (torch.cat([x, x.new_zeros(*x.shape[:2], 1, x.shape[3])], 2) for x in (k, v))
        last, logit = torch.tensor(sk, device=q.device), sinks.to(_compute_dtype(q))
        key_mod, key_mask = mod, mask_mod

        def mod(s, b, h, i, j):  # the real keys' indices clamped: a mod may index tensors by j
            return torch.where(j == last, logit[h], key_mod(s, b, h, i, torch.minimum(j, last - 1)))

        if key_mask is not None:
            def mask_mod(b, h, i, j):
                return (j == last) | key_mask(b, h, i, torch.minimum(j, last - 1))

    mask = None if mask_mod is None else create_block_mask(mask_mod, *mask_bh, q.shape[2], k.shape[2],
                                                           device=q.device)
    return _flex(q, k, v, dynamic, score_mod=mod, block_mask=mask, scale=1.0, enable_gqa=q.shape[1] != k.shape[1])


def _no_valid_choices(hq, hkv, sq, block_masked):
    """Where GQA_NO_VALID_CHOICES (below) lives. Its shapes compile statically: the issue was found
    and probed with a graph per shape, and a dynamic graph compiled for another shape would hide it
    or not, depending on which shape came first."""
    return hq != hkv and sq < 128 < sq * (hq // hkv) and block_masked


def _ungrouped_where_no_choices(sq, hq, k, v, compiled=None):
    """k, v (B, Hkv, S, E) with each kv head repeated for its group where GQA_NO_VALID_CHOICES would stop
    a block-masked graph compiling at ``sq`` query rows (exact, as each query head reads its own copy
    of the same keys; gradients sum back through repeat_interleave). Without GQA it compiles. Eager
    flex (CPU) never needs it; ``compiled`` lets a CPU test take the repeated path."""
    g = hq // k.shape[1]
    if (k.is_cuda if compiled is None else compiled) and _no_valid_choices(hq, k.shape[1], sq, True):
        return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return k, v


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
              attn_mask=None, attn_bias=None):
    _check_tensors(q, k, v, WHO)
    b, hq, hkv, sq, sk, d, dv = check_inputs(q, k, v, dtypes=DTYPES, who=WHO)
    align = alignment(causal)
    window = check_features(q, who=WHO, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                            sinks=sinks, attn_mask=attn_mask, sk=sk, attn_bias=attn_bias) or (-1, -1)
    cdt = _compute_dtype(q)
    # ALiBi always in the score_mod (slopes of 0 when off, s - 0 |i - j| = s bit for bit); the mask and
    # bias tensors contiguous: a stride pattern (a broadcast dim expanded with stride 0) is a guard too.
    slopes = torch.zeros(b, hq, dtype=cdt, device=q.device) if alibi_slopes is None else alibi_slopes.to(cdt)
    slopes = slopes.expand(b, hq).contiguous()
    # The bias joins the score_mod as a captured tensor. Compiled (CUDA), flex differentiates a captured
    # tensor that requires grad (torch >= 2.5), and autograd sums expand's broadcast dims back
    # (attn_bias.grad: test_gradients_match_analytic_float64_with_features, run on an H200, torch 2.11).
    bias = None if attn_bias is None else attn_bias.to(cdt).expand(b, hq, sq, sk).contiguous()
    attn_mask = None if attn_mask is None else attn_mask.expand(b, hq, sq, sk).contiguous()
    masked = attn_mask is not None or align is not None or window != (-1, -1)
    dynamic = os.environ.get("FLASHCHECK_FLEX_STATIC") != "1" and not _no_valid_choices(hq, hkv, sq, masked)
    # A block mask even where nothing is masked (a band of every key), as a graph without one is a graph
    # of its own; but not where GQA_NO_VALID_CHOICES would make one fail to compile.
    masked = masked or not _no_valid_choices(hq, hkv, sq, True)
    if PAD:  # every (B, H) table the mods index grows with q's batch and heads
        q, k, v = _padded_heads(q, k, v)
        slopes, bias, attn_mask = (None if x is None else _pad(x, *q.shape[:2], fill)
                                   for x, fill in ((slopes, 0.0), (bias, 0.0), (attn_mask, True)))
        sinks = None if sinks is None else _pad(sinks[None], 1, q.shape[1], 0.0)[0]
    if attn_mask is not None:  # the block mask then varies by batch entry and head
        mask, mask_bh = _mask_mod(sq, sk, align, window, q.device, attn_mask), tuple(q.shape[:2])
    else:
        mask, mask_bh = (_mask_mod(sq, sk, align, window, q.device) if masked else None), (None, None)
    scale = d ** -0.5 if scale is None else float(scale)
    o, lse = _run(q, k, v, _score_mod(sq, sk, scale, float(softcap), slopes, q.device, cdt, bias), mask, mask_bh,
                  sinks, dynamic=dynamic)
    return o[:b, :hq], lse[:b, :hq]


# Compiled FlexAttention is a graph per batch size, head count and head dim: flex_attention marks the
# heads and head dims static, and dynamo specializes the batch. The suite's pins and buckets meet
# dozens of (B, Hq, Hkv) and each graph compiles for 3-10 s (20-40 s while seven other workers compile
# too), so where compiled, q, k and v run padded to multiples of 4 along batch and kv heads (query
# heads: kv heads times the group): the padding is zeros whose outputs are dropped, every real (b, h)
# is computed as it would be alone (flex's programs are per batch entry, head and query block), and
# gradients reach the real inputs through the slices unchanged. What this gives up: a flex bug at one
# particular batch or head count (FLASHCHECK_FLEX_STATIC=1 runs the shapes as drawn).
PAD = _CUDA and os.environ.get("FLASHCHECK_FLEX_STATIC") != "1"


def _multiple_of_4(n: int) -> int:
    return -(-n // 4) * 4


def _pad(x, b, h, fill):
    """x (B, H, ...) grown to (b, h, ...) with ``fill``; differentiable (a copy into a slice)."""
    if tuple(x.shape[:2]) == (b, h):
        return x
    out = x.new_full((b, h, *x.shape[2:]), fill)
    out[:x.shape[0], :x.shape[1]] = x
    return out


def _padded_heads(q, k, v, batch=True):
    """q, k, v padded along batch (where ``batch``) and kv heads to multiples of 4, query heads to those
    times the group: the padded query heads sit on padded kv heads (enable_gqa's head h // G)."""
    b = _multiple_of_4(q.shape[0]) if batch else q.shape[0]
    hkv, g = _multiple_of_4(k.shape[1]), q.shape[1] // k.shape[1]
    return _pad(q, b, hkv * g, 0.0), _pad(k, b, hkv, 0.0), _pad(v, b, hkv, 0.0)


# Eager FlexAttention costs ~0.1 s a call on CPU: its full property run is opt-in there ("slow",
# e.g. pytest -m properties --impl flex); tests/test_flex.py pins one case per feature for CI.
# Seen on an H200 (torch 2.11) while the softcap was captured as a Python float: a softcap past
# float16's range (1e6) gave dQ = -inf for float16 inputs. Captured as a float32 tensor (below, for
# the compile's sake) the gradients are finite: the known issue no longer reproduced on the H200
# (2026-12-01) and was removed, as test_known_issues asked.


# Found by the gpu lane on an H200 (torch 2.11, 2026-12-01), shrunk and probed by hand: with
# GQA (Hq = 4, Hkv = 2, D = 16) and a block mask (causal, a window, or both), inductor finds no
# kernel to lower FlexAttention to at Sq = 65, 70 and 80 (Sk = 64, 70 or 128); Sq = 17, 64 and 140
# compile, and so does Hq = Hkv. docs/findings.md has the repro.
# Probed on an H200: it fails where a group's queries fill more than one 128-row block and Sq fits
# in one (Sq G = 132, 136, 140, 200, 240, 280 with Sq < 128), and compiles at Sq G <= 128 or Sq > 128.
GQA_NO_VALID_CHOICES = KnownIssue(
    "compiled FlexAttention (torch 2.11): GQA with a block mask at Sq < 128 < Sq * (Hq / Hkv) fails to "
    "lower (InductorError: NoValidChoicesError)",
    applies=lambda c: _no_valid_choices(c.hq, c.hkv, c.sq, c.causal is not None or c.window is not None
                                        or c.mask is not None),  # a block mask (inferred for masks)
    witness=dict(hq=4, hkv=2, sq=70, sk=64, d=16, dv=16, causal="bottom_right", dtype="float16"),
    failure=r"NoValidChoicesError|No choices")


# Found on CPU (torch 2.13, eager) when bias tensors were added, triaged in float64 torch: flex keeps its
# LSE in log2 units (the eager path returns logsumexp / ln 2 and the top level multiplies by ln 2 again),
# so a float32 LSE below -finfo(float32).max * ln 2 = -2.36e38 overflows to -inf. A bias of float32's or
# bfloat16's finfo.min (-3.4e38) on every key a row sees gives that row LSE = -inf where the truth is
# -3.4e38 (its O, the plain mean, is right; float16's finfo.min and float64 inputs are far from it).
# The compiled kernel works in log2 units too: the witness reproduces on an H200 (torch 2.11) as well.
LOG2_LSE_OVERFLOW = -torch.finfo(torch.float32).max * math.log(2)


def _row_below_log2_range(c):
    """A row that sees some key, all of them biased below LOG2_LSE_OVERFLOW (float32 logits)."""
    if c.bias is None or c.bias[0] != "min" or c.dtype not in ("float32", "bfloat16"):
        return False
    vis = c.visible()
    low = c.bias_argument() < LOG2_LSE_OVERFLOW
    return bool(((low | ~vis).all(axis=-1) & vis.any(axis=-1)).any())


LSE_LOG2_OVERFLOW = KnownIssue(
    "FlexAttention keeps the LSE in log2 units: a float32 row whose logits all lie below -2.36e38 (a bias of "
    "finfo.min) gets LSE = -inf",
    applies=_row_below_log2_range,
    witness=dict(sq=3, sk=5, d=16, dv=16, dtype="bfloat16", bias=("min", True, False, 1.0, 3)),
    failure=r"lse: non-finite mismatch .*got np\.float64\(-inf\)")


implementation(name=WHO, causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cuda",) if _CUDA else ("cpu",),
               backward=_CUDA, gqa=True, lse=True, window=True, softcap=True, alibi=True, sinks=not _CUDA, mask=True,
               bias=True, known_issues=(GQA_NO_VALID_CHOICES, LSE_LOG2_OVERFLOW) if _CUDA else (LSE_LOG2_OVERFLOW,),
               # compiled on an H200 (torch 2.11), float32 at D = 160 needs more shared memory than
               # the SM has ("No valid triton configs"): 128 is the largest size every dtype compiles
               head_dims=(16, 128) if _CUDA else (1, 256), tags=() if _CUDA else ("slow",))(attention)
