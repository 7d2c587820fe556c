"""Launch-context bugs (docs/mutants.md), on CUDA only: SDPA's math backend, wrapped as kernels
that get the launch wrong are. Killed by properties/test_launch.py on the gpu lane."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashcheck.contract import implementation

BUGS = {
    "default_stream": "launches on the default stream, not the caller's current one",
    "cached_keys": "keeps a copy of K keyed by its pointer and version: right in eager, stale in a CUDA graph's replay",
    "shared_output": "writes O into one buffer that every call shares, then copies it out: two streams at once race",
}
SLEEP_CYCLES = 2_000_000  # about 1 ms of GPU clock between writing the shared buffer and reading it back


def _kernel(bug):
    copies = {}

    def attention(q, k, v, *, causal=False, scale=None):
        if bug == "cached_keys":
            key = (k.data_ptr(), k._version, tuple(k.shape))  # a write bumps _version, but a replay runs no Python
            if key not in copies:
                copies.clear()
                copies[key] = k.contiguous().clone()
            k = copies[key]
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
