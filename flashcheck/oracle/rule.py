"""The oracle: dense float64 truth, and the one rule that says how far a result may be from it.

Every result X of a case in dtype t is held, entry by entry, to

    |X - X_true|  <=  min(worst, Z * sigma)  +  coherent  +  0.75 ulp_t(X_true)

X_true is dense attention in float64 on the same (already t-exact) inputs. The terms, built in
bounds.py, bound the rounding of a correct fused kernel in t (rounding.py) and of
every other place a correct kernel rounds (rounding.py's catalogue: some always admitted,
some only under the declared precision that names them, "tf32", "dense", "prescaled"):

- Each term of the sum behind an entry (p_ij v_j for O, P_ij dO_i for dV, dS_ij k_j for dQ,
  dS_ij q_i for dK) carries an independent relative error: rho_ij for P (P rounded to t, the
  score's float32 dot product, the exp's argument), plus |dS_ij| u_t and dP's own error for dS.
  With a_j the bound on term j, ``worst`` = sum_j a_j and ``sigma`` = sqrt(sum_j a_j^2).
  Hoeffding's inequality gives P(|error| > Z sigma) <= 2 exp(-Z^2 / 2) = 3e-8 at Z = 6, so the
  bound tracks the sqrt(Sk) growth of real rounding instead of the Sk growth of the worst case,
  and never takes more than the worst case.
- Errors shared by a whole row add up coherently, with their sign: the error of D = rowsum(dO*O)
  (O comes back rounded to t) enters dQ_i as dD_i * |(P K)_i|, so cancellation in P K counts; the
  float32 accumulation of each sum is bounded by u_acc (2 + sqrt(n)) times its absolute size.
- Rounding the result to t costs half a unit in the last place; a quarter more is the floor.

A bias check follows (``check_bias``): a correct kernel's rounding is unbiased, so in fp16 and
bf16, a result whose mean signed error (or mean error towards larger magnitude), each entry in
units of its own allowed error, is both significant (a self-normalized sign statistic past 5,
probability <= 2 exp(-12.5) = 7e-6 for symmetric independent errors) and larger than 0.2 beyond
the model's own bias fails, even when every entry is inside its bound (bf16 outputs all 1% too
large). Only entries whose truth stands above its allowed error count: below it, the sign of
the truth is rounding noise.

A failure report compares the error with plain dense attention's in t and names the smallest
declared precision whose rule the result meets (``explain``).

A kernel that declares precision="naive" (plain dense attention computed in t) is held to the
older, looser rule instead: k times the error of plain dense attention in t, plus a floor.

NaN or inf where the truth is finite always fails; a truth that is infinite in t (the LSE of a
row that sees no key, an fp16 gradient past 65504) must be matched exactly.
"""
from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass

import numpy as np

from flashcheck.oracle import bounds
from flashcheck.oracle import reference
from flashcheck.oracle.rounding import DECLARES, HALF, PRECISIONS, RESULTS, Precision, fused
from flashcheck.strategies.case import EPS, AttentionCase, quantize

ULP_FLOOR = 0.25  # ulps allowed beyond the half ulp of rounding the result
# The bias check: significance, the mean error in units of the allowed error, groups it needs, and
# how far above its allowed error a truth must stand to count.
BIAS_Z, BIAS_SHARE, BIAS_MIN_GROUPS, BIAS_CLEAR = 5.0, 0.2, 32, 1.0
K_NAIVE = {"o": 2, "lse": 2, "dq": 3, "dk": 3, "dv": 3, "dsinks": 3, "dbias": 3}
FLOOR_NAIVE = 8


