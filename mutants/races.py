"""A deliberately racy kernel (docs/mutants.md): correct on most calls, but at batch > 1 every
third call leaves the last batch entry's final partial tile of rows as an earlier call's output,
as a kernel whose programs race on a shared buffer does when many are in flight."""
from __future__ import annotations

import torch

from flashcheck.contract import implementation
from mutants import strides

DEVICES = strides.DEVICES  # the gpu lane kills it on CUDA

BUGS = {"partial_tile_race": "at batch > 1, every third call the last batch entry's last partial 16-row tile is stale"}
_calls = [0]


def _kernel(bug):
    dense = strides._kernel(None)

    def attention(q, k, v, *, causal=False, scale=None):
        o = dense(q, k, v, causal=causal, scale=scale)
        _calls[0] += 1
        tail = q.shape[2] % 16
        if bug and q.shape[0] > 1 and tail and _calls[0] % 3 == 0:
            stale = torch.zeros_like(o[-1:, :, -tail:])  # what the buffer held before this call wrote it
            o = torch.cat([o[:-1], torch.cat([o[-1:, :, :-tail], stale], 2)], 0)
        return o

    return attention


def _register(name, bug):
    return implementation(name=name, causal="bottom_right", dtypes=("float32", "float64"), devices=DEVICES,
                          backward=True, gqa=True, register=False)(_kernel(bug))


correct = _register("races-correct", None)
partial_tile_race = _register("races-partial_tile_race", "partial_tile_race")
