"""Input validation shared by every built-in implementation: bad input is named, never computed."""
from __future__ import annotations

__all__ = ["alignment", "check_blocks", "check_features", "check_inputs", "check_score_tensor", "check_kvcache", "check_tensors", "check_varlen",
           "dtype_name", "offset"]


def dtype_name(x) -> str:
    """'float32' for a numpy array or a torch tensor alike."""
    return str(x.dtype).removeprefix("torch.")


def check_tensors(q, k, v, *, devices, who: str):
    """q, k, v are torch tensors on one device, of a type ``devices`` names ("cpu", "cuda")."""
    import torch

    for label, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who}: {label} must be a torch.Tensor, got {type(x).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in devices:
        raise ValueError(f"{who}: unsupported device {q.device}; supported: {', '.join(devices)}")


def check_inputs(q, k, v, *, dtypes, who: str):
    """Validate q, k, v against docs/design.md's layout; return (B, Hq, Hkv, Sq, Sk, D, Dv)."""
    for label, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{who}: {label} must have rank 4 (batch, heads, seq, dim), "
                             f"got shape {tuple(getattr(x, 'shape', ()))}")
        if dtype_name(x) not in dtypes:
            raise TypeError(f"{who}: {label} has unsupported dtype {dtype_name(x)}; supported: {', '.join(dtypes)}")
    if not (dtype_name(q) == dtype_name(k) == dtype_name(v)):
        raise TypeError(f"{who}: q, k, v must share one dtype, got {dtype_name(q)}, {dtype_name(k)}, {dtype_name(v)}")
    (b, hq, sq, d), (bk, hkv, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    if not (b == bk == bv):
        raise ValueError(f"{who}: batch sizes differ: q {b}, k {bk}, v {bv}")
    if hkv != hv:
        raise ValueError(f"{who}: k has {hkv} heads but v has {hv}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{who}: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if sk != sv:
        raise ValueError(f"{who}: k has sequence length {sk} but v has {sv}")
    if d != dk:
        raise ValueError(f"{who}: q head dim {d} differs from k head dim {dk}")
    if min(b, hq, sq, sk, d, dv) < 1:
        raise ValueError(f"{who}: every dimension must be >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    return b, hq, hkv, sq, sk, d, dv


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dtypes, who: str):
    """Validate a packed batch (flashcheck/contract/packed.py): q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv),
    int32 offsets on q's device from 0 to Tq and Tk. Returns the offsets as two lists of Python ints."""
    import torch

    for label, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{who}: {label} must have rank 3 (tokens, heads, dim) in a packed batch, "
                             f"got shape {tuple(getattr(x, 'shape', ()))}")
    # the dense checks on a batch of one, tokens as its sequence
    check_inputs(*(x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)), dtypes=dtypes, who=who)
    cu = []
    for label, c, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if not isinstance(c, torch.Tensor) or c.dtype != torch.int32 or c.ndim != 1 or c.numel() < 2:
            raise TypeError(f"{who}: {label} must be a 1-D int32 tensor of B + 1 offsets, got "
                            f"{getattr(c, 'dtype', type(c).__name__)} of shape {tuple(getattr(c, 'shape', ()))}")
        if c.device != q.device:
            raise ValueError(f"{who}: {label} is on {c.device}, q on {q.device}")
        values = c.tolist()
        if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"{who}: {label} must rise from 0 to {total} (the packed tokens), got {values}")
        cu.append(values)
    if len(cu[0]) != len(cu[1]):
        raise ValueError(f"{who}: cu_seqlens_q holds {len(cu[0]) - 1} sequences, cu_seqlens_k {len(cu[1]) - 1}")
    for label, top, c in (("max_seqlen_q", max_seqlen_q, cu[0]), ("max_seqlen_k", max_seqlen_k, cu[1])):
        longest = max(b - a for a, b in zip(c, c[1:]))
        if not isinstance(top, int) or top < longest:
            raise ValueError(f"{who}: {label} must be an int >= the longest sequence ({longest}), got {top!r}")
    return cu[0], cu[1]


