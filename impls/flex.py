"""torch's FlexAttention (torch.nn.attention.flex_attention) as an independent implementation of the
feature matrix: causal masks, the sliding window and mask tensors as a ``mask_mod`` (a block mask), the softcap
and the ALiBi bias as a ``score_mod``, sinks merged in afterwards through the LSE.

Eager on CPU (an unfused reference path: it materializes the scores, forward only: torch has no
CPU backward for FlexAttention), torch.compile'd on CUDA (fused kernels, forward and backward).

What FlexAttention cannot express is not declared: dropout (a score_mod has no random numbers).
Sinks are not a FlexAttention feature; they are added exactly from the returned LSE,
O' = O exp(LSE - LSE'), LSE' = logaddexp(LSE, sink), which needs gradients through the LSE,
so they are declared where there is no backward to trust that path to (CPU).

Compiled means compiled for every call (``Compiled``): dynamo's defaults would run eager flex,
silently, once one function has been recompiled 8 times, and a suite that draws hundreds of
shapes and feature combinations passes that in minutes. So every number the mask_mod and
score_mod capture is a tensor (a Python int is a guard: one graph per value; a Python float
under dynamic shapes, a symbolic input inductor cannot lower), shapes are static (a graph per
shape: the gpu lane draws about a dozen), the recompile limits are raised, and a call that ran
no compiled graph raises ``RanEager`` instead of returning.
Eager FlexAttention on CPU is deliberate: inductor's CPU FlexAttention (torch 2.13) returns no LSE
and has no backward ("torch.compile on CPU only supports inference and `return_lse` is not
supported yet"), and its first compile takes about a minute on a 2-core machine.
"""
from __future__ import annotations

import functools
import warnings

import torch

