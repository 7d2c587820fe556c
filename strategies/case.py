"""AttentionCase: one drawn problem, small enough to read and exact enough to replay.

A case holds only plain fields; its tensors are derived from them (``case.inputs()``),
so the repr Hypothesis prints is the whole reproducer: paste it back and the same
bits come out.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, fields, replace

import numpy as np

from flashcheck.oracle.rounding import PRECISIONS
from flashcheck.strategies import feature_table

REGIMES = ("plain", "large", "negative", "equal", "dominant", "ties", "heavy")
ALIGNMENTS = (None, "bottom_right", "top_left")

# log of the largest finite value: exp() of a logit above this overflows without max subtraction
OVERFLOW_LOG = {"float64": 709.78, "float32": 88.72, "bfloat16": 88.72, "float16": 11.09}
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
MAX_INPUT = {"float64": 1e150, "float32": 1e30, "bfloat16": 1e30, "float16": 3e4}
# The features' "off" values: a case prints only the features it turns on, so cases without
# them print (and replay) exactly as before the features existed.
FEATURES_OFF = feature_table.OFF
# A printed case, as failure messages hold it (its fields may hold tuples of tuples).
CASE_PATTERN = re.compile(r"AttentionCase\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)")


def _literal(x) -> str:
    """repr, except that an infinite float prints as 1e999 (which Python reads back as inf)."""
    if isinstance(x, tuple):
        return "(" + ", ".join(_literal(e) for e in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, float) and math.isinf(x):
        return "-1e999" if x < 0 else "1e999"
    return repr(x)


def visible(sq: int, sk: int, align: str | None, rows=None, cols=None, window=None) -> np.ndarray:
    """Boolean (rows x cols) mask of which keys each query sees: the causal mask AND the window
    (docs/design.md), for the given query ``rows`` and key ``cols`` (every one by default).

    The window is bottom-right aligned like FlashAttention's: query i sees key j iff
    i + Sk - Sq - left <= j <= i + Sk - Sq + right, a side of -1 being unbounded.
    """
    rows = np.arange(sq) if rows is None else rows
    cols = np.arange(sk) if cols is None else cols
    vis = np.ones((len(rows), len(cols)), dtype=bool)
    if align is not None:
        vis &= cols[None, :] <= rows[:, None] + (sk - sq if align == "bottom_right" else 0)
    if window is not None:
        left, right = window
        dist = cols[None, :] - (rows[:, None] + sk - sq)  # key position relative to the query's diagonal
        if left >= 0:
            vis &= dist >= -left
        if right >= 0:
            vis &= dist <= right
    return vis


@dataclass(frozen=True, repr=False)
class AttentionCase:
    batch: int = 1
    hq: int = 1
    hkv: int = 1
    sq: int = 1
    sk: int = 1
    d: int = 1
    dv: int = 1
    causal: str | None = None  # None, "bottom_right" or "top_left"
    scale: float | None = None  # None means 1/sqrt(d)
    dtype: str = "float64"
    block_q: int = 16
    block_k: int = 16
    regime: str = "plain"
    seed: int = 0
    precision: str = "fused"  # the rounding model it is judged by (flashcheck.oracle.rounding); fit() copies the kernel's
    # features (docs/features.md); each defaults to off
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded on that side
    softcap: float = 0.0  # 0 = off
    alibi: tuple | None = None  # slopes: Hq floats, or B tuples of Hq floats (per batch)
    sinks: tuple | None = None  # one sink logit per query head
    dropout_p: float = 0.0
    dropout_seed: int = 0
    # a boolean attn_mask (True = may attend): (kind, per_batch, per_head, param, seed), built by attn_mask()
    mask: tuple | None = None
    # an additive attn_bias: (kind, per_batch, per_head, param, seed), built by attn_bias()
    bias: tuple | None = None
    memory: str = "contiguous"  # how a torch kernel's inputs lie in memory (flashcheck/contract/memory.py)

    def __repr__(self):
        return self.code()

    def code(self, always=()) -> str:
        """The case as code: fields at their default are left out (the printed case is short, and
        still exact), except those named in ``always``."""
        shown = [f for f in fields(self) if f.name in always or getattr(self, f.name) != f.default]
        return f"AttentionCase({', '.join(f'{f.name}={_literal(getattr(self, f.name))}' for f in shown)})"

    def __post_init__(self):
        if self.hkv < 1 or self.hq % self.hkv:
            raise ValueError(f"hq ({self.hq}) must be a multiple of hkv ({self.hkv})")
        if self.causal not in ALIGNMENTS:
            raise ValueError(f"causal must be one of {ALIGNMENTS}, got {self.causal!r}")
        if self.regime not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, got {self.regime!r}")
        if self.dtype not in EPS:
            raise ValueError(f"dtype must be one of {tuple(EPS)}, got {self.dtype!r}")
        from flashcheck.contract.memory import MEMORY

        if self.memory not in MEMORY:
            raise ValueError(f"memory must be one of {tuple(MEMORY)}, got {self.memory!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        for feature in feature_table.FEATURES:
            wrong = feature.invalid(self)
            if wrong:
                raise ValueError(wrong)

    def replace(self, **changes) -> "AttentionCase":
        return replace(self, **changes)

    @property
    def effective_scale(self) -> float:
        return 1.0 / math.sqrt(self.d) if self.scale is None else self.scale

    def reference_kwargs(self) -> dict:
        """The keyword arguments the dense reference (flashcheck.oracle.reference) takes for this case's semantics.

        Dropout is not among them: its mask is the implementation's (see properties/test_dropout.py).
        """
        kw = dict(causal=self.causal or False, scale=self.scale)
        for feature in feature_table.FEATURES:
            if feature.on(self):
                kw.update(feature.reference(self))
        return kw

    def alibi_slopes(self) -> np.ndarray | None:
        """float32 (Hq,) or (B, Hq), as passed to an implementation."""
        return None if self.alibi is None else np.array(self.alibi, dtype=np.float32)

    def sink_logits(self) -> np.ndarray | None:
        """float32 (Hq,), as passed to an implementation."""
        return None if self.sinks is None else np.array(self.sinks, dtype=np.float32)

    @property
    def features(self) -> tuple[str, ...]:
        """The features this case turns on, by their declaration names."""
        return tuple(f.name for f in feature_table.FEATURES if f.on(self))

    @property
    def offset(self) -> int:
        return self.sk - self.sq if self.causal == "bottom_right" else 0

    def attn_mask(self) -> np.ndarray | None:
        """The mask tensor passed as ``attn_mask``: bool (B or 1, Hq or 1, Sq, Sk), True = may attend."""
        return None if self.mask is None else mask_array(self.mask, self.batch, self.hq, self.sq, self.sk)

    def attn_bias(self) -> np.ndarray | None:
        """The bias tensor (float64 values exact in the case's dtype), or None."""
        return None if self.bias is None else bias_array(self.bias, self.batch, self.hq, self.sq, self.sk, self.dtype)

    def bias_argument(self) -> np.ndarray | None:
        """``attn_bias`` as passed to a kernel: float32 for fp16/bf16 inputs (its values exact in the
        input type, so a cast to it loses nothing), else the input dtype."""
        b = self.attn_bias()
        return None if b is None else b.astype(np.float64 if self.dtype == "float64" else np.float32)

    def visible(self, rows=None) -> np.ndarray:
        """Which keys each query row sees: the causal mask, the window, the attn_mask and the bias's
        -inf entries. (Sq, Sk) without a mask or bias tensor, else (B, Hq, Sq, Sk); only the query
        ``rows`` given (an index array), if any."""
        vis = visible(self.sq, self.sk, self.causal, rows=rows, window=self.window)
        if self.mask is None and self.bias is None:
            return vis
        some = slice(None) if rows is None else rows
        if self.mask is not None:
            vis = vis & self.attn_mask()[:, :, some]
        if self.bias is not None:
            vis = vis & (self.attn_bias()[:, :, some] > -np.inf)
        return np.broadcast_to(vis, (self.batch, self.hq) + vis.shape[-2:]).copy()

    def visible_grouped(self, rows=None) -> np.ndarray:
        """visible() in the grouped layout (B, Hkv, G, Sq, Sk) where it is per batch and head."""
        vis = self.visible(rows)
        return vis if vis.ndim == 2 else vis.reshape((self.batch, self.hkv, self.hq // self.hkv) + vis.shape[-2:])

    @property
    def has_masked_rows(self) -> bool:
        return self.causal == "bottom_right" and self.sq > self.sk

    @property
    def has_masked_keys(self) -> bool:
        return self.causal == "top_left" and self.sk > self.sq

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """q, k, v, dO as float64 arrays whose values are exactly representable in self.dtype."""
        return tuple(x.copy() for x in _inputs(self))


MASK_KINDS = ("random", "band", "rows", "causal")


def mask_array(mask: tuple, batch: int, hq: int, sq: int, sk: int) -> np.ndarray:
    """A mask tensor from its description (kind, per_batch, per_head, param, seed):

    - "random": each entry True with probability ``param`` (1 is all True, 0 all False);
    - "band": key j seen from row i iff |j - i - (Sk - Sq) - shift| <= ``param``, the shift drawn
      per batch and head entry (within +-param) where the mask is not broadcast over them;
    - "rows": half the entries True, and rows emptied with probability ``param`` (rows that see no key);
    - "causal": the causal mask, top-left (``param`` 0) or bottom-right (1), as a tensor.
    """
    kind, per_batch, per_head, param, seed = mask
    rng = np.random.default_rng(seed)
    shape = (batch if per_batch else 1, hq if per_head else 1, sq, sk)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    if kind == "random":
        return rng.random(shape) < param
    if kind == "band":
        width = int(param)
        shift = rng.integers(-width, width + 1, shape[:2])[..., None, None] if shape[:2] != (1, 1) else 0
        return np.broadcast_to(np.abs(j - i - (sk - sq) - shift) <= width, shape).copy()
    if kind == "rows":
        out = rng.random(shape) < 0.5
        out[rng.random(shape[:3]) < param] = False
        return out
    return np.broadcast_to(j <= i + (sk - sq if param else 0), shape).copy()


BIAS_KINDS = ("normal", "ninf", "min")


def bias_array(bias: tuple, batch: int, hq: int, sq: int, sk: int, dtype: str) -> np.ndarray:
    """A bias tensor from its description (kind, per_batch, per_head, param, seed), its values exact
    in ``dtype``: "normal" draws N(0, param^2) entries; "ninf" and "min" draw N(0, 1) and set a
    fraction ``param`` of the entries to -inf or to finfo(dtype).min (as code that "masks" with the
    most negative number does: a row of finfo.min alone is uniform, not empty)."""
    kind, per_batch, per_head, param, seed = bias
    rng = np.random.default_rng(seed)
    shape = (batch if per_batch else 1, hq if per_head else 1, sq, sk)
    out = quantize(rng.standard_normal(shape) * (param if kind == "normal" else 1.0), dtype)
    if kind != "normal":
        low = -np.inf if kind == "ninf" else float(_finfo_min(dtype))
        out[rng.random(shape) < param] = low
    return out


def _finfo_min(dtype: str) -> float:
    """finfo(t).min; for float64 float32's (code ported from float32 masks with it), since the error
    bounds of scores at 1.8e308 overflow float64 itself."""
    return -3.3895313892515355e38 if dtype == "bfloat16" else float(np.finfo("float32" if dtype == "float64" else dtype).min)


def quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to the nearest ``dtype`` value, returned as float64."""
    if dtype == "float64":
        return x.astype(np.float64)
    if dtype in ("float32", "float16"):
        with np.errstate(over="ignore"):  # beyond the range rounds to inf, as the hardware does
            return x.astype(dtype).astype(np.float64)
    # bfloat16 = the top 16 bits of a float32, rounded to nearest even
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _logits(case, q, k):
    g = case.hq // case.hkv
    kk = np.repeat(k, g, axis=1)
    return case.effective_scale * (q @ np.swapaxes(kk, -1, -2))


def _unit(rng, d):
    u = rng.standard_normal(d)
    return u / np.linalg.norm(u)


@functools.lru_cache(maxsize=256)
def _inputs(case: AttentionCase):
    rng = np.random.default_rng(case.seed)
    b, hq, hkv, sq, sk, d, dv = case.batch, case.hq, case.hkv, case.sq, case.sk, case.d, case.dv
    q = rng.standard_normal((b, hq, sq, d))
    k = rng.standard_normal((b, hkv, sk, d))
    v = rng.standard_normal((b, hkv, sk, dv))
    do = rng.standard_normal((b, hq, sq, dv))
    scale, cap = abs(case.effective_scale), MAX_INPUT[case.dtype]
    # Logit sizes are expressed against the dtype's overflow point, so each regime is
    # equally hostile in every precision.
    over = OVERFLOW_LOG[case.dtype]
    if case.regime == "large" and scale > 0:
        # the largest |logit| lands 1.5x past where exp() overflows without max subtraction
        peak = np.abs(_logits(case, q, k)).max()
        q *= min(1.5 * over / max(peak, 1e-300), cap / np.abs(q).max())
    elif case.regime == "negative" and scale > 0:
        # every key leans along u and every query against it, so every logit is negative;
        # q is then stretched until the largest logit of all is 2x the overflow point below
        # zero: exp() of each underflows to 0 without max subtraction
        u = _unit(rng, d)
        k = u + 0.1 * k / math.sqrt(d)
        q = -(u + 0.1 * q / math.sqrt(d))
        top = _logits(case, q, k).max()  # about -scale; positive only past a 7-sigma draw
        q *= min(2 * over / max(-top, 1e-300), cap / np.abs(q).max())
    elif case.regime == "equal":
        k = np.broadcast_to(k[:, :, :1], k.shape).copy()  # identical keys: uniform scores
    elif case.regime == "dominant" and scale > 0:
        # one key per head outscores every other key of every row by half the overflow point
        u = _unit(rng, d)
        q = 0.3 * q + 3 * u  # every query leans towards u
        star = rng.integers(sk)
        k[:, :, star] = 0
        others = np.abs(_logits(case, q, k)).max()
        lean = max((q @ u).min(), 1.0)  # q.u = 3 + 0.3 N(0, 1): below 1 needs a 6.7-sigma draw
        k[:, :, star] = min((0.5 * over + others) / (scale * lean), cap) * u
    elif case.regime == "ties":
        k = k[:, :, :1] + 1e-3 * k  # near-identical keys: scores differ in the last bits
    elif case.regime == "heavy":
        q, k, v = (np.clip(rng.standard_t(1.5, x.shape), -1e3, 1e3) for x in (q, k, v))
    return tuple(quantize(x, case.dtype) for x in (q, k, v, do))
