"""Bad input raises an error that names the problem; it never returns an answer."""
import numpy as np
import pytest

from flashcheck.impls import call
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.properties

# Our own implementations must also say what is wrong; external ones must at least refuse.
OWN = ("numpy-dense", "numpy-tiled", "torch-tiled", "triton-fused")
GOOD = Case(batch=1, hq=2, hkv=1, sq=3, sk=4, d=4, dv=4, block_q=16, block_k=16)


def _arrays(case):
    return case.inputs()[:3]


def _call(impl, case, q, k, v, **override):
    """Call the implementation directly on (possibly malformed) arrays."""
    dtype = case.dtype if case.dtype in impl.dtypes else impl.dtypes[0]
    kw = {**call.kwargs_for(impl, case), **override}
    if impl.framework == "numpy":
        return impl.fn(*(x.astype(dtype) for x in (q, k, v)), **kw)
    import torch

    dev = call.device_for(impl)
    return impl.fn(*(torch.from_numpy(x).to(dev, getattr(torch, dtype)) for x in (q, k, v)), **kw)


BAD_SHAPES = {
    "rank": (lambda q, k, v: (q[0], k[0], v[0]), "rank"),
    "batch": (lambda q, k, v: (q, np.concatenate([k, k]), np.concatenate([v, v])), "batch"),
    "heads": (lambda q, k, v: (q[:, :1], np.concatenate([k, k], 1), np.concatenate([v, v], 1)), "heads"),
    "head_dim": (lambda q, k, v: (q, k[..., :2], v), "head dim"),
    "kv_length": (lambda q, k, v: (q, k, v[:, :, :2]), "length"),
}


@pytest.mark.parametrize("bad", sorted(BAD_SHAPES))
def test_malformed_shapes_raise_a_named_error(impl, bad):
    make, word = BAD_SHAPES[bad]
    q, k, v = make(*_arrays(GOOD))
    with pytest.raises(Exception) as info:
        _call(impl, GOOD, q, k, v)
    if impl.name in OWN:
        assert word in str(info.value), f"{impl.name}: expected the error to name the {word}, got: {info.value}"


def test_query_heads_not_a_multiple_of_kv_heads_is_refused(impl):
    q, k, v = _arrays(Case(hq=3, hkv=1, sq=2, sk=2, d=2, dv=2))
    with pytest.raises(Exception) as info:
        _call(impl, GOOD, q, np.concatenate([k, k], 1), np.concatenate([v, v], 1))
    if impl.name in OWN:
        assert "multiple" in str(info.value), f"{impl.name}: expected 'multiple' in the error, got: {info.value}"


def test_unsupported_dtype_is_refused(impl):
    q, k, v = _arrays(GOOD)
    if impl.framework == "numpy":
        bad = "float16"
        with pytest.raises(TypeError, match="dtype"):
            impl.fn(*(x.astype(bad) for x in (q, k, v)), **call.kwargs_for(impl, GOOD))
        return
    import torch

    with pytest.raises(Exception) as info:
        impl.fn(*(torch.from_numpy(x).to(call.device_for(impl), torch.int32) for x in (q, k, v)),
                **call.kwargs_for(impl, GOOD))
    if impl.name in OWN:
        assert "dtype" in str(info.value), f"{impl.name}: expected 'dtype' in the error, got: {info.value}"


@pytest.mark.requires("blocks")
@pytest.mark.parametrize("block", [0, -1])
def test_block_size_below_one_is_refused(impl, block):
    if isinstance(impl.blocks, tuple):
        pytest.skip(f"{impl.name} takes block sizes from {impl.blocks}")
    with pytest.raises(ValueError, match="block"):
        _call(impl, GOOD, *_arrays(GOOD), block_q=block)


def test_inputs_on_an_undeclared_device_are_refused(impl):
    import torch

    if impl.framework == "numpy" or "cuda" not in impl.devices or "cpu" in impl.devices:
        pytest.skip(f"{impl.name} accepts every device it can be given here")
    q, k, v = (torch.from_numpy(x).float() for x in _arrays(GOOD))
    with pytest.raises(Exception, match="(?i)cuda|device"):
        impl.fn(q, k, v, **call.kwargs_for(impl, GOOD))
