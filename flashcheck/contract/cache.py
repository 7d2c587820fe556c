"""KV caches (``kvcache=True``): the layout, and how the suite calls it.

A cache holds, for each of B sequences, its keys and values so far: k_cache (B, Hkv, S_max, D),
or with ``paged=True`` k_cache (num_blocks, Hkv, page_size, D) and a block_table (B, max_blocks)
naming the physical block that holds each sequence's i-th page. cache_seqlens[b] says how many
positions of sequence b are filled. The queries q (B, Hq, Sq, D) attend to the first
cache_seqlens[b] keys, or, given k_new and v_new (B, Hkv, Sq, D), to those and the Sq new keys,
which the kernel writes into the cache at positions cache_seqlens[b] onwards, in place (as
flash_attn_with_kvcache does). Causal is bottom-right against that length.

Every position past a sequence's keys, and every block no sequence uses, holds NaN: a kernel that
reads one returns NaN. A kernel that declares isolates_nan=False (a mask that multiplies hidden
entries by 0) gets POISON there instead, large enough that reading one is still visible. A dense
case is run on such a kernel as B sequences of Sk keys each (contiguous, or on pages in reverse
order), so that every forward property reaches it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashcheck.contract import call


@dataclass(frozen=True)
class Layout:
    """Where the cache keeps each sequence: S_max slots per sequence, or pages of ``page_size``
    in the physical blocks ``table[b]`` (``blocks`` of them in all, the rest unused)."""

    s_max: int
    page_size: int | None = None
    table: tuple[tuple[int, ...], ...] | None = None
    blocks: int = 0

    @classmethod
    def contiguous(cls, need: int, spare: int = 0) -> "Layout":
        return cls(s_max=need + spare)

    @classmethod
    def paged(cls, n_seq: int, need: int, page_size: int, spare: int = 0, order_seed: int | None = None) -> "Layout":
        """Enough pages for ``need`` positions per sequence, ``spare`` unused blocks, and the blocks
        in order (order_seed None), reversed (-1), or shuffled by the seed."""
        per = max(1, -(-need // page_size))
        total = n_seq * per + spare
        ids = np.arange(total)
        if order_seed == -1:
            ids = ids[::-1]
        elif order_seed is not None:
            ids = np.random.default_rng(order_seed).permutation(total)
        table = tuple(tuple(int(x) for x in ids[b * per:(b + 1) * per]) for b in range(n_seq))
        return cls(s_max=per * page_size, page_size=page_size, table=table, blocks=total)

    def slots(self, b: int, n: int):
        """(block or sequence index, position inside it) of sequence b's first n positions."""
        t = np.arange(n)
        if self.page_size is None:
            return np.full(n, b), t
        return np.asarray(self.table[b], dtype=np.int64)[t // self.page_size], t % self.page_size


def lay_out(parts, layout: Layout, n_seq: int, heads: int, dim: int) -> np.ndarray:
    """The cache array for ``parts`` (per sequence, (Hkv, L_b, E) float64), NaN everywhere else."""
    if layout.page_size is None:
        cache = np.full((n_seq, heads, layout.s_max, dim), np.nan)
    else:
        cache = np.full((layout.blocks, heads, layout.page_size, dim), np.nan)
    for b, x in enumerate(parts):
        where, at = layout.slots(b, x.shape[1])
        cache[where, :, at] = np.swapaxes(x, 0, 1)
    return cache


def read_back(cache: np.ndarray, layout: Layout, b: int, n: int) -> np.ndarray:
    """Sequence b's first n positions, (Hkv, n, E)."""
    where, at = layout.slots(b, n)
    return np.swapaxes(cache[where, :, at], 0, 1)


@dataclass
class Call:
    """One cache call's inputs, float64 NumPy; ``k_new`` None for a call without appending."""

    q: np.ndarray  # (B, Hq, Sq, D)
    k_cache: np.ndarray
    v_cache: np.ndarray
    lengths: tuple[int, ...]  # cache_seqlens
    layout: Layout
    k_new: np.ndarray | None = None  # (B, Hkv, Sq, D)
    v_new: np.ndarray | None = None
    num_splits: int = 1


POISON = 64.0  # what isolates_nan=False kernels find in unused entries: exp(64 q.k) dwarfs any real score


def poisoned(impl, cache: np.ndarray) -> np.ndarray:
    """The cache as ``impl`` is given it: NaN in its unused entries, or POISON where it declares
    isolates_nan=False (the inputs themselves are finite, so every NaN is an unused entry)."""
    return cache if impl.isolates_nan else np.where(np.isnan(cache), POISON, cache)


def tensors(impl, case, c: Call, device):
    """(q, k_cache, v_cache) as case.dtype tensors on ``device`` (copies: NaN stays NaN, see poisoned)
    and the keywords of the call: cache_seqlens, k_new / v_new, block_table, num_splits, the features."""
    import torch

    dt = getattr(torch, case.dtype)
    as_t = lambda x: torch.tensor(x).to(device=device, dtype=dt)  # noqa: E731
    kw = call.kwargs_for(impl, case, tensor=lambda a: torch.from_numpy(a).to(device))
    kw["cache_seqlens"] = torch.tensor(c.lengths, dtype=torch.int32, device=device)
    if c.k_new is not None:
        kw.update(k_new=as_t(c.k_new), v_new=as_t(c.v_new))
    if c.layout.table is not None:
        kw["block_table"] = torch.tensor(c.layout.table, dtype=torch.int32, device=device)
    if impl.splits:
        kw["num_splits"] = c.num_splits
    return (as_t(c.q), as_t(poisoned(impl, c.k_cache)), as_t(poisoned(impl, c.v_cache))), kw


def run(impl, case, c: Call, *, device=None, path=None) -> tuple[call.Result, tuple[np.ndarray, np.ndarray]]:
    """Call a kvcache kernel (case gives dtype, scale and features); returns its Result (o, lse as
    for dense attention) and the caches as the call left them, float64."""
    (q, kc, vc), kw = tensors(impl, case, c, device or call.device_for(impl))
    with call._grad_mode(path or "plain"):
        out = call._call(impl, case, q, kc, vc, **kw)
    o, lse = call._split(impl, out, impl.name)
    call._check_returned(impl, call.dense_shapes(c.q, c.v_cache), o, lse)
    res = call.Result(call._np(o), None if lse is None else call._np(lse), dtype=str(o.dtype).removeprefix("torch."),
                      lse_dtype="" if lse is None else str(lse.dtype).removeprefix("torch."))
    res.inputs_after = (call._np(q),)
    return res, (call._np(kc), call._np(vc))


def dense_layout(impl, batch: int, sk: int) -> Layout:
    """How a dense case is cached: S_max = Sk + 3 (NaN past the keys); a paged kernel's pages in
    reverse order, of its smallest declared size (16 where it takes any), plus an unused block."""
    if not impl.paged:
        return Layout.contiguous(sk, spare=3)
    return Layout.paged(batch, sk, (impl.page_sizes or (16,))[0], spare=1, order_seed=-1)


def run_dense(impl, case, q, k, v, do=None, *, device=None, path=None) -> call.Result:
    """A dense batch, each sequence's keys in the cache (no appending, one split)."""
    if do is not None:
        raise ValueError(f"{impl.name} is a kvcache kernel: the suite checks it forward only")
    b, sk = q.shape[0], k.shape[2]
    layout = dense_layout(impl, b, sk)
    c = Call(q, lay_out(list(k), layout, b, k.shape[1], k.shape[3]), lay_out(list(v), layout, b, v.shape[1], v.shape[3]),
             (sk,) * b, layout)
    res, (kc, vc) = run(impl, case, c, device=device, path=path)
    res.inputs_after = (res.inputs_after[0], np.stack([read_back(kc, layout, i, sk) for i in range(b)]),
                        np.stack([read_back(vc, layout, i, sk) for i in range(b)]))
    return res
