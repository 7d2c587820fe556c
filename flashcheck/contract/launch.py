"""How a kernel is launched in real programs, on CUDA: on a side stream, inside a CUDA graph, and
under torch.compile (properties/test_launch.py). Forward only, dense layout, O and LSE.

- **A side stream.** A program that overlaps work runs attention on a stream of its own, with
  its inputs produced there. The suite fills the inputs with NaN, then, on the side stream, waits
  about a hundred milliseconds on the GPU before writing the real values, and calls the kernel on
  that stream. A kernel that launches on the default stream instead of the current one reads the
  inputs before they are written: NaN, or a mix.
- **Two streams at once.** A server runs two requests concurrently on two streams. The suite
  launches the call on two cases from two streams, the second before the first has finished, and
  holds each result to its own case's truth. A kernel that shares a workspace or an output buffer
  between calls hands one request the other's numbers.
- **A CUDA graph.** Serving stacks capture decoding steps in CUDA graphs and replay them after
  writing each step's values into the captured inputs. The suite warms the call up on a side
  stream (compiling and autotuning outside the capture, as torch's docs ask), captures it, writes
  a second case's values into the same tensors, replays, and compares with that case's truth. A
  kernel that computes something on the host from the first values, or caches a tensor derived
  from its inputs, replays the old answer. A kernel declares ``cuda_graphs=True`` to be held to it.
- **torch.compile.** ``torch.compile(fn, fullgraph=False)`` of the call, inductor on CUDA (the
  ``aot_eager`` backend on CPU, which traces the same graph without generating code), for a kernel
  that declares ``compile=True``.
"""
from __future__ import annotations

import gc

import numpy as np

from flashcheck.contract import call, memory

DELAY_CYCLES = 200_000_000  # about 0.1 s of GPU clock: long enough that a wrongly ordered read sees NaN


def _tensors(torch, impl, case, arrays, device):
    dt = getattr(torch, case.dtype)
    return [memory.lay(torch, x, case.memory, device=device, dtype=dt) for x in arrays]


def _result(impl, case, out, q, v) -> call.Result:
    o, lse = call._split(impl, out, impl.name)
    call._check_returned(impl, call.dense_shapes(q, v), o, lse)
    return call.Result(call._np(o), None if lse is None else call._np(lse), dtype=str(o.dtype).removeprefix("torch."))


def on_side_stream(impl, case, q, k, v) -> call.Result:
    """The call made on a new stream whose inputs are written there, after a delay on the GPU."""
    import torch

    kw = call.kwargs_for(impl, case, tensor=lambda a: torch.from_numpy(a).to("cuda"))
    real = _tensors(torch, impl, case, (q, k, v), "cuda")
    ins = _tensors(torch, impl, case, (np.full(q.shape, np.nan), np.full(k.shape, np.nan), np.full(v.shape, np.nan)),
                   "cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), torch.no_grad():
        torch.cuda._sleep(DELAY_CYCLES)  # the producer is still busy when the call is made
        for dst, src in zip(ins, real):
            dst.copy_(src)
        out = call._call(impl, case, *ins, **kw)
    side.synchronize()
    return _result(impl, case, out, q, v)


def on_two_streams(impl, case, first, second) -> list:
    """The call on ``first``'s and ``second``'s (q, k, v), each on a stream of its own, launched one
    right after the other (a warm-up call first keeps compiling and autotuning out of the overlap)."""
    import torch

    kw = call.kwargs_for(impl, case, tensor=lambda a: torch.from_numpy(a).to("cuda"))
    ins = [_tensors(torch, impl, case, arrays, "cuda") for arrays in (first, second)]
    with torch.no_grad():
        call._call(impl, case, *ins[0], **kw)
    torch.cuda.synchronize()
    outs = []
    with torch.no_grad():
        for x in ins:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                outs.append(call._call(impl, case, *x, **kw))
    torch.cuda.synchronize()
    return [_result(impl, case, out, arrays[0], arrays[2]) for out, arrays in zip(outs, (first, second))]


class CaptureFailed(AssertionError):
    """A kernel that declares cuda_graphs=True raised while being captured."""


def replayed(impl, case, first, second) -> call.Result:
    """Capture the call on ``first``'s (q, k, v), write ``second``'s values into the same tensors,
    replay: the results should be ``second``'s."""
    import torch

    kw = call.kwargs_for(impl, case, tensor=lambda a: torch.from_numpy(a).to("cuda"))
    ins = _tensors(torch, impl, case, first, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # compiles, autotunes and allocator warm-up stay outside the capture
            call._call(impl, case, *ins, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Only the capturing thread is held to the capture's rules ("thread_local"): under the default
    # "global" mode an unsafe call from any thread (a free of JAX's, say: a gpu lane worker runs many
    # libraries) invalidates it. In an H200 lane, torch-tiled, which does nothing unsafe in its own
    # thread, failed one capture of 15 with "operation failed due to a previous error during capture"
    # and passed three retries. The garbage collector waits too: a buffer freed mid-capture is such a free.
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"), torch.no_grad():
            out = call._call(impl, case, *ins, **kw)
    except Exception as exc:  # noqa: BLE001  (any error of the capture is the kernel's, named as such)
        raise CaptureFailed(f"{impl.name} declares cuda_graphs=True but raised while its call was captured in a "
                            f"CUDA graph: {type(exc).__name__}: {exc}\n  (a host sync, .item(), a CPU tensor or "
                            f"an allocation that differs per call cannot be captured; declare cuda_graphs=False)"
                            f"\n  case: {case!r}") from exc
    finally:
        gc.enable()
    for dst, x in zip(ins, _tensors(torch, impl, case, second, "cuda")):
        dst.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return _result(impl, case, out, second[0], second[2])


def compiled(impl, case, q, k, v, *, device) -> call.Result:
    """The call through torch.compile(fullgraph=False): inductor on CUDA, aot_eager on CPU."""
    import torch

    kw = call.kwargs_for(impl, case, tensor=lambda a: torch.from_numpy(a).to(device))
    fn = torch.compile(impl.fn, fullgraph=False, dynamic=False, backend="inductor" if device == "cuda" else "aot_eager")
    # past dynamo's recompile limit (8 shapes of one function) torch silently runs eager: the limit is
    # raised and a hit is an error. (torch._dynamo.reset() would do it too, but it drops every graph the
    # process holds, a compiled FlexAttention's among them, and they would all compile again.)
    with torch.no_grad(), compile_limits(COMPILE_LIMIT):
        out = fn(*_tensors(torch, impl, case, (q, k, v), device), **kw)
    return _result(impl, case, out, q, v)


COMPILE_LIMIT = 1024  # far above what one run compiles of one function, and still finite


def compile_limits(limit: int):
    """dynamo's config patch: recompile limits raised to ``limit``, and an error where dynamo would fall
    back to eager. (Older torch spells them cache_size_limit, accumulated_cache_size_limit,
    fail_on_cache_limit_hit.)"""
    import torch

    cfg = torch._dynamo.config
    settings = {("recompile_limit", "cache_size_limit"): limit,
                ("accumulated_recompile_limit", "accumulated_cache_size_limit"): limit,
                ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"): True}
    return cfg.patch(**{next(n for n in names if hasattr(cfg, n)): value for names, value in settings.items()})
