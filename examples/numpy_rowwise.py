"""A NumPy plug-in: one query row at a time against key blocks, with its own backward.

    pytest -m properties --impl examples/numpy_rowwise.py:attention

The forward keeps three numbers per row (running max, running sum, output) while it walks
the key blocks; the backward recomputes each block's probabilities from the saved LSE.
NumPy plug-ins declare ``framework="numpy"`` and pass their backward as a callable
``bwd(q, k, v, o, lse, do, *, causal, scale) -> (dq, dk, dv)``.
"""
import math

import numpy as np

from flashcheck import implementation
from flashcheck.contract.checks import check_inputs

BLOCK = 4


def _visible_upto(i, sq, sk, causal):
    """One past the last key row i sees (bottom-right alignment)."""
    return min(sk, i + sk - sq + 1) if causal else sk


def _backward(q, k, v, o, lse, do, *, causal=False, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    sq, sk = q.shape[2], k.shape[2]
    for b, h, i in np.ndindex(q.shape[:3]):
        stop = _visible_upto(i, sq, sk, causal)
        if stop <= 0:
            continue
        kv = h // group
        keys, values = k[b, kv, :stop], v[b, kv, :stop]
        p = np.exp(scale * (keys @ q[b, h, i]) - lse[b, h, i])
        dp = values @ do[b, h, i]
        ds = p * (dp - do[b, h, i] @ o[b, h, i])
        dq[b, h, i] = scale * ds @ keys
        dk[b, kv, :stop] += scale * np.outer(ds, q[b, h, i])
        dv[b, kv, :stop] += np.outer(p, do[b, h, i])
    return dq, dk, dv


@implementation(name="numpy-rowwise", causal="bottom_right", dtypes=("float64", "float32"), devices=("cpu",),
                backward=_backward, gqa=True, lse=True, framework="numpy")
def attention(q, k, v, *, causal=False, scale=None):
    check_inputs(q, k, v, dtypes=("float64", "float32"), who="numpy-rowwise")  # the suite's own checks
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    o = np.zeros(q.shape[:3] + v.shape[-1:], q.dtype)
    lse = np.full(q.shape[:3], -np.inf, q.dtype)
    for b, h, i in np.ndindex(q.shape[:3]):
        m, total, acc = -np.inf, 0.0, np.zeros(v.shape[-1])
        for start in range(0, _visible_upto(i, sq, sk, causal), BLOCK):
            stop = min(start + BLOCK, _visible_upto(i, sq, sk, causal))
            s = scale * (k[b, h // group, start:stop] @ q[b, h, i])
            m_new = max(m, s.max())
            fade = math.exp(m - m_new)  # earlier blocks were summed against a smaller max
            e = np.exp(s - m_new)
            total = fade * total + e.sum()
            acc = fade * acc + e @ v[b, h // group, start:stop]
            m = m_new
        if total > 0:
            o[b, h, i], lse[b, h, i] = acc / total, m + math.log(total)
    return o, lse
