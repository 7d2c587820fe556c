"""How inputs lie in memory (flashcheck/contract/memory.py): each layout holds the same values, its
margins hold NaN, a kernel that cannot take one is told what to declare, and fit() keeps to the
declaration."""
import numpy as np
import pytest
import torch

from flashcheck import strategies as fs
from flashcheck.contract import call, implementation, load, memory
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties
X = np.arange(1 * 2 * 3 * 4, dtype=np.float64).reshape(1, 2, 3, 4)


@pytest.mark.parametrize("kind", sorted(memory.MEMORY))
def test_every_layout_holds_the_same_values(kind):
    t = memory.lay(torch, X, kind, device="cpu", dtype=torch.float32)
    assert t.shape == X.shape and np.array_equal(t.numpy(), X), f"{kind}: values changed"
    want = {"contiguous": (24, 12, 4, 1), "bshd": (24, 4, 8, 1), "padded": (304, 152, 8, 1), "offset": (24, 12, 4, 1),
            "broadcast": (0, 12, 4, 1), "unaligned": (42, 21, 7, 1)}[kind]
    assert t.stride() == want, f"{kind}: expected strides {want}, got {t.stride()}"
    offset = {"offset": 12, "unaligned": 61}.get(kind, 0)  # 48 bytes of float32; an odd count
    assert t.storage_offset() == offset, f"{kind}: expected storage offset {offset}, got {t.storage_offset()}"


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("kind", sorted(memory.DEFAULT))
def test_the_default_layouts_keep_pointers_and_row_strides_16_byte_aligned(kind, dtype):
    for d in (1, 3, 8, 13):
        x = np.ones((2, 1, 3, d))
        t = memory.lay(torch, x, kind, device="cpu", dtype=getattr(torch, dtype))
        size = t.element_size()
        assert t.data_ptr() % 16 == 0, f"{kind}, {dtype}, D={d}: data pointer off 16-byte alignment"
        if kind in ("padded", "offset"):
            assert t.stride(-2) * size % 16 == 0 or t.stride(-2) == d, f"{kind}, {dtype}, D={d}: row stride {t.stride(-2)}"


def test_the_unaligned_layout_is_off_alignment_and_drawn_only_where_declared():
    t = memory.lay(torch, np.ones((1, 1, 3, 8)), "unaligned", device="cpu", dtype=torch.float16)
    assert t.data_ptr() % 16 and t.stride(-2) * 2 % 16, "unaligned: expected a pointer and a row stride off alignment"
    assert fs.fit(load("sdpa-flash"), Case(memory="unaligned")).memory == "contiguous", "undeclared: not drawn"
    assert fs.fit(load("torch-tiled"), Case(memory="unaligned")).memory == "unaligned", "declared: drawn"


@pytest.mark.parametrize("kind", ["padded", "offset", "unaligned"])
def test_the_margins_around_a_view_hold_nan(kind):
    t = memory.lay(torch, X, kind, device="cpu", dtype=torch.float32)
    storage = torch.as_strided(t, (t.untyped_storage().nbytes() // 4,), (1,), 0)
    assert int(torch.isnan(storage).sum()) == storage.numel() - X.size, f"{kind}: every element outside the view is NaN"


def test_a_kernel_that_raises_on_a_layout_is_told_which_declaration_to_add():
    @implementation(name="flat-reader", register=False)
    def attention(q, k, v, *, causal=False, scale=None):
        q.view(-1)  # raises on a transposed view, as a kernel that needs contiguous input does
        return torch.zeros_like(q)

    impl = attention.__flashcheck__
    case = Case(batch=2, hq=2, hkv=2, sq=3, sk=3, d=2, dv=2, dtype="float32", memory="bshd")
    with pytest.raises(memory.LayoutRefused) as info:
        call.run(impl, case, *case.inputs()[:3])
    assert "memory='bshd'" in str(info.value) and "layouts=('contiguous', 'padded', 'offset', 'broadcast')" in \
        str(info.value), f"expected the layout and the declaration to add, got: {info.value}"


def test_fit_keeps_to_the_declared_layouts_and_to_contiguous_where_a_layout_builds_its_own_tensors():
    @implementation(name="bshd-only", layouts=("bshd",), register=False)
    def attention(q, k, v, *, causal=False, scale=None):
        return q

    assert fs.fit(attention.__flashcheck__, Case(memory="padded")).memory == "bshd"
    assert fs.fit(load("torch-tiled"), Case(memory="padded")).memory == "padded"
    for name in ("torch-tiled-varlen", "numpy-tiled"):
        assert fs.fit(load(name), Case(memory="offset")).memory == "contiguous", f"{name} builds its own inputs"


def test_out_goes_with_torch_kernels_of_the_dense_and_packed_layouts():
    from flashcheck.contract import ContractError

    def f(q, k, v, *, causal=False, scale=None, out=None):
        return q

    with pytest.raises(ContractError, match="out=True is checked for torch kernels"):
        implementation(name="x", kvcache=True, out=True, register=False)(f)
    with pytest.raises(ContractError, match="out=True is checked for torch kernels"):
        implementation(name="x", framework="numpy", out=True, register=False)(f)


def test_a_write_past_out_names_the_side_and_how_far():
    """The guard bands around out=: the message says which side changed and how near to out=."""
    impl = load("mutants/outputs.py:writes_one_row_past_out")
    case = Case(hq=2, sq=5, sk=7, d=4, dv=3, dtype="float32")
    with pytest.raises(AssertionError, match=r"wrote past its output: 3 of the 64 elements after out= changed, "
                                             r"the nearest 1 element\(s\) after it"):
        call.run(impl, case, *case.inputs()[:3])
    good = call.run(load("mutants/outputs.py:correct"), case, *case.inputs()[:3])
    assert good.o.shape == (1, 2, 5, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA, which this machine lacks")
def test_what_a_kernel_allocates_on_cuda_after_priming_starts_as_nan():
    """Both pools of the caching allocator: a small request (from a 2 MiB segment) and a large one, and
    a small one that fits a hole left by a freed tensor between live ones (in the gpu lane, after a few
    hundred tests in one process, a request of 2000 bytes got an earlier test's values from one)."""
    keep = torch.ones(3, device="cuda")  # a live block stays as it is
    row = [torch.full((1000,), 0.5, device="cuda", dtype=torch.float16) for _ in range(8)]
    live = row[1::2]  # the freed ones leave holes of 2048 bytes in a segment that stays in use
    del row
    memory.prime_cuda_cache(torch, "cuda", 4 << 20)
    holes = [torch.empty(1000, device="cuda", dtype=torch.float16) for _ in range(4)]
    small, large = torch.empty(1000, device="cuda", dtype=torch.float16), torch.empty(1 << 20, device="cuda")
    for name, t in [("a hole's", h) for h in holes] + [("a small", small), ("a large", large)]:
        assert t.isnan().all(), (f"expected {name} fresh allocation to hold NaN, got "
                                 f"{int((~t.isnan()).sum())} of {t.numel()} entries that are not")
    assert (keep == 1).all() and all((t == 0.5).all() for t in live), "priming changed a live tensor"


def test_priming_the_allocator_leaves_cpu_alone():
    memory.prime_cuda_cache(torch, "cpu", 1 << 20)  # CPU allocations are poisoned by memory.poisoned instead