def _int32(label, x, shape, device, who):
    import torch

    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or tuple(x.shape) != shape:
        raise TypeError(f"{who}: {label} must be an int32 tensor of shape {shape}, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    if x.device != device:
        raise ValueError(f"{who}: {label} is on {x.device}, q on {device}")
    return x.tolist()


def check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, *, dtypes, who: str):
    """Validate a cache call (flashcheck/contract/cache.py). Returns (lengths before appending as
    Python ints, the block table as lists or None, the page size: S_max for a contiguous cache)."""
    b, sq = q.shape[0], q.shape[2]
    paged = block_table is not None
    # the dense checks, with the cache as the keys: its batch is the number of blocks when paged
    check_inputs(q, *((x[:1].expand(b, -1, -1, -1) if paged else x) for x in (k_cache, v_cache)), dtypes=dtypes,
                 who=who)
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{who}: k_new and v_new go together")
    if k_new is not None:
        want = [(b, k_cache.shape[1], sq, c.shape[-1]) for c in (k_cache, v_cache)]
        for label, x, shape in (("k_new", k_new, want[0]), ("v_new", v_new, want[1])):
            if tuple(getattr(x, "shape", ())) != shape or dtype_name(x) != dtype_name(q):
                raise ValueError(f"{who}: {label} must be {dtype_name(q)} of shape (B, Hkv, Sq, D) = {shape}, got "
                                 f"{dtype_name(x)} of shape {tuple(getattr(x, 'shape', ()))}")
    lengths = _int32("cache_seqlens", cache_seqlens, (b,), q.device, who)
    page = k_cache.shape[2]
    table = None
    if paged:
        table = _int32("block_table", block_table, (b, block_table.shape[-1] if getattr(block_table, "ndim", 0) == 2 else "max_blocks"),
                       q.device, who)
        bad = [x for row in table for x in row if not 0 <= x < k_cache.shape[0]]
        if bad:
            raise ValueError(f"{who}: block_table names blocks {sorted(set(bad))[:5]} outside the cache's "
                             f"{k_cache.shape[0]} blocks")
    room = page * (len(table[0]) if paged else 1)
    added = 0 if k_new is None else sq
    for i, n in enumerate(lengths):
        if not 0 <= n <= room - added:
            raise ValueError(f"{who}: cache_seqlens[{i}] = {n}: a sequence holds 0 to {room} positions"
                             + (f", and {added} new keys are appended" if added else ""))
    return lengths, table, page


def check_blocks(block_q, block_k, *, who: str):
    for label, blk in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(blk, int) or isinstance(blk, bool) or blk < 1:
            raise ValueError(f"{who}: {label} must be an int >= 1, got {blk!r}")


def alignment(causal) -> str | None:
    """Map the ``causal=`` argument (False, True, or an alignment name) to an alignment or None."""
    if causal is False or causal is None:
        return None
    if causal is True:
        return "bottom_right"
    if causal in ("bottom_right", "top_left"):
        return causal
    raise ValueError(f"causal must be a bool, 'bottom_right' or 'top_left', got {causal!r}")


def offset(sq: int, sk: int, align: str | None) -> int:
    """Query i sees key j iff j <= i + offset (docs/design.md); None means every key is visible."""
    return sk - sq if align == "bottom_right" else 0


def check_features(q, *, who: str, window=None, softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
                   tables=("float32",), attn_mask=None, sk=None, attn_bias=None):
    """Validate the feature arguments (docs/features.md) against q (B, Hq, Sq, D); a numpy array or a
    torch tensor alike. Returns the window as a tuple, or None when it is off. ``tables``: the dtypes
    the slopes and sinks may have (kernels get float32; the float64 truth takes float64 too)."""
    b, hq = q.shape[0], q.shape[1]
    if window is not None:
        ok = len(window) == 2 and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
        if not ok:
            raise ValueError(f"{who}: window must be (left, right), ints >= -1 (-1 = unbounded), got {window!r}")
        window = None if tuple(window) == (-1, -1) else tuple(window)
    if not (isinstance(softcap, (int, float)) and softcap >= 0):
        raise ValueError(f"{who}: softcap must be a float >= 0 (0 = off), got {softcap!r}")
    for label, x, shapes in (("alibi_slopes", alibi_slopes, ((hq,), (b, hq))), ("sinks", sinks, ((hq,),))):
        if x is None:
            continue
        if tuple(getattr(x, "shape", ())) not in shapes:
            raise ValueError(f"{who}: {label} must have shape {' or '.join(map(str, shapes))}, "
                             f"got {tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        if dtype_name(x) not in tables:
            raise TypeError(f"{who}: {label} must be {' or '.join(tables)}, got {dtype_name(x)}")
        if getattr(x, "device", None) != getattr(q, "device", None):
            raise ValueError(f"{who}: {label} is on {x.device}, q on {q.device}")
    if not (isinstance(dropout_p, (int, float)) and 0 <= dropout_p < 1):
        raise ValueError(f"{who}: dropout_p must be in [0, 1), got {dropout_p!r}")
    if attn_mask is not None:
        check_score_tensor(attn_mask, q, sk, who=who)
    if attn_bias is not None:
        check_score_tensor(attn_bias, q, sk, who=who, label="attn_bias", dtypes=("float16", "bfloat16", "float32", "float64"))
    return window


def check_score_tensor(x, q, sk, *, who: str, label="attn_mask", dtypes=("bool",)):
    """attn_mask (bool) or attn_bias (float): (B or 1, Hq or 1, Sq, Sk) on q's device (``sk``: None where unknown)."""
    b, hq, sq = q.shape[0], q.shape[1], q.shape[2]
    shape = tuple(getattr(x, "shape", ()))
    if (len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, hq) or shape[2] != sq
            or (sk is not None and shape[3] != sk)):
        raise ValueError(f"{who}: {label} must have shape (B or 1, Hq or 1, Sq, Sk) = ({b} or 1, {hq} or 1, "
                         f"{sq}, {'Sk' if sk is None else sk}), got {shape or type(x).__name__}")
    if dtype_name(x) not in dtypes:
        raise TypeError(f"{who}: {label} must be {' or '.join(dtypes)}{' (True = may attend)' if label == 'attn_mask' else ''}, "
                        f"got {dtype_name(x)}")
    if getattr(x, "device", None) != getattr(q, "device", None):
        raise ValueError(f"{who}: {label} is on {x.device}, q on {q.device}")
