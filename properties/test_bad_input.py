"""Bad input raises an error that names the problem; it never returns an answer.

Each test starts from a case the implementation declares it runs, checks that the
implementation accepts it, and then changes exactly one thing: a refusal then can only be
about that thing, and a kernel that refuses everything cannot pass.
"""
import numpy as np
import pytest

from flashcheck import strategies as fs
from flashcheck.contract import call
from flashcheck.strategies import AttentionCase as Case

pytestmark = [pytest.mark.properties, pytest.mark.input_validation, pytest.mark.requires("dense")]

# Our own implementations must also say what is wrong; external ones must at least refuse.
OWN = ("numpy-dense", "numpy-tiled", "torch-tiled", "triton-fused")
BASE = Case(batch=1, hq=2, hkv=1, sq=3, sk=4, d=4, dv=4, block_q=16, block_k=16)


def valid_case(impl):
    """BASE, or a near variant of it, fitted to everything ``impl`` declares (supports included)."""
    variants = [BASE, BASE.replace(sq=4), *(BASE.replace(causal=a) for a in impl.causal),
                BASE.replace(sq=8, sk=8, d=8, dv=8), BASE.replace(hq=1)]
    for candidate in variants:
        case, why = fs.draw.supported(impl, candidate)
        if case is not None:
            return case
    pytest.skip(f"{impl.name}: its supports() refuses every starting case tried near {BASE!r}: {why}")


def _call(impl, case, q, k, v, **override):
    """Call the implementation directly on (possibly malformed) float64 arrays of the case's dtype."""
    kw = {**call.kwargs_for(impl, case), **override}
    if impl.framework == "numpy":
        return impl.fn(*(x.astype(case.dtype) for x in (q, k, v)), **kw)
    import torch

    dev = call.device_for(impl)
    return impl.fn(*(torch.from_numpy(x).to(dev, getattr(torch, case.dtype)) for x in (q, k, v)), **kw)


_REFUSED: dict = {}  # (implementation, case) -> the refusal of that valid case, or None: one call each


def accepted(impl, case):
    """The unchanged case must run, or a refusal of the changed one proves nothing."""
    q, k, v, _ = case.inputs()
    if (impl.name, case) not in _REFUSED:
        try:
            _call(impl, case, q, k, v)
            _REFUSED[impl.name, case] = None
        except Exception as exc:
            _REFUSED[impl.name, case] = f"{type(exc).__name__}: {exc}"
    if _REFUSED[impl.name, case]:
        pytest.fail(f"{impl.name} refused a case inside its own declarations, so its refusal of bad input "
                    f"says nothing: {_REFUSED[impl.name, case]}\n  case: {case!r}")
    return q, k, v


def _other(n, allowed, far=()):
    """A value other than ``n`` that ``allowed`` accepts (the nearest), else n + 1."""
    for step in range(1, 257):
        for m in (n + step, n - step):
            if m >= 1 and m not in far and allowed(m):
                return m
    return n + 1


def _length_ok(impl, case):
    return lambda n: fs.draw.within(impl, case.replace(sk=n, sq=n if impl.equal_lengths else case.sq)).sk == n


def _resize(x, n, axis):
    """``x`` with its ``axis`` cut or cyclically extended to length ``n``."""
    return np.take(x, np.arange(n) % x.shape[axis], axis=axis)


# name -> (change exactly one thing, a word our own implementations must use)
BAD_SHAPES = {
    "rank": (lambda impl, c, q, k, v: (q[0], k[0], v[0]), "rank"),
    "batch": (lambda impl, c, q, k, v: (q, _resize(k, 2 * c.batch, 0), _resize(v, 2 * c.batch, 0)), "batch"),
    "heads": (lambda impl, c, q, k, v: (q, k, _resize(v, 2 * c.hkv, 1)), "heads"),
    "head_dim": (lambda impl, c, q, k, v: (q, _resize(k, _other(c.d, impl.head_dim_ok), 3), v), "head dim"),
    "kv_length": (lambda impl, c, q, k, v: (q, k, _resize(v, _other(c.sk, _length_ok(impl, c)), 2)), "length"),
}


@pytest.mark.parametrize("bad", sorted(BAD_SHAPES))
def test_malformed_shapes_raise_a_named_error(impl, bad):
    case = valid_case(impl)
    make, word = BAD_SHAPES[bad]
    q, k, v = make(impl, case, *accepted(impl, case))
    with pytest.raises(Exception) as info:
        _call(impl, case, q, k, v)
    if impl.name in OWN:
        assert word in str(info.value), f"{impl.name}: expected the error to name the {word}, got: {info.value}"


def test_query_heads_not_a_multiple_of_kv_heads_is_refused(impl):
    case = valid_case(impl)
    q, k, v = accepted(impl, case)
    hkv = case.hkv + 1 if case.hq % (case.hkv + 1) else case.hkv + 2  # query heads stay as they are
    with pytest.raises(Exception) as info:
        _call(impl, case, q, _resize(k, hkv, 1), _resize(v, hkv, 1))
    if impl.name in OWN:
        assert "multiple" in str(info.value), f"{impl.name}: expected 'multiple' in the error, got: {info.value}"


def test_unsupported_dtype_is_refused(impl):
    case = valid_case(impl)
    q, k, v = accepted(impl, case)
    if impl.framework == "numpy":
        with pytest.raises(TypeError, match="dtype"):
            impl.fn(*(x.astype("float16") for x in (q, k, v)), **call.kwargs_for(impl, case))
        return
    import torch

    with pytest.raises(Exception) as info:
        impl.fn(*(torch.from_numpy(x).to(call.device_for(impl), torch.int32) for x in (q, k, v)),
                **call.kwargs_for(impl, case))
    if impl.name in OWN:
        assert "dtype" in str(info.value), f"{impl.name}: expected 'dtype' in the error, got: {info.value}"


@pytest.mark.requires("blocks")
@pytest.mark.parametrize("block", [0, -1])
def test_block_size_below_one_is_refused(impl, block):
    if isinstance(impl.blocks, tuple):
        pytest.skip(f"{impl.name} takes block sizes from {impl.blocks}")
    case = valid_case(impl)
    with pytest.raises(ValueError, match="block"):
        _call(impl, case, *accepted(impl, case), block_q=block)


def test_inputs_on_an_undeclared_device_are_refused(impl):
    import torch

    if impl.framework == "numpy" or "cuda" not in impl.devices or "cpu" in impl.devices:
        pytest.skip(f"{impl.name} accepts every device it can be given here")
    case = valid_case(impl)
    accepted(impl, case)
    q, k, v, _ = case.inputs()
    # Any error is a refusal: every framework words it its own way (Triton: "cannot be accessed from
    # Triton (cpu tensor?)"; JAX: "... not found for platform cpu"; Pallas: "Only interpret mode is
    # supported on CPU backend"). An answer is what must not come back.
    try:
        impl.fn(*(torch.from_numpy(x).to(getattr(torch, case.dtype)) for x in (q, k, v)),
                **call.kwargs_for(impl, case))
    except Exception as exc:
        if impl.name in OWN:
            assert "device" in str(exc), f"{impl.name}: expected the error to name the device, got: {exc}"
        return
    pytest.fail(f"{impl.name} declares devices={impl.devices!r} but did not raise for inputs on the cpu: it "
                f"returned a result\n  case: {case!r}")