class Truth:
    """Dense float64 results by name: O, LSE, the largest logit, and the gradients dQ, dK, dV, dsinks
    (the sink logits', (Hq,); None without sinks) and dbias (the bias tensor's; None without one).
    ``grads`` is a dict of them, or a function giving one: a forward property never asks for them."""

    def __init__(self, o: np.ndarray, lse: np.ndarray, logit_max: float, grads):
        self.o, self.lse, self.logit_max, self._grads = o, lse, logit_max, grads

    def _grad(self, name):
        if callable(self._grads):
            self._grads = self._grads()
        return self._grads.get(name)

    dq = property(lambda self: self._grad("dq"))
    dk = property(lambda self: self._grad("dk"))
    dv = property(lambda self: self._grad("dv"))
    dsinks = property(lambda self: self._grad("dsinks"))
    dbias = property(lambda self: self._grad("dbias"))

    def __getitem__(self, name):
        return getattr(self, name)


@dataclass(frozen=True)
class _Parts:
    """Dense float64 intermediates in the grouped layout: (B, Hkv, G, Sq, .) against (B, Hkv, 1, Sk, .)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    s: np.ndarray  # scaled logits; only where visible
    p: np.ndarray  # softmax probabilities (0 where masked)
    o: np.ndarray
    lse: np.ndarray
    scale: float
    psink: np.ndarray | None  # the sink's share of each row's softmax, where the case has sinks
    added: np.ndarray | None = None  # what the features add to each logit, in magnitude (reference._logits)


# Score entries (B Hq Sq Sk) that one cache of O(Sq Sk) intermediates holds at once: one 2048 x 2048
# problem of two heads. Held by count alone (32), they grew a process by 390 MB per long case (up to
# 12 GB, with eight such processes on one GPU host), and long cases took up to 2x as long on fresh
# pages. A case is asked for again within its example (every kernel and tiling of one problem, the
# bias check, the report), rarely after it: the newest case is always kept.
HELD_SCORES = 1 << 23


def _weight(case) -> int:
    return case.batch * case.hq * max(case.sq, 1) * max(case.sk, 1)


def _cached(maxsize: int, *, precision: bool = True, large: bool = False):
    """An LRU cache keyed on the case without what the result does not read: the block sizes (no
    bound depends on a tiling), and for the float64 truth and its parts the precision too. So every
    kernel and tiling of one problem in a process shares one truth. ``large``: the results are
    O(Sq Sk), and the cache also holds at most HELD_SCORES score entries of cases."""
    drop = {"block_q": 16, "block_k": 16} | ({} if precision else {"precision": "fused"})

    def wrap(fn):
        held: collections.OrderedDict = collections.OrderedDict()  # least recently used first
        lock = threading.Lock()

        @functools.wraps(fn)
        def keyed(case, *args):
            key = (case.replace(**drop),) + args
            with lock:
                if key in held:
                    held.move_to_end(key)
                    return held[key]
            value = fn(*key)
            with lock:
                held[key] = value
                weight = sum(_weight(k[0]) for k in held) if large else 0
                while len(held) > 1 and (len(held) > maxsize or weight > HELD_SCORES):
                    (oldest, *_), _ = held.popitem(last=False)
                    weight -= _weight(oldest) if large else 0
            return value

        keyed.cache_clear = held.clear
        return keyed

    return wrap


def _group(case, x):
    """(B, Hq, ...) -> (B, Hkv, G, ...), the layout in which kv heads broadcast."""
    return x.reshape((case.batch, case.hkv, case.hq // case.hkv) + x.shape[2:])


@_cached(32, precision=False, large=True)
def _probs(case: AttentionCase):
    """The reference's softmax probabilities, computed once for the parts and the truth."""
    q, k, v, _ = case.inputs()
    return reference.dense_probs(q, k, v, who="oracle", **case.reference_kwargs())


@_cached(32, precision=False, large=True)
def _parts(case: AttentionCase) -> _Parts:
    _, _, _, do = case.inputs()
    p, lse, (qg, kg, vg, sc, _), extra = _probs(case)
    s = np.where(case.visible_grouped(), extra["s"], 0.0)  # softcapped, ALiBi-biased logits where visible
    return _Parts(qg, kg, vg, _group(case, do), s, p, p @ vg, lse, sc, extra["psink"], extra["added"])


