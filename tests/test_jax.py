"""The JAX built-ins (impls/jax_attn.py): unavailable with their reason without jax, and fed by DLPack.

Their kernel properties run with ``pytest -m properties --impl jax-xla`` where jax is installed;
CI has no jax, so the first test is the one that runs there.
"""
import sys

import pytest

from flashcheck.impls import builtin

pytestmark = pytest.mark.properties
JAX = ("flashcheck.impls.jax_attn", ["jax-xla", "jax-cudnn", "jax-pallas"])


def test_without_jax_the_jax_builtins_are_unavailable_and_say_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # "import jax" now raises ImportError, as where it is missing
    monkeypatch.delitem(sys.modules, JAX[0], raising=False)  # imported afresh, restored afterwards
    names, unavailable = builtin.load_modules([JAX])
    assert names == [], f"expected no jax built-in to load without jax, got {names}"
    assert sorted(unavailable) == sorted(JAX[1]), f"expected all three unavailable, got {sorted(unavailable)}"
    for name, why in unavailable.items():
        assert "needs jax" in why and "pip install" in why, f"{name}: expected the reason to name jax, got {why!r}"


def test_the_jax_builtins_are_listed_as_builtins():
    assert JAX in builtin.MODULES, f"expected {JAX} in impls/builtin.py MODULES"


def test_torch_tensors_reach_jax_without_a_copy():
    pytest.importorskip("jax")
    import torch

    from flashcheck.impls import jax_attn

    t = torch.randn(2, 3, 5, 4, dtype=torch.bfloat16)
    a = jax_attn._to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr(), "expected DLPack to share the tensor's buffer (zero copy)"
    back = jax_attn._to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == t.dtype, "expected the way back to share it too"
    view = t.transpose(1, 2)  # jax takes compact strides only: a view is made contiguous first
    assert torch.equal(jax_attn._to_torch(jax_attn._to_jax(view)), view), "expected a view to arrive unchanged"
