"""Launch-context bugs (docs/mutants.md), on CUDA only: SDPA's math backend, wrapped as kernels
that get the launch wrong are. Killed by properties/test_launch.py on the gpu lane."""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from flashcheck.contract import implementation

BUGS = {
    "default_stream": "launches on the default stream, not the caller's current one",
    "cached_keys": "keeps a copy of K keyed by the tensor and its version: right in eager, stale in a CUDA graph's replay",
    "shared_output": "writes O into one buffer that every call shares, then copies it out: two streams at once race",
}
SLEEP_CYCLES = 2_000_000  # about 1 ms of GPU clock between writing the shared buffer and reading it back


def _kernel(bug):
    copies = {}

    def attention(q, k, v, *, causal=False, scale=None):
        if bug == "cached_keys":
            # A write bumps _version, but a replay runs no Python. Keyed by the tensor itself, not its
            # address: a new K of one shape often lands where the last one lay (the caching allocator), and
            # an address key went stale in eager too, at whichever example, so that no case shrank (H200).
            ref, version, copy = copies.get("k", (None, None, None))
            if ref is None or ref() is not k or version != k._version:
                copy = k.contiguous().clone()
                copies["k"] = (weakref.ref(k), k._version, copy)
            k = copy
        stream = torch.cuda.default_stream(q.device) if bug == "default_stream" else torch.cuda.current_stream(q.device)
        with torch.cuda.stream(stream):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), scale=scale,
                                               enable_gqa=q.shape[1] != k.shape[1])
            if bug == "shared_output":  # one workspace per shape for every call, as a static buffer would be
                buf = copies.setdefault((tuple(o.shape), o.dtype), torch.empty_like(o))
                buf.copy_(o)
                torch.cuda._sleep(SLEEP_CYCLES)
                o = buf.clone()
            return o

    return attention


def _register(name, bug):
    return implementation(name=name, causal=("top_left",), dtypes=("float32",), devices=("cuda",), gqa=True,
                          cuda_graphs=True, register=False)(_kernel(bug))


correct = _register("launch-correct", None)
default_stream = _register("launch-default_stream", "default_stream")
cached_keys = _register("launch-cached_keys", "cached_keys")
shared_output = _register("launch-shared_output", "shared_output")
