"""How the suite calls an implementation: case inputs in, float64 NumPy results out."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from flashcheck.contract import Implementation, memory
from flashcheck.oracle.rounding import RESULTS
from flashcheck.strategies import feature_table


@dataclass
class Result:
    o: np.ndarray
    lse: np.ndarray | None = None
    dq: np.ndarray | None = None
    dk: np.ndarray | None = None
    dv: np.ndarray | None = None
    dsinks: np.ndarray | None = None  # the sink logits' gradient, where sinks were passed
    dbias: np.ndarray | None = None  # the bias tensor's gradient, where a bias was passed
    dtype: str = ""  # the dtype the implementation returned O in
    lse_dtype: str = ""
    inputs_after: tuple = ()  # q, k, v as the implementation left them


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def device_for(impl: Implementation) -> str | None:
    """CUDA when declared and present, else CPU when declared, else None (cannot run here)."""
    if "cuda" in impl.devices and cuda_available():
        return "cuda"
    return "cpu" if "cpu" in impl.devices else None


def kwargs_for(impl: Implementation, case, tensor=np.asarray) -> dict:
    """The keyword arguments of one call; ``tensor`` turns the float32 feature arrays into the
    implementation's framework. A declared feature is always passed, with its "off" value
    when the case leaves it off, as flash_attn_func's defaults are."""
    kw = {"causal": impl.causal_arg(case.causal)}
    if impl.scale_arg:
        kw["scale"] = case.scale
    elif case.scale is not None:
        raise ValueError(f"{impl.name} declares scale_arg=False, so it cannot run scale={case.scale!r}")
    if impl.blocks is not None:
        kw.update(block_q=case.block_q, block_k=case.block_k)
    for feature in feature_table.FEATURES:
        if getattr(impl, feature.name):
            kw.update(feature.call(case, tensor))
    return kw


SECONDS: dict[str, list] = {}  # implementation name -> [calls, seconds]: how slow a kernel is, for a warning


class ContractViolation(AssertionError):
    """The implementation broke the plug-in contract (return type, shape): a failure of the kernel."""


def _split(impl, out, name):
    if impl.lse:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ContractViolation(f"{name} declares lse=True but returned {type(out).__name__}, not (o, lse)")
        return out
    if isinstance(out, tuple):
        raise ContractViolation(f"{name} returned a tuple of {len(out)}; return o alone, or declare lse=True "
                                "and return (o, lse)")
    return out, None


def dense_shapes(q, v) -> dict:
    """What a dense kernel returns: {result: (shape, layout in words)}."""
    b, hq, sq = q.shape[:3]
    return {"o": ((b, hq, sq, v.shape[-1]), "(B, Hq, Sq, Dv)"), "lse": ((b, hq, sq), "(B, Hq, Sq)")}


def _check_returned(impl, shapes, o, lse):
    """One clear line for a result of the wrong kind or shape, before any property uses it."""
    want = "numpy.ndarray" if impl.framework == "numpy" else "torch.Tensor"
    for label, x in (("o", o), ("lse", lse)):
        if x is None:
            continue
        kind = f"{type(x).__module__.split('.')[0]}.{type(x).__name__}"
        ok = isinstance(x, np.ndarray) if impl.framework == "numpy" else kind.startswith("torch.")
        if not ok:
            hint = (" (a NumPy kernel declares framework='numpy')" if kind.startswith("numpy.")
                    else " (a torch kernel declares framework='torch', the default)" if kind.startswith("torch.")
                    else "")
            raise ContractViolation(f"{impl.name} returned {label} as {kind}, expected {want}{hint}")
    for label, x in (("o", o), ("lse", lse)):
        shape, layout = shapes[label]
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ContractViolation(f"{impl.name} returned {label} of shape {tuple(x.shape)}, expected "
                                    f"{layout} = {tuple(shape)}")


def _call(impl, case, *args, **kw):
    """Call the kernel, timing it, and say how to declare limits when it refuses a case."""
    start = time.perf_counter()
    try:
        return impl.fn(*args, **kw)
    except NotImplementedError as exc:
        raise NotImplementedError(
            f"{impl.name} raised NotImplementedError({str(exc)!r}) on {case!r}; if it does not support such "
            "cases, declare its limits in @implementation(...) (dtypes=, head_dims=, seq_multiple=, min_seq=, "
            "max_seq=, equal_lengths=, blocks=, causal=, causal_only=, gqa=, scale_arg=, or supports= for any "
            "other rule) and the suite draws only inside them") from exc
    finally:
        spent = SECONDS.setdefault(impl.name, [0, 0.0])
        spent[0] += 1
        spent[1] += time.perf_counter() - start