@_cached(32, precision=False, large=True)
def _dscores(case: AttentionCase):
    """(dP, dP - D, dS = P (dP - D)) in float64, grouped as _parts: the bounds and the bias check share them."""
    pt = _parts(case)
    dp = pt.do @ _swap(pt.v)
    dp_minus_d = dp - (pt.do * pt.o).sum(-1, keepdims=True)
    return dp, dp_minus_d, pt.p * dp_minus_d


@_cached(256, precision=False)  # small: O(S D) per case
def truth(case: AttentionCase) -> Truth:
    """Dense float64 attention and its analytic gradients on the case's inputs."""
    q, k, v, do = case.inputs()
    kw = case.reference_kwargs()
    o, lse = reference.dense_forward(q, k, v, probs=_probs(case), **kw)

    def grads():
        return gradients(case, *reference.dense_backward(q, k, v, o, lse, do, probs=_probs(case), **kw))

    return Truth(o, lse, float(np.abs(_parts(case).s).max(initial=0)), grads)


def gradients(case: AttentionCase, dq, dk, dv, *rest) -> dict:
    """reference.dense_backward's answer by name (dsinks and dbias where the case has them)."""
    return {"dq": dq, "dk": dk, "dv": dv, "dsinks": rest[0] if case.sinks is not None else None,
            "dbias": rest[-1] if case.bias is not None else None}


@_cached(32)
def model(case: AttentionCase) -> dict:
    """What a correct fused kernel of the case's dtype and precision returns (rounding.py)."""
    q, k, v, do = case.inputs()
    return fused(q, k, v, do, case.visible_grouped(), _parts(case).scale, Precision.of(case.dtype, case.precision))