from flashcheck.contract import KnownIssue, implementation
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
    """dynamo's config patch: raised recompile limits, and an error where it would fall back to eager.
    (Older torch spells them cache_size_limit, accumulated_cache_size_limit, fail_on_cache_limit_hit.)"""
    cfg = torch._dynamo.config
    settings = {("recompile_limit", "cache_size_limit"): RECOMPILE_LIMIT,
                ("accumulated_recompile_limit", "accumulated_cache_size_limit"): RECOMPILE_LIMIT,
                ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"): True}
    return cfg.patch(**{next(n for n in names if hasattr(cfg, n)): value for names, value in settings.items()})


class Compiled:
    """``fn`` under torch.compile (static shapes, raised limits), checked on every call: the backend
    wraps each graph it compiles so that running it is counted, and a call that ran none (dynamo
    skipped the frame, or fell back to eager) raises RanEager. ``backend`` is dynamo's name of the
    compiler doing the work ("eager" lets the suite test this guard on CPU without inductor)."""

    def __init__(self, fn, backend="inductor"):
        self.name = getattr(fn, "__name__", "fn")
        self.compiles = self.runs = 0  # graphs compiled, and calls that ran one
        self.error = None  # the last error a call raised (a failed compile, say), for RanEager to name
        self._backend = backend
        # Static shapes: each shape is a graph of its own (the gpu lane draws about a dozen), which
        # is what inductor's flex lowers reliably on torch 2.11 (dynamic shapes failed there with
        # 'unbacked_bindings' and fake-tensor errors on every softcap, ALiBi and window case).
        self.fn = torch.compile(fn, backend=self._compile, dynamic=False, fullgraph=True)

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


@functools.lru_cache(maxsize=1)
def _compiled():
    return Compiled(flex_attention)


def _mask_mod(sq, sk, align, window, device, attn_mask=None):
    # The offsets are tensors: a captured Python int is a guard on its value, i.e. one compiled
    # graph per (Sq, Sk) and window, where a captured tensor is one more input of the same graph.
    off, diag, left, right = (torch.tensor(n, dtype=torch.int32, device=device)
                              for n in (offset(sq, sk, align), sk - sq, *window))
    left_on, right_on = window[0] >= 0, window[1] >= 0  # which sides bound: the graph's structure

    def mask(b, h, i, j):
        seen = j >= 0  # a tensor of True, whatever the mask below adds
        if align is not None:
            seen = seen & (j <= i + off)
        if left_on:
            seen = seen & (j >= i + diag - left)
        if right_on:
            seen = seen & (j <= i + diag + right)
        if attn_mask is not None:  # (B, Hq, Sq, Sk), broadcast dims expanded with stride 0
            seen = seen & attn_mask[b, h, i, j]
        return seen

    return mask


def _score_mod(sq, sk, scale, softcap, slopes, device, dtype):
    # Every number is a tensor: a Python float passed to a compiled flex_attention (its scale=) is
    # a guard on its value, i.e. one graph per drawn scale, and the suite draws scales freely (on an
    # H200 compiling was 90% of flex's lane time). So flex runs at scale 1 and the scale is applied
    # here, to the same float32 product of q and k its kernel would scale. The softcap is a tensor
    # too: under dynamic shapes a captured float is a symbolic input inductor's lowering rejects
    # (torch 2.13: "LoweringException: unbacked_bindings"); the ALiBi distance's offset is one for
    # the reason in _mask_mod.
    scale = torch.tensor(scale, dtype=dtype, device=device)
    cap = torch.tensor(softcap, dtype=dtype, device=device) if softcap else None
    diag = None if slopes is None else torch.tensor(sk - sq, dtype=torch.int32, device=device)

    def score(s, b, h, i, j):
        s = s * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            s = s - slopes[b, h] * (i + diag - j).abs()
        return s

    return score


def _runner(q):
    """Compiled FlexAttention on CUDA, eager on CPU (see the module's docstring)."""
    return _compiled() if q.is_cuda else flex_attention


def _flex(q, k, v, **kw):
    run = _runner(q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager mode warns that it is unfused: that is what we want on CPU
        if AuxRequest is not None:
            o, aux = run(q, k, v, return_aux=AuxRequest(lse=True), **kw)
            return o, aux.lse
        return run(q, k, v, return_lse=True, **kw)


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
              attn_mask=None):
    for label, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{WHO}: {label} must be a torch.Tensor, got {type(x).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{WHO}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != ("cuda" if _CUDA else "cpu"):
        raise ValueError(f"{WHO}: unsupported device {q.device}; supported: {'cuda' if _CUDA else 'cpu'}")
    b, hq, hkv, sq, sk, d, dv = check_inputs(q, k, v, dtypes=DTYPES, who=WHO)
    dtype = q.dtype
    align = alignment(causal)
    window = check_features(q, who=WHO, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                            sinks=sinks, attn_mask=attn_mask, sk=sk) or (-1, -1)
    if attn_mask is not None:  # the block mask then varies by batch entry and head
        full = attn_mask.expand(b, hq, sq, sk)
        mask = create_block_mask(_mask_mod(sq, sk, align, window, q.device, full), b, hq, sq, sk, device=q.device)
    elif align is not None or window != (-1, -1):
        mask = create_block_mask(_mask_mod(sq, sk, align, window, q.device), None, None, sq, sk,
                                 device=q.device)
    else:
        mask = None
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32  # the dtype flex computes scores in
    slopes = None if alibi_slopes is None else alibi_slopes.to(cdt).expand(b, hq)
    scale = d ** -0.5 if scale is None else float(scale)
    mod = _score_mod(sq, sk, scale, float(softcap), slopes, q.device, cdt)
    if sinks is not None and q.dtype in (torch.float16, torch.bfloat16):
        # the sink rescales O after flex: from a half-precision O that would round it twice
        q, k, v = (x.float() for x in (q, k, v))
    o, lse = _flex(q, k, v, score_mod=mod, block_mask=mask, scale=1.0, enable_gqa=hq != hkv)
    if sinks is not None:
        sink = sinks.to(lse.dtype)[None, :, None]
        total = torch.logaddexp(lse, sink)
        # the keys' share of the softmax; 0 on a row that sees nothing (and never -inf - -inf = NaN)
        share = torch.where(total == float("-inf"), 0.0, torch.exp(lse - total))
        o = (o * share.unsqueeze(-1)).to(dtype)
        lse = total
    return o, lse


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
    applies=lambda c: c.hq != c.hkv and c.sq < 128 < c.sq * (c.hq // c.hkv)
    and (c.causal is not None or c.window is not None or c.mask is not None),  # a block mask (inferred for masks)
    witness=dict(hq=4, hkv=2, sq=70, sk=64, d=16, dv=16, causal="bottom_right", dtype="float16"),
    failure=r"NoValidChoicesError|No choices")


implementation(name=WHO, causal=("bottom_right", "top_left"), dtypes=DTYPES, devices=("cuda",) if _CUDA else ("cpu",),
               backward=_CUDA, gqa=True, lse=True, window=True, softcap=True, alibi=True, sinks=not _CUDA, mask=True,
               known_issues=(GQA_NO_VALID_CHOICES,) if _CUDA else (),
               # compiled on an H200 (torch 2.11), float32 at D = 160 needs more shared memory than
               # the SM has ("No valid triton configs"): 128 is the largest size every dtype compiles
               head_dims=(16, 128) if _CUDA else (1, 256), tags=() if _CUDA else ("slow",))(attention)