# How a torch kernel may be called, in the words a failure uses: a kernel can take another
# branch on each (e.g. write into q in place when q needs no gradient).
PATHS = {
    "plain": "on inputs that need no gradient",
    "autograd": "on inputs that need gradients, then backward",
    "no_grad": "under torch.no_grad()",
    "inference_mode": "under torch.inference_mode()",
}


def _grad_mode(path: str):
    import contextlib

    import torch

    return {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(path, contextlib.nullcontext)()


def _fresh(torch, device, nbytes=0):
    """A kernel's own allocations hold NaN until it writes them: on CPU through a torch function mode
    (memory.poisoned); on CUDA through the caching allocator's recycled blocks, filled with NaN first
    (memory.prime_cuda_cache: a torch.compile'd kernel would trace through the mode)."""
    if torch.device(device).type == "cpu":
        return memory.poisoned(torch)
    memory.prime_cuda_cache(torch, device, nbytes)
    return contextlib.nullcontext()


def run(impl: Implementation, case, q, k, v, do=None, *, device=None, path=None) -> Result:
    """Run forward (and backward through dO when given) on float64 arrays holding case.dtype values.

    ``path`` (a key of PATHS) picks how a torch kernel is called; by default the inputs need
    gradients exactly when dO is given. A kernel that declares a layout is called in it: the dense
    batch is packed and its results unpacked (varlen: flashcheck/contract/packed.py), or its keys
    are put in a cache (kvcache: flashcheck/contract/cache.py)."""
    if path not in (None, *PATHS) or (path not in (None, "autograd") and do is not None):
        raise ValueError(f"path {path!r}: expected one of {tuple(PATHS)}, and dO only on the autograd path")
    device = device or device_for(impl)
    if impl.varlen:
        from flashcheck.contract import packed

        return packed.run_dense(impl, case, q, k, v, do, device=device, path=path)
    if impl.kvcache:
        from flashcheck.contract import cache

        return cache.run_dense(impl, case, q, k, v, do, device=device, path=path)
    if impl.framework == "numpy":
        kw = kwargs_for(impl, case)
        qn, kn, vn = (x.astype(case.dtype) for x in (q, k, v))
        o, lse = _split(impl, _call(impl, case, qn, kn, vn, **kw), impl.name)
        _check_returned(impl, dense_shapes(q, v), o, lse)
        res = Result(np.asarray(o, np.float64), None if lse is None else np.asarray(lse, np.float64),
                     dtype=str(np.asarray(o).dtype), lse_dtype="" if lse is None else str(np.asarray(lse).dtype))
        if do is not None:
            grads = impl.backward(qn, kn, vn, o, lse, do.astype(case.dtype), **kw)
            extra = [n for n, key in (("dsinks", "sinks"), ("dbias", "attn_bias")) if kw.get(key) is not None]
            if len(grads) != 3 + len(extra):  # a backward given sinks or a bias returns their gradients too
                raise AssertionError(f"{impl.name}: the backward must return (dq, dk, dv{''.join(', ' + n for n in extra)})")
            for n, g in zip(extra, grads[3:]):
                setattr(res, n, np.asarray(g, np.float64))
            res.dq, res.dk, res.dv = (np.asarray(g, np.float64) for g in grads[:3])
        res.inputs_after = tuple(np.asarray(x, np.float64) for x in (qn, kn, vn))
        return res
    return run_torch(impl, case, q, k, v, do, device=device, path=path, shapes=dense_shapes(q, v))


def run_torch(impl, case, q, k, v, do, *, device, path, shapes, layout_kw=None) -> Result:
    """The torch call: q, k, v (and dO) as case.dtype tensors on ``device``, ``layout_kw(torch,
    device)`` the layout's own keywords (cu_seqlens, ...), the results checked against ``shapes``."""
    import torch

    dt = getattr(torch, case.dtype)
    # torch.tensor copies: a tensor sharing the caller's buffer (from_numpy of float64 on CPU)
    # would hide an in-place write from the comparison with the inputs afterwards.
    grad = do is not None or path == "autograd"
    qt, kt, vt = (memory.lay(torch, x, case.memory, device=device, dtype=dt).requires_grad_(grad) for x in (q, k, v))
    kw = kwargs_for(impl, case, tensor=lambda a: torch.from_numpy(a).to(device))
    kw.update(layout_kw(torch, device) if layout_kw else {})
    sinks, bias = kw.get("sinks"), kw.get("attn_bias")
    for x in (sinks, bias):
        if x is not None:
            x.requires_grad_(grad)
    guarded = _guarded_out(torch, shapes["o"][0], dt, device) if impl.out else None
    if guarded is not None:
        kw["out"] = guarded[1]
    nbytes = sum(x.numel() * x.element_size() for x in (qt, kt, vt))
    with _grad_mode(path), _fresh(torch, device, nbytes):
        try:
            out = _call(impl, case, qt, kt, vt, **kw)
        except (AssertionError, NotImplementedError):
            raise
        except Exception as exc:
            if case.memory != "contiguous" and _layout_refused(impl, case, (q, k, v), device, dt, kw):
                raise memory.LayoutRefused(memory.refused(impl, case, exc)) from exc
            raise
    o, lse = _split(impl, out, impl.name)
    _check_returned(impl, shapes, o, lse)
    if guarded is not None:
        _check_out(impl, *guarded, o)
    res = Result(_np(o), None if lse is None else _np(lse), dtype=str(o.dtype).removeprefix("torch."),
                 lse_dtype="" if lse is None else str(lse.dtype).removeprefix("torch."))
    if do is not None:
        do_t = memory.lay(torch, do, case.memory, device=device, dtype=o.dtype)  # dO laid out as the inputs
        with _fresh(torch, device, nbytes):
            o.backward(do_t)
        res.dq, res.dk, res.dv = (_np(x.grad) if x.grad is not None else np.zeros(x.shape) for x in (qt, kt, vt))
        if sinks is not None:
            res.dsinks = _np(sinks.grad) if sinks.grad is not None else np.zeros(sinks.shape)
        if bias is not None:
            res.dbias = _np(bias.grad) if bias.grad is not None else np.zeros(bias.shape)
    res.inputs_after = tuple(_np(x) for x in (qt, kt, vt))
    return res


# out=: the view handed to the kernel lies between two guard bands of a sentinel, exact in every
# dtype and not a value attention computes by chance; a kernel that writes past its output changes them.
GUARD, SENTINEL = 64, -7776.0


def _guarded_out(torch, shape, dtype, device):
    """(buffer, out): ``out`` of ``shape`` inside ``buffer``, GUARD sentinels on each side."""
    n = int(np.prod(shape))
    buf = torch.full((GUARD + n + GUARD,), SENTINEL, dtype=dtype, device=device)
    return buf, buf[GUARD:GUARD + n].view(shape)


def _check_out(impl, buf, out, o):
    """Nothing past out= changed, and out= is what came back."""
    n = out.numel()
    for side, band in (("before", buf[:GUARD]), ("after", buf[GUARD + n:])):
        changed = band != SENTINEL
        if changed.any():
            at = changed.nonzero().flatten()
            nearest = int(at[0]) + 1 if side == "after" else GUARD - int(at[-1])  # 1: right next to out=
            raise AssertionError(
                f"{impl.name} wrote past its output: {int(changed.sum())} of the {GUARD} elements {side} out= "
                f"changed, the nearest {nearest} element(s) {side} it (out= lies in one buffer between guard "
                f"bands of {SENTINEL})")
    if o.data_ptr() != out.data_ptr() or o.shape != out.shape:
        raise ContractViolation(f"{impl.name} declares out=True and was given out=, but returned another tensor "
                                f"(shape {tuple(o.shape)}): a kernel that takes out= writes O there and returns it")


def _layout_refused(impl, case, arrays, device, dtype, kw) -> bool:
    """Is an error on a non-contiguous layout the layout's? Only if it recurs on that layout and a
    contiguous copy of the same inputs runs: an intermittent error stays what it was."""
    import torch

    def runs(kind):
        try:
            with torch.no_grad():
                _call(impl, case, *(memory.lay(torch, x, kind, device=device, dtype=dtype) for x in arrays), **kw)
        except Exception:  # noqa: BLE001  (any error: the question is only whether it recurs)
            return False
        return True

    return not runs(case.memory) and runs("contiguous")


def _np(t):
    import torch

    return t.detach().to("cpu", dtype=torch.float64).numpy()


def repeat_differences(impl, case, calls: int = 2) -> list[str]:
    """Call ``impl`` ``calls`` times on the case's input; one line per result that is not
    bitwise identical across calls (NaN counts as equal to NaN)."""
    q, k, v, do = case.inputs()
    do = do if impl.has_backward else None
    first, lines = run(impl, case, q, k, v, do), []
    for _ in range(calls - 1):
        again = run(impl, case, q, k, v, do)
        for name in RESULTS:
            a, b = getattr(first, name), getattr(again, name)
            if a is None or b is None:
                continue
            same = (a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))
            if same.all():
                continue
            with np.errstate(invalid="ignore"):
                gap = np.where(same, 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf))
            idx = tuple(int(i) for i in np.unravel_index(np.argmax(gap), gap.shape))
            lines.append(f"{name}: {int((~same).sum())} of {a.size} entries differ; largest difference "
                         f"{gap[idx]:.3e} at {idx} ({float(a[idx])!r} then {float(b[idx])!r})")
        if lines:
            break
    return lines