def _dense_torch(case: AttentionCase, dtype: str, inputs=None) -> dict:
    """Plain dense attention and its autograd gradients, computed in ``dtype`` by PyTorch on CPU;
    ``inputs``: (q, k, v, dO) as float64 arrays, where not the case's own."""
    import torch

    dt = getattr(torch, dtype)
    q, k, v, do = (torch.from_numpy(x).to(dt).requires_grad_() for x in (inputs or case.inputs()))
    g = case.hq // case.hkv
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ kk.transpose(-1, -2)) * case.effective_scale
    if case.softcap:
        s = case.softcap * torch.tanh(s / case.softcap)
    if case.alibi is not None:
        slopes = torch.from_numpy(case.alibi_slopes()).to(dt)
        dist = (torch.arange(case.sq)[:, None] + case.sk - case.sq - torch.arange(case.sk)[None, :]).abs().to(dt)
        s = s - slopes.reshape(-1 if slopes.ndim == 2 else 1, case.hq, 1, 1) * dist
    bias = None
    if case.bias is not None:  # in t, as its values are; its gradient by autograd
        bias = torch.from_numpy(case.attn_bias()).to(dt).requires_grad_()
        s = s + torch.where(torch.isinf(bias), torch.zeros_like(bias), bias)
    s = s.masked_fill(~torch.from_numpy(case.visible()), float("-inf"))
    sink = None
    if case.sinks is not None:  # the sink: one more logit per head in every row, with no value
        sink = torch.from_numpy(case.sink_logits()).to(dt).requires_grad_()
        s = torch.cat([s, sink.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key: softmax of all -inf
    o = p[..., :case.sk] @ vv
    lse = torch.logsumexp(s, dim=-1)
    o.backward(do.detach())
    grads = (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)) + ((("dsinks", sink.grad),) if sink is not None else ()) \
        + ((("dbias", bias.grad),) if bias is not None else ())
    return {n: t.detach().to(torch.float64).numpy() for n, t in (("o", o), ("lse", lse)) + grads}


def result_dtype(dtype: str, name: str) -> str:
    """O and the gradients come back in the input dtype; LSE in float32 at least, as in
    FlashAttention and SDPA, because an LSE overflows float16 long before the logits do. The sink
    logits are passed as float32 whatever the inputs (the feature contract), so their gradient is
    float32 for float64 inputs too."""
    if name == "lse" and dtype in HALF:
        return "float32"
    if name == "dbias" and dtype in HALF:  # the bias is passed as float32 for fp16/bf16 inputs
        return "float32"
    return "float32" if name == "dsinks" and dtype == "float64" else dtype


def half_spacing(x: np.ndarray, dtype: str) -> np.ndarray:
    """Half the gap between neighbouring ``dtype`` values at |x| (subnormals included)."""
    x = np.abs(np.where(np.isfinite(quantize(x, dtype)), x, 0))  # nothing to add where t overflows
    if dtype == "bfloat16":  # bfloat16 keeps float32's exponent range with 8 bits of mantissa
        return 0.5 * _spacing(x.astype(np.float32)).astype(np.float64) * 2.0 ** 16
    return 0.5 * _spacing(x.astype(dtype)).astype(np.float64)


def _spacing(x):
    """np.spacing of |x|, and at the largest finite value (an LSE of a row of finfo.min biases) the gap below it."""
    with np.errstate(over="ignore"):
        gap = np.spacing(x)
    return np.where(np.isinf(gap), x - np.nextafter(x, np.zeros_like(x)), gap)


def _swap(x):
    return np.swapaxes(x, -1, -2)


@_cached(32, large=True)
def _rounding_bounds(case: AttentionCase) -> dict:
    """The rounding terms of the rule (module doc, bounds.py), per entry, for every result."""
    with np.errstate(over="ignore"):  # squares of heavy-tailed float32 terms: an infinite variance is honest
        return bounds.rounding_bounds(case, _parts(case), lambda: _dscores(case), half_spacing)


@_cached(32)
def _naive_allowed(case: AttentionCase) -> dict:
    """The rule for precision="naive": k x the error of plain dense attention in t, plus a floor of
    8 (eps(acc)(1 + L) + eps(t)) M, where M is the size of the sum in absolute values."""
    return naive_terms(case, truth(case), _parts(case))


def naive_terms(case: AttentionCase, t: Truth, pt: _Parts, inputs=None) -> dict:
    """_naive_allowed's terms from the truth and parts given: those of ``inputs`` (q, k, v, dO as
    float64 arrays) where given, a whole head read back from a device (sampled.py)."""
    plain = _dense_torch(case, case.dtype, inputs)
    broken = [n for n in plain if (np.isfinite(t[n]) & ~np.isfinite(plain[n])).any()]
    if broken:  # plain dense overflows in t: float32 rounded to t stands in as the yardstick
        wide = _dense_torch(case, "float32", inputs)
        plain.update({n: quantize(wide[n], result_dtype(case.dtype, n)) for n in broken})
    p, ado, sc = pt.p, np.abs(pt.do), abs(pt.scale)
    abs_ds = p * (ado @ _swap(np.abs(pt.v)) + np.abs((pt.do * pt.o).sum(-1))[..., None])
    mag = {"o": (p @ np.abs(pt.v)).max(initial=0), "lse": np.abs(t.lse[np.isfinite(t.lse)]).max(initial=0) + 1,
           "dv": (_swap(p) @ ado).sum(2).max(initial=0), "dq": sc * (abs_ds @ np.abs(pt.k)).max(initial=0),
           "dk": sc * (_swap(abs_ds) @ np.abs(pt.q)).sum(2).max(initial=0)}
    if pt.psink is not None:  # dsinks_h = -sum over batch and rows of P_sink * rowsum(dO * O)
        mag["dsinks"] = (pt.psink * (ado * np.abs(pt.o)).sum(-1)).sum(axis=(0, 3)).max(initial=0)
    if case.bias is not None:  # dbias = dS, summed over the dimensions the bias is broadcast along
        full = abs_ds.reshape(case.batch, case.hq, case.sq, case.sk)
        shape = case.attn_bias().shape
        mag["dbias"] = full.sum(axis=tuple(i for i in (0, 1) if shape[i] == 1), keepdims=True).max(initial=0)
    errs = {n: 0.0 if case.dtype == "float64" else max_error(plain[n], t[n], result_dtype(case.dtype, n)) for n in mag}
    return naive_from(case, errs, t.logit_max, mag)


def naive_from(case: AttentionCase, dense_err: dict, logit_max: float, mag: dict) -> dict:
    """The naive rule's term per result: K x plain dense attention's largest error in t, plus the floor
    from the largest logit and the result's magnitude M (yardstick.py computes its inputs on a device)."""
    out = {}
    for n in mag:
        # dsinks of float64 inputs is float32, summed over batch and rows (per sequence, per split...)
        wide = result_dtype(case.dtype, n) == "float64"
        acc = EPS["float64" if wide else "float32"]
        out[n] = K_NAIVE[n] * dense_err[n] + FLOOR_NAIVE * (acc * (1 + logit_max) + EPS[result_dtype(case.dtype, n)]) \
            * mag[n] + (0.0 if wide else flushed(case, mag[n]))
    return out


def flushed(case: AttentionCase, mag) -> float:
    """What float32 arithmetic that flushes subnormals to zero (a GPU's, Triton's) may lose from a sum of
    magnitude ``mag``: each of its products and partial sums below 2^-126 may become 0, so at most one
    FTZ unit per term, and never more than the whole sum. Only results that lie among float32's subnormals
    feel it (on an H200, a bf16 kernel's dsinks of -7.3e-40 came back -0)."""
    terms = case.batch * case.hq * max(case.sq, 1) * (max(case.sk, 1) + 1)
    return float(np.minimum(mag, terms * bounds.FTZ["float32"]))


@_cached(64)  # compare, the bias check and the report all ask: computed once
def allowed(case: AttentionCase, name: str) -> np.ndarray:
    """The allowed error per entry of result ``name``."""
    t = truth(case)
    if name not in RESULTS:  # the sinks' gradient: the naive rule
        before = _naive_allowed(case)[name]
    elif case.precision == "naive":  # a naive kernel has the fused one's roundings too (subnormals included)
        before = _naive_allowed(case)[name] + _rounding_bounds(case)[name]
    else:  # dropout scales the kept probabilities, and their rounding, by 1 / (1 - p)
        before = _rounding_bounds(case)[name] / (1 - case.dropout_p)
    return with_output_rounding(case, name, t[name], before)


def with_output_rounding(case: AttentionCase, name: str, t: np.ndarray, before: np.ndarray) -> np.ndarray:
    """``before`` (the allowed error of result ``name`` before it is rounded to its dtype) plus half an
    ulp to round it, and the floor, at the largest value the kernel may hold before it rounds: a truth
    ``t`` just under a power of two may round from just above it, where the gap is twice as wide
    (sdpa-cudnn and plain bf16 attention, dV = -0.12487 returned as -0.12598: 1.03x of the bound taken
    at the truth; tests/test_rounding_sites.py pins it)."""
    with np.errstate(over="ignore", invalid="ignore"):
        reach = np.abs(np.asarray(t, np.float64)) + before
    return before + half_spacing(reach, result_dtype(case.dtype, name)) * (1 + 2 * ULP_FLOOR)


def model_error(case: AttentionCase, name: str) -> float | None:
    """The rounding model's own largest error for result ``name``, for a failure's message; None where
    the rule stands without it (naive kernels, features, the sinks' gradient). Only a failure asks:
    emulating the fused kernel costs about as much as the float64 truth."""
    if name not in RESULTS or case.precision == "naive" or case.features:
        return None
    # -inf - -inf: an LSE of a row that sees no key, matched exactly; and the emulated kernel overflows
    # where a kernel of its dtype would (its matmuls' flags then say nothing: bounds.quiet)
    with np.errstate(over="ignore", invalid="ignore"):
        err = np.nan_to_num(np.abs(model(case)[name] - truth(case)[name]), nan=0.0, posinf=0.0)
    return float(err.max(initial=0.0))


TRUTH = "the float64 truth"


def max_error(got, want, dtype):
    """Largest error over the entries whose truth the dtype can hold (others must overflow)."""
    held = np.isfinite(quantize(want, dtype)) & np.isfinite(got)
    with np.errstate(invalid="ignore"):
        err = np.where(held, np.abs(got - want), 0.0)
    return float(err.max(initial=0.0))


@dataclass
class Entries:
    """Entry by entry, one result against what it is held to (the truth, or another run's result)."""

    name: str
    want: np.ndarray
    got: np.ndarray
    err: np.ndarray
    limit: np.ndarray
    nonfinite: np.ndarray  # finite where the truth is held, or the wrong infinity
    wrong: np.ndarray  # nonfinite, or off by more than the limit
    against: str = TRUTH


def entries(case: AttentionCase, name: str, got: np.ndarray, want: np.ndarray | None = None,
            budget=None) -> Entries:
    """``got`` against the truth (or ``want``) for result ``name``, each entry under its bound (or
    ``budget``). A truth beyond the dtype's range must come back as the infinity it rounds to (an
    LSE of -inf for a row that sees no key, an fp16 gradient past 65504); the rest finite."""
    against = TRUTH if want is None else "the result it is compared with"
    want = truth(case)[name] if want is None else want
    limit = np.broadcast_to(allowed(case, name) if budget is None else budget, want.shape)
    stored = quantize(want, result_dtype(case.dtype, name))
    with np.errstate(invalid="ignore"):
        err = np.where(np.isinf(stored), 0.0, np.abs(got - want))
        nonfinite = (np.isfinite(stored) & ~np.isfinite(got)) | (np.isinf(stored) & (got != stored))
        wrong = nonfinite | (np.isfinite(stored) & ~(err <= limit))
    return Entries(name, want, got, err, limit, nonfinite, wrong, against)


def compare(case: AttentionCase, name: str, got: np.ndarray, want: np.ndarray | None = None,
            budget=None, who: str = "") -> None:
    """Assert ``got`` matches the truth (or ``want``) for result ``name`` under the rule; a failure
    raises a Mismatch that carries the entries, for the report.

    ``budget`` (a number or an array of the result's shape) replaces the allowed error, for
    comparisons between two runs of one kernel.
    """
    against_truth = want is None
    source = "the float64 reference itself" if want is None else "the implementation's own result it is compared with"
    expected = truth(case)[name] if want is None else want
    label = f"{who} {name}".strip()
    if got.shape != expected.shape:
        raise AssertionError(f"{label}: expected shape {expected.shape}, got {got.shape}\n  case: {case!r}")
    if np.isnan(expected).any():
        raise AssertionError(f"{label}: {source} holds NaN at "
                             f"{tuple(int(i) for i in np.argwhere(np.isnan(expected))[0])}\n  case: {case!r}")
    e = entries(case, name, got, want, budget)
    tail = f"  case: {case!r}"
    if e.nonfinite.any():
        idx = tuple(int(i) for i in np.argwhere(e.nonfinite)[0])
        stored = quantize(e.want, result_dtype(case.dtype, name))
        raise Mismatch(f"{label}: non-finite mismatch at {idx}: expected {stored[idx]!r}, got {got[idx]!r} "
                       f"({int(e.nonfinite.sum())} such entries)\n", lambda: "", tail, case=case, entries=e)
    if e.wrong.any():
        err, limit = e.err, e.limit
        with np.errstate(over="ignore"):  # an error far past a bound near zero is an infinite ratio
            idx = tuple(int(i) for i in np.unravel_index(np.argmax(err / np.maximum(limit, 1e-300)), err.shape))
        rel = float(err[idx]) / max(abs(float(e.want[idx])), 1e-300)  # Python floats: inf, not a warning
        model_err = model_error(case, name)
        own = "" if model_err is None else f" (its own largest error {model_err:.3e})"
        head = (f"{label}: {int(e.wrong.sum())} of {err.size} entries off by more than allowed; worst at {idx}: "
                f"expected {float(e.want[idx])!r}, got {float(got[idx])!r}, error {err[idx]:.3e} (relative "
                f"{rel:.2e}) > allowed {limit[idx]:.3e} ({float(err[idx]) / max(float(limit[idx]), 1e-300):.3g}x)\n"
                f"  rule: {case.precision} {case.dtype} rounding model{own}\n")
        hint = (lambda: explain(case, name, got, err)) if against_truth and budget is None else (lambda: "")
        raise Mismatch(head, hint, tail, case=case, entries=e)
    if against_truth and budget is None:
        check_bias(case, name, got, expected, label)


class Mismatch(AssertionError):
    """A result off by more than allowed, with the case and the entries it was judged on, which the
    report reads. The lines that explain the error in terms of rounding (``explain``) cost a few
    more bounds; they are computed when the message is read, so the many failing examples
    Hypothesis tries while it shrinks do not pay for them."""

    def __init__(self, head: str, hint, tail: str, *, case: AttentionCase, entries: Entries):
        super().__init__(head + tail)
        self.case, self.entries = case, entries
        self._parts, self._hint, self._text = (head, tail), hint, None

    def __str__(self):
        if self._text is None:
            try:
                hint = self._hint()
            except Exception as exc:  # the explanation is a courtesy: it never hides the failure
                hint = f"  (no rounding explanation: {type(exc).__name__}: {exc})\n"
            self._text = self._parts[0] + hint + self._parts[1]
        return self._text

    def __reduce__(self):  # to another process (xdist) as the plain assertion it reads as
        return AssertionError, (str(self),)


def explain(case: AttentionCase, name: str, got: np.ndarray, err: np.ndarray) -> str:
    """Lines for a failure report: how the error compares with plain dense attention in the case's
    dtype, and which declared precision (a rounding site, flashcheck/oracle/rounding.py) would admit it."""
    if name not in RESULTS or case.dtype == "float64":
        return ""
    lines = []
    t = result_dtype(case.dtype, name)
    plain = max_error(_dense_torch(case, case.dtype)[name], truth(case)[name], t)
    worst = float(np.nanmax(err, initial=0.0))
    if plain > 0:
        where = "within" if worst <= plain else "beyond"
        lines.append(f"  the largest error is {worst / plain:.3g}x plain dense {case.dtype} attention's "
                     f"({plain:.3e}): {where} what attention computed in {case.dtype} makes")
    have = set(case.precision.split("+")) - {"fused"}
    looser = [p for p in PRECISIONS if p not in ("fused", "naive", case.precision) and have <= set(p.split("+"))
              and ("tf32" not in p or case.dtype == "float32")]  # TF32 concerns float32 inputs alone
    admits = [p for p in looser + ([] if case.precision == "naive" else ["naive"])
              if (err <= allowed(case.replace(precision=p), name)).all()]
    fewest = [p for p in admits if p.count("+") == min(a.count("+") for a in admits)]
    fewest = [p for p in fewest if p != "naive"] or fewest
    if fewest:
        lines.append("  it is within the rule of " + " and of ".join(
            f"precision={p!r} ({'; '.join(DECLARES[s] for s in p.split('+'))})" for p in fewest)
            + ": a kernel that rounds there says so in @implementation(precision=...)")
    return "".join(line + "\n" for line in lines)


def bias(case: AttentionCase, name: str, got: np.ndarray, want: np.ndarray):
    """(statistic, mean) of the signed error and of the error towards larger magnitude, each entry's
    error in units of its own allowed error; None where too few groups (rows of O and dQ, keys of
    dK and dV) hold an entry whose truth stands well clear of its rounding noise.

    Only such entries count: a truth that cancels to near zero (dQ of identical keys is 1e-14
    where its terms are 1e-2) has no reliable sign, and its error is all noise.
    """
    t = result_dtype(case.dtype, name)
    tol = np.broadcast_to(allowed(case, name), want.shape)
    ok = np.isfinite(got) & np.isfinite(quantize(want, t)) & (np.abs(want) > BIAS_CLEAR * tol)
    with np.errstate(invalid="ignore"):
        err = np.where(ok, (got - want) / tol, 0.0)
    # Groups whose truths round to the same values (uniform attention: every key's dV alike)
    # repeat one computation and its rounding: they count once.
    _, first = np.unique(quantize(want, t).reshape(-1, want.shape[-1]), axis=0, return_index=True)
    keep = np.zeros(err.size // want.shape[-1], bool)
    keep[first] = True
    keep &= ok.reshape(-1, want.shape[-1]).any(-1)
    n = ok.reshape(-1, want.shape[-1])[keep].sum()
    if keep.sum() < BIAS_MIN_GROUPS:
        return None
    out = {}
    for kind, sign in (("signed", 1.0), ("magnitude", np.sign(want))):
        r = (err * sign).reshape(-1, want.shape[-1]).sum(-1)[keep]  # one independent sum per group
        spread = np.sqrt((r * r).sum())
        out[kind] = (r.sum() / spread if spread > 0 else 0.0, r.sum() / n)
    return out


@_cached(16)
def _scaled_ds_subnormal(case) -> bool:
    """Does scale * dS mostly sit among float16's subnormals? A kernel that rounds dS after the
    scale then rounds most of it towards zero: a bias a correct kernel has (H200, scale 1e-6)."""
    if case.dtype != "float16":
        return False
    pt = _parts(case)
    ds = np.abs(pt.scale * _dscores(case)[2])[pt.p > 0]  # p is 0 where masked
    return ds.size > 0 and float(np.median(ds)) < 2.0 ** -14


@_cached(64)
def _own_bias(case, name):
    """The rounding model's own bias against the truth (what a correct kernel may carry)."""
    return bias(case, name, model(case)[name], truth(case)[name])


def check_bias(case, name, got, want, label=""):
    if case.dtype not in HALF or name not in ("o", "dq", "dk", "dv") or case.precision == "naive" or case.features:
        return
    seen = bias(case, name, got, want)
    if seen is None:
        return
    # A correct kernel may carry the rounding model's own bias too: emulated (as costly as the truth)
    # only for a statistic past the limit without it, which that can only raise.
    if not any(abs(stat) > BIAS_Z and abs(mean) > BIAS_SHARE for stat, mean in seen.values()):
        return
    if name in ("dq", "dk") and _scaled_ds_subnormal(case):  # a pass over every dS: asked last
        return
    own = _own_bias(case, name) or {kind: (0.0, 0.0) for kind in seen}
    for kind, (stat, mean) in seen.items():
        limit = BIAS_SHARE + abs(own[kind][1])
        if abs(stat) > BIAS_Z and abs(mean) > limit:
            raise AssertionError(
                f"{label}: biased rounding: the {kind} error averages {mean:+.2f} of the allowed error per "
                f"entry (significance {stat:+.1f}; a correct kernel stays within {limit:.2f}, its sign "
                f"statistic within {BIAS_Z:g})\n  case: {case!r}")


def dense64(case: AttentionCase, q, k, v) -> np.ndarray:
    """Dense float64 output for the case's settings on other inputs (e.g. transformed ones)."""
    return reference.dense_forward(q, k, v, **case.reference_kwargs())[0]
