"""The project's teaching programs (../shared/seeds) run through the suite as plug-ins.

    pytest -m properties --impl examples/seeds_as_plugins.py:algorithm1 \
                         --impl examples/seeds_as_plugins.py:lab_tiled \
                         --impl examples/seeds_as_plugins.py:torch_teaching

The seeds are imported from FLASHCHECK_SEEDS (default ../shared/seeds beside the
checkout), never copied. Each wrapper only adapts layout: the seeds work on one
(sequence, dim) matrix, so the wrapper loops over batch and heads, maps GQA heads, and
folds a custom scale into q where the seed hard-codes 1/sqrt(D) (or no scale at all).
Their declarations state what each seed supports, so what fails is a real finding.
"""
import importlib.util
import math
import os
from pathlib import Path

import numpy as np

from impls import implementation

SEEDS = Path(os.environ.get("FLASHCHECK_SEEDS", Path(__file__).resolve().parents[2] / "shared" / "seeds"))


def _seed(name):
    path = SEEDS / f"{name}.py"
    if not path.is_file():
        raise ImportError(f"seed {path} not found; set FLASHCHECK_SEEDS to the seeds folder")
    spec = importlib.util.spec_from_file_location(f"seed_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _per_head(q, k, v, fn):
    """Apply fn(q2d, k2d, v2d) -> (o2d, lse1d or None) to every (batch, query head)."""
    group = q.shape[1] // k.shape[1]
    o = np.zeros(q.shape[:3] + v.shape[-1:], q.dtype)
    lse = np.zeros(q.shape[:3], q.dtype)
    for b, h in np.ndindex(q.shape[:2]):
        out = fn(q[b, h], k[b, h // group], v[b, h // group])
        o[b, h], lse[b, h] = (out if isinstance(out, tuple) else (out, 0))
    return o, lse


def _scaled(q, scale, native):
    """Fold the wanted scale into q for a seed that applies ``native`` itself."""
    return q if scale is None and native is None else q * ((1 / math.sqrt(q.shape[-1]) if scale is None else scale)
                                                           / (native or 1.0))


@implementation(name="seed-algorithm1", causal=None, dtypes=("float64",), framework="numpy", gqa=True,
                blocks="any", equal_lengths=True, equal_head_dims=True)  # it sizes everything from Q: N x d
def algorithm1(q, k, v, *, causal=False, scale=None, block_q=16, block_k=16):
    seed = _seed("numpy_algorithm1")  # applies no scale at all: fold the whole scale into q
    qs = q * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return _per_head(qs, k, v, lambda a, b, c: seed.flash_attention_tier1(a, b, c, Br=block_q, Bc=block_k))[0]


def _lab_backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_q=16, block_k=16):
    seed = _seed("numpy_fwd_bwd_lab")
    native = 1 / math.sqrt(q.shape[-1])
    factor = (native if scale is None else scale) / native
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b, h in np.ndindex(q.shape[:2]):
        g = seed.backward(q[b, h] * factor, k[b, h // group], v[b, h // group], o[b, h], lse[b, h], do[b, h],
                          block_k, causal=bool(causal))
        dq[b, h] += g[0] * factor
        dk[b, h // group] += g[1]
        dv[b, h // group] += g[2]
    return dq, dk, dv


@implementation(name="seed-lab-tiled", causal="top_left", dtypes=("float64",), framework="numpy", gqa=True,
                lse=True, backward=_lab_backward, blocks="any")
def lab_tiled(q, k, v, *, causal=False, scale=None, block_q=16, block_k=16):
    seed = _seed("numpy_fwd_bwd_lab")  # scale hard-coded to 1/sqrt(D): fold the ratio into q
    native = 1 / math.sqrt(q.shape[-1])
    qs = q * ((native if scale is None else scale) / native)
    return _per_head(qs, k, v, lambda a, b, c: seed.tiled(a, b, c, block_k, causal=bool(causal)))


@implementation(name="seed-torch-teaching", causal=None, dtypes=("float32", "float64"), devices=("cpu",),
                backward=True, gqa=False, lse=False, blocks="any", equal_head_dims=True)  # acc sized like q
def torch_teaching(q, k, v, *, causal=False, scale=None, block_q=16, block_k=16):
    seed = _seed("torch_tiled_teaching")  # (batch, seq, dim), 1/sqrt(D) built in
    native = 1 / math.sqrt(q.shape[-1])
    b, h, sq, d = q.shape
    qs = q * ((native if scale is None else scale) / native)
    out = seed.TiledAttention(block=block_q)(qs.reshape(b * h, sq, d), k.reshape(b * h, -1, d),
                                              v.reshape(b * h, k.shape[2], -1))
    return out.reshape(b, h, sq, -1)
