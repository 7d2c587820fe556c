"""Launch context, on CUDA: a side stream, two streams at once, a CUDA graph's replay, torch.compile
(flashcheck/contract/launch.py)."""
import pytest
from hypothesis import example, given, note

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.contract import launch
from flashcheck.contract.call import device_for
from flashcheck.strategies import AttentionCase as Case

pytestmark = [pytest.mark.properties, pytest.mark.requires("dense")]
PIN = Case(hq=4, hkv=2, sq=17, sk=33, d=16, dv=16, causal="bottom_right")  # partial tiles, GQA


def check(impl, case, res, who):
    for name in ("o", "lse"):
        if getattr(res, name) is not None:
            orc.compare(case, name, getattr(res, name), who=f"{impl.name} ({who})")


@pytest.mark.requires("cuda")
@given(case=fs.cases())
@example(case=PIN)
def test_a_call_on_a_side_stream_reads_the_inputs_written_there(impl, case):
    """A kernel launched on the default stream, not the current one, reads NaN: the values land later."""
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    check(impl, case, launch.on_side_stream(impl, case, q, k, v), "called on a side stream, inputs written there")


@pytest.mark.requires("cuda")
@given(case=fs.cases())
@example(case=PIN)
def test_two_calls_at_once_on_two_streams_each_give_their_own_attention(impl, case):
    """Two requests served concurrently: a workspace or output buffer the calls share hands one the other's."""
    case = fs.fit(impl, case)
    other = case.replace(seed=case.seed + 1)
    note(f"seed {case.seed} on one stream, seed {other.seed} on another, launched back to back")
    for c, res in zip((case, other), launch.on_two_streams(impl, case, case.inputs()[:3], other.inputs()[:3])):
        check(impl, c, res, f"one of two calls at once on two streams (seeds {case.seed} and {other.seed})")


@pytest.mark.requires("cuda", "cuda_graphs")
@given(case=fs.cases())
@example(case=PIN)
def test_a_cuda_graph_replayed_on_new_values_gives_their_attention(impl, case):
    case = fs.fit(impl, case)
    other = case.replace(seed=case.seed + 1)
    note(f"captured on seed {case.seed}, replayed on seed {other.seed}")
    first, second = case.inputs()[:3], other.inputs()[:3]
    check(impl, other, launch.replayed(impl, case, first, second),
          "a CUDA graph captured on other values, replayed after writing these into its inputs")


@pytest.mark.requires("compile")
@given(case=fs.cases())
@example(case=PIN)
def test_the_call_under_torch_compile_matches_dense_float64(impl, case):
    case = fs.fit(impl, case)
    q, k, v, _ = case.inputs()
    check(impl, case, launch.compiled(impl, case, q, k, v, device=device_for(impl)),
          "under torch.compile(fullgraph=False)")
