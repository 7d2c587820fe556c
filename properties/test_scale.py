"""Giant cases on CUDA (strategies/scale.py): past 65535 batch x heads, past 2^31 elements, 131072 tokens.

The inputs are drawn on the device (a host copy of 2^31 float64 values would not fit); the truth is
the sampled oracle's (flashcheck/oracle/sampled.py) on a few whole heads read back from the device.
A head of at most WHOLE_HEAD scores is judged whole: every row of O, LSE and dQ, and every key of dK
and dV. A longer head (the ``long`` target's 131072 x 131072) is judged at its first and last rows,
rows on both sides of drawn tile boundaries, and random rows, for O, LSE and dQ alone: a key of dK
or dV needs every row's softmax, O(Sq x Sk x D) on the host whichever keys are sampled.
"""
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from flashcheck import strategies as fs
from flashcheck.contract import call
from flashcheck.oracle import sampled, yardstick
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import scale

pytestmark = [pytest.mark.properties, pytest.mark.requires("cuda", "dense")]
HEADS = 4  # judged per case: the first, the last, and two drawn
WHOLE_HEAD = 2**21  # scores per head judged whole on the host (1448 x 1448: about a second each)


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


def rows_judged(case: Case, seed: int) -> np.ndarray:
    """Every row of a head of at most WHOLE_HEAD scores; else sampled.rows_to_check's (the first and
    last query tile, 8 drawn tile boundaries, 8 random rows)."""
    if case.sq * case.sk <= WHOLE_HEAD:
        return np.arange(case.sq)
    return sampled.rows_to_check(case, block=case.block_q, random_rows=8, seed=seed, boundaries=8)


def judge_heads(impl, case: Case, tensors, results: dict, seed: int):
    """Each of heads_to_check's heads as a case of its own (B = 1, its inputs read back), at
    rows_judged's rows; ``results``: run_on's, by name. O, LSE and dQ are judged on the query head;
    dK and dV, where its rows are whole, on its kv head with every query head of its group."""
    group = case.hq // case.hkv
    one = case.replace(batch=1, hq=1, hkv=1)
    rows = rows_judged(one, seed)
    for b, h in heads_to_check(case, seed):
        who = f"{impl.name} at batch {b}, head {h} of {case!r}"
        _judge(one, rows, tensors, results, sampled.NAMES, b, range(h, h + 1), h // group, who)
        if len(rows) == one.sq:
            g = h // group
            _judge(case.replace(batch=1, hq=group, hkv=1), rows, tensors, results, sampled.KEY_NAMES, b,
                   range(g * group, (g + 1) * group), g, who + f", its kv head {g}")


def _judge(part: Case, rows, tensors, results: dict, names, b: int, heads: range, kv: int, who: str):
    """``names`` of ``results`` at batch ``b`` (query ``heads`` on kv head ``kv``), against the truth on
    those heads' inputs read back from the device."""
    def host(t, at):
        return np.asarray(t[b, at].detach().double().cpu())[None]

    qh, kvh = slice(heads.start, heads.stop), slice(kv, kv + 1)
    inputs = tuple(host(t, at) for t, at in zip(tensors, (qh, kvh, kvh, qh)))
    naive = None
    if part.precision == "naive" and len(rows) < part.sq:  # the rule's yardstick, on the device, row chunk by chunk
        import torch

        naive = yardstick.naive_terms(torch, part, *(t[b, at] for t, at in zip(tensors, (qh, kv, kv, qh))))
    parts = sampled.parts(part, rows, inputs=inputs, naive=naive)
    for name in names:
        got = results.get(name)
        if got is not None:
            at = host(got, kvh) if name in sampled.KEY_NAMES else host(got, qh)[:, :, rows]
            sampled.compare(part, name, at, rows, who=who, inputs=inputs, parts_=parts)


@pytest.mark.parametrize("target", scale.targets())  # each target a test of its own: none is left undrawn
@given(causal=st.sampled_from((None, "bottom_right", "top_left")), seed=st.integers(0, 2**16), data=st.data())
def test_giant_cases_match_float64_on_sampled_heads_and_rows(impl, target, causal, seed, data):
    import torch

    from flashcheck.strategies import context

    context.current().no_reproducer = ("a giant case's inputs are drawn on the device from the test's seed (see the "
                                       "note): rerun this property with the same --hypothesis-seed")
    half = [t for t in impl.dtypes if t in ("float16", "bfloat16")]
    tile = st.sampled_from(scale.tiles(impl))
    case = Case(**scale.TARGETS[target], causal=causal, dtype=half[0] if half else impl.dtypes[0],
                block_q=data.draw(tile, label="block_q"), block_k=data.draw(tile, label="block_k"))
    case = fs.fit(impl, case)
    free, _ = torch.cuda.mem_get_info()
    case = scale.fitted_to_memory(case, int(free * 0.8), impl.has_backward)
    while True:  # the kernel's own workspace (a dense backend's scores) can still outgrow the estimate
        tensors = device_inputs(torch, case, seed)
        try:
            results = run_on(torch, impl, case, tensors, "cuda")
            break
        except torch.cuda.OutOfMemoryError:
            smaller = scale.halved(case)
            if smaller is None:
                raise
        del tensors
        torch.cuda.empty_cache()
        note(f"{impl.name} ran out of device memory at {case!r}: halved")
        case = smaller
    note(f"target {target!r}: {case!r}, {case.batch * case.hq * case.sq * case.d:.3g} elements in q, "
         f"drawn on the device with torch.Generator seed {seed}")
    judge_heads(impl, case, tensors, results, seed)


def run_on(torch, impl, case: Case, tensors, device) -> dict:
    """O, LSE, dQ, dK and dV of the call on the device tensors (q, k, v, dO), by name; None for LSE
    where the kernel does not return it, and for the gradients without a backward."""
    q, k, v, do = tensors
    grad = impl.has_backward
    for t in (q, k, v):
        t.requires_grad_(grad)
    kw = call.kwargs_for(impl, case, tensor=lambda a: torch.from_numpy(a).to(device))
    with torch.set_grad_enabled(grad):
        o, lse = call._split(impl, call._call(impl, case, q, k, v, **kw), impl.name)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do) if grad else (None,) * 3
    return {"o": o.detach(), "lse": None if lse is None else lse.detach(), "dq": dq, "dk": dk, "dv": dv}
