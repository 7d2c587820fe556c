"""Kernels that test the suite's own trustworthiness rather than a bug class of attention.

Each one is either correct in a way that is easy to fail falsely (limits it declares, a refusal
by a named error), or broken in a way that only a careful suite sees. They run as plug-ins, ``mutants/untrusted.py:<name>``,
from mutants/test_trust.py (in process) and mutants/test_examples.py (through pytest).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcheck import KnownIssue, implementation
from flashcheck.contract.checks import check_inputs

DTYPES = ("float32", "float64")


def _sdpa(q, k, v, causal, scale):
    check_inputs(q, k, v, dtypes=DTYPES, who="untrusted")
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), scale=scale, enable_gqa=True)


def _plugin(name, **declared):
    base = dict(causal="top_left", dtypes=DTYPES, devices=("cpu",), backward=True, gqa=True, register=False)
    return implementation(name=name, **{**base, **declared})


@_plugin("no-masked-positions", equal_lengths=True)
def no_masked_positions(q, k, v, *, causal=False, scale=None):
    """Correct; top-left causal with equal lengths has no masked position at all."""
    return _sdpa(q, k, v, causal, scale)


@_plugin("causal-by-supports", supports=lambda case: case.causal is not None or "it has no non-causal mode")
def causal_by_supports(q, k, v, *, causal=False, scale=None):
    """Correct; says through ``supports`` alone that it cannot run non-causal cases."""
    if not causal:
        raise NotImplementedError("causal-by-supports: no non-causal mode")
    return _sdpa(q, k, v, causal, scale)


_SEEN: set = set()


def _first_call(who, q, k, v, causal, scale) -> bool:
    """True the first time ``who`` is called on this input, False after."""
    key = hashlib.sha1(b"".join(x.detach().numpy().tobytes() for x in (q, k, v)) + repr((who, causal, scale)).encode())
    first = key.hexdigest() not in _SEEN
    _SEEN.add(key.hexdigest())
    return first


@_plugin("first-call-wrong")
def first_call_wrong(q, k, v, *, causal=False, scale=None):
    """The first call on each input is off; later calls are right: a race, as a user meets it."""
    o = _sdpa(q, k, v, causal, scale)
    return o * 1.01 if _first_call("wrong", q, k, v, causal, scale) else o


@_plugin("first-call-raises")
def first_call_raises(q, k, v, *, causal=False, scale=None):
    """The first call on each input raises; later calls return the right answer: not a race."""
    if _first_call("raises", q, k, v, causal, scale):
        raise RuntimeError("first-call-raises: out of workspace memory")
    return _sdpa(q, k, v, causal, scale)


class CompilationError(RuntimeError):
    """Named as Triton's compiler names its errors."""


@_plugin("compiles-on-the-retry")
def compiles_on_the_retry(q, k, v, *, causal=False, scale=None):
    """Fails to compile on the first call on each input and runs after (as compiled flex ran eager)."""
    if _first_call("compile", q, k, v, causal, scale):
        raise CompilationError("at 12:8: no valid configs for this shape")
    return _sdpa(q, k, v, causal, scale)


@_plugin("halves-q-in-place", backward=False, dtypes=("float64",))
def halves_q_in_place(q, k, v, *, causal=False, scale=None):
    """Right answer, then writes over its input q."""
    o = _sdpa(q, k, v, causal, scale)
    q.mul_(0.5)
    return o


@_plugin("not-implemented")
def not_implemented(q, k, v, *, causal=False, scale=None):
    """Refuses every call, bad input and good alike."""
    raise NotImplementedError("not-implemented: nothing is implemented")


@_plugin("nan-output", backward=False)
def nan_output(q, k, v, *, causal=False, scale=None):
    """NaN everywhere: the invariance properties must blame it, not the reference."""
    return torch.full_like(_sdpa(q, k, v, causal, scale), float("nan"))


@_plugin("beyond-the-values", backward=False)
def beyond_the_values(q, k, v, *, causal=False, scale=None):
    """Every output one past the largest value: outside the range a convex combination can reach."""
    o = _sdpa(q, k, v, causal, scale)
    return o + (v.abs().amax() + 1).to(o.dtype)


@_plugin("checks-lengths-only", min_seq=4, backward=False)
def checks_lengths_only(q, k, v, *, causal=False, scale=None):
    """Refuses short sequences but broadcasts a batch of 1, as SDPA does: bad-input tests
    that start from a too-short case see a refusal for the wrong reason."""
    if min(q.shape[-2], k.shape[-2]) < 4:
        raise ValueError("checks-lengths-only: sequences shorter than 4 are not supported")
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), scale=scale, enable_gqa=True)


@_plugin("wrong-at-zero-scale", known_issues=[KnownIssue(
    "scale 0.0 returns NaN", applies=lambda case: case.scale == 0.0, witness=dict(sk=2, scale=0.0),
    failure=r"got \S*nan")])
def wrong_at_zero_scale(q, k, v, *, causal=False, scale=None):
    """Declares a NaN at scale 0.0, but what it really does there is return a finite wrong value."""
    o = _sdpa(q, k, v, causal, scale)
    return o + 1 if scale == 0.0 else o


def _ulp_noise(o):
    """Move every nonzero output one ulp up or down, differently on every call."""
    _ulp_noise.calls += 1
    toward = torch.full_like(o, float("inf") if _ulp_noise.calls % 2 else float("-inf"))
    return torch.where(o != 0, torch.nextafter(o, toward), o)


_ulp_noise.calls = 0


def _with_ulp_noise(fn, name):
    record = fn.__flashcheck__

    def noisy(q, k, v, *, causal=True, scale=None):
        o = fn(q, k, v, causal=causal, scale=scale)
        return o + (_ulp_noise(o.detach()) - o.detach())  # the gradients stay those of the kernel

    kw = {f: getattr(record, f) for f in ("causal", "dtypes", "devices", "backward", "gqa", "lse", "head_dims",
                                          "min_seq", "equal_lengths", "causal_only", "deterministic")}
    return implementation(name=name, register=False, **kw)(noisy)


def _example(spec):
    from flashcheck import load

    return load(str(Path(__file__).resolve().parent.parent / "examples" / spec)).fn


# The Done-when example kernel with one ulp of run-to-run noise: still accurate, not deterministic.
causal_only_ulp_noise = _with_ulp_noise(_example("sdpa_causal_only.py:attention"), "sdpa-causal-only-ulp-noise")
