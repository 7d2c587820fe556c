"""Giant cases on CUDA (strategies/scale.py): past 65535 batch x heads, past 2^31 elements, 131072 tokens.

The inputs are drawn on the device (a host copy of 2^31 float64 values would not fit); the truth is
the sampled oracle's (flashcheck/oracle/sampled.py) on a few whole heads read back from the device,
at their first and last rows, rows on both sides of drawn tile boundaries, and random rows.
"""
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from flashcheck import strategies as fs
from flashcheck.contract import call
from flashcheck.oracle import sampled
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import scale

pytestmark = [pytest.mark.properties, pytest.mark.requires("cuda", "dense")]
HEADS = 4  # judged per case: the first, the last, and two drawn


def device_inputs(torch, case: Case, seed: int, device="cuda"):
    """q, k, v, dO of ``case`` drawn on ``device`` from ``seed`` (normal values, exact in its dtype)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, case.dtype)
    shapes = [(case.batch, case.hq, case.sq, case.d), (case.batch, case.hkv, case.sk, case.d),
              (case.batch, case.hkv, case.sk, case.dv), (case.batch, case.hq, case.sq, case.dv)]
    return [torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dt) for s in shapes]


def heads_to_check(case: Case, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    picks = {(0, 0), (case.batch - 1, case.hq - 1)}
    while len(picks) < min(HEADS, case.batch * case.hq):
        picks.add((int(rng.integers(case.batch)), int(rng.integers(case.hq))))
    return sorted(picks)


def judge_heads(impl, case: Case, tensors, o, lse, dq, seed: int, device_of=None):
    """Each of heads_to_check's heads as a case of its own (B = H = 1, its inputs read back), at
    sampled.rows_to_check's rows (16-row edges, 8 drawn tile boundaries, 8 random rows)."""
    group = case.hq // case.hkv
    one = case.replace(batch=1, hq=1, hkv=1)
    rows = sampled.rows_to_check(one, block=16, random_rows=8, seed=seed, boundaries=8)
    for b, h in heads_to_check(case, seed):
        q, k, v, do = (np.asarray(t[b, i].detach().double().cpu())[None, None]
                       for t, i in zip(tensors, (h, h // group, h // group, h)))
        parts = sampled.parts(one, rows, inputs=(q, k, v, do))
        who = f"{impl.name} at batch {b}, head {h} of {case!r}"
        for name, got in (("o", o), ("lse", lse), ("dq", dq)):
            if got is not None:
                at = np.asarray(got[b, h][rows].double().cpu())[None, None]
                sampled.compare(one, name, at, rows, who=who, inputs=(q, k, v, do), parts_=parts)


@given(target=st.sampled_from(scale.targets()), causal=st.sampled_from((None, "bottom_right", "top_left")),
       seed=st.integers(0, 2**16))
def test_giant_cases_match_float64_on_sampled_heads_and_rows(impl, target, causal, seed):
    import torch

    from flashcheck.strategies import context

    context.current().no_reproducer = ("a giant case's inputs are drawn on the device from the test's seed (see the "
                                       "note): rerun this property with the same --hypothesis-seed")
    half = [t for t in impl.dtypes if t in ("float16", "bfloat16")]
    case = Case(**scale.TARGETS[target], causal=causal, dtype=half[0] if half else impl.dtypes[0])
    case = fs.fit(impl, case)
    free, _ = torch.cuda.mem_get_info()
    case = scale.fitted_to_memory(case, int(free * 0.8), impl.has_backward)
    note(f"target {target!r}: {case!r}, {case.batch * case.hq * case.sq * case.d:.3g} elements in q, "
         f"drawn on the device with torch.Generator seed {seed}")
    tensors = device_inputs(torch, case, seed)
    judge_heads(impl, case, tensors, *run_on(torch, impl, case, tensors, "cuda"), seed)


def run_on(torch, impl, case: Case, tensors, device):
    """(O, LSE or None, dQ or None) of the call on the device tensors (q, k, v, dO)."""
    q, k, v, do = tensors
    grad = impl.has_backward
    q.requires_grad_(grad)
    kw = call.kwargs_for(impl, case, tensor=lambda a: torch.from_numpy(a).to(device))
    with torch.set_grad_enabled(grad):
        o, lse = call._split(impl, call._call(impl, case, q, k, v, **kw), impl.name)
    dq = torch.autograd.grad(o, q, do)[0] if grad else None
    return o.detach(), None if lse is None else lse.detach(), dq
