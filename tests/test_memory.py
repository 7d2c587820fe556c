"""torch tiled forward + backward memory grows linearly with sequence length, measured.

CPU: peak RSS of forward + backward in a fresh process per length (bench/memory.py says how).
CUDA: torch.cuda.max_memory_allocated around the same call.
Both assert that at Sq = Sk = 8192 the peak extra memory is under 10% of one float32 Sq x Sk
matrix (256 MiB) and that doubling the length less than triples it (quadratic would be x4).
"""
import pytest

pytestmark = pytest.mark.properties

BUDGET = 0.10  # of one float32 Sq x Sk matrix, at the longest length
GROWTH = 3.0  # per doubling: linear is 2 (less with fixed overheads), quadratic 4


def _check(rows, where):
    print(f"\ntorch-tiled forward + backward peak extra memory ({where}), B = H = 1, D = 64, float32:")
    for n, peak in rows:
        print(f"  Sq = Sk = {n:5d}: {peak / 2**20:7.1f} MiB = {peak / (4 * n * n):.3f} x one Sq x Sk fp32 matrix")
    (n_max, peak_max) = rows[-1]
    assert peak_max < BUDGET * 4 * n_max * n_max, (
        f"peak extra memory at {n_max} is {peak_max / 2**20:.1f} MiB, over {BUDGET:.0%} of an Sq x Sk matrix")
    for (n0, p0), (n1, p1) in zip(rows, rows[1:]):
        assert p1 < GROWTH * p0, f"going from {n0} to {n1} multiplied peak memory by {p1 / p0:.2f} (>= {GROWTH})"


def test_cpu_forward_backward_memory_is_linear():  # ~7 s on an idle 2-core machine: four fresh processes
    from bench.memory import LENGTHS, measure  # the checkout's instrument (not installed with the package)

    rows = [(n, measure("torch-tiled", n)["peak_extra"]) for n in LENGTHS]
    _check(rows, "CPU, peak RSS")


@pytest.mark.slow
def test_cpu_instrument_sees_quadratic_memory():
    """The control: the same measurement must see SDPA math's Sq x Sk matrices."""
    from bench.memory import measure

    small, large = (measure("sdpa-math", n)["peak_extra"] for n in (1024, 2048))
    print(f"\nsdpa-math peak extra: {small / 2**20:.1f} MiB at 1024, {large / 2**20:.1f} MiB at 2048")
    assert large >= 4 * 2048 * 2048, "the instrument missed a dense Sq x Sk float32 matrix"
    assert large > GROWTH * small, "the instrument did not see quadratic growth"


@pytest.mark.gpu
def test_cuda_forward_backward_memory_is_linear():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from bench.memory import LENGTHS
    from flashcheck.impls.torch_tiled import attention

    rows = []
    for n in LENGTHS:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(1, 1, n, 64, device="cuda", generator=g) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        attention(q, k, v)[0].backward(do)
        torch.cuda.synchronize()
        rows.append((n, torch.cuda.max_memory_allocated() - before))
        del q, k, v, do
    _check(rows, "CUDA, max_memory_allocated")
