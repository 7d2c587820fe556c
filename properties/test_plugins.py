"""The plug-in path: loading by file and module, repeated --impl, FLASHCHECK_IMPL, clear errors."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashcheck import ContractError, implementation, load

pytestmark = pytest.mark.properties
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _in_the_checkout(monkeypatch):
    """Specs below are relative to the checkout, wherever pytest was started."""
    monkeypatch.chdir(ROOT)


def _pytest(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if k != "FLASHCHECK_IMPL"} | (env or {})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=300)


def test_load_by_file_and_by_module_give_the_declared_record():
    by_file = load("examples/numpy_rowwise.py:attention")
    by_module = load("flashcheck.impls.numpy_ref:tiled_forward")
    assert by_file.name == "numpy-rowwise" and by_file.framework == "numpy"
    assert by_module.name == "numpy-tiled" and by_module.blocks == "any"
    assert load("numpy-dense").name == "numpy-dense"  # a built-in by its name


@pytest.mark.parametrize("spec,words", [
    ("nowhere/missing.py:attention", "no such file"),
    ("examples/numpy_rowwise.py:nope", "has no attribute 'nope'"),
    ("flashcheck.impls.checks:check_inputs", "not decorated"),
    ("no_such_module_xyz:f", "cannot import module"),
    ("examples/numpy_rowwise.py", "expected FILE.py:function"),
    ("no-such-builtin", "not a built-in implementation"),
])
def test_a_bad_impl_spec_gets_an_error_naming_it(spec, words):
    with pytest.raises(ContractError, match=words):
        load(spec)


@pytest.mark.parametrize("kw,words", [
    (dict(causal="diagonal"), "unknown causal alignment"),
    (dict(dtypes=("float8",)), "unknown dtype"),
    (dict(devices=("tpu",)), "unknown device"),
    (dict(framework="jax"), "framework must be"),
    (dict(framework="numpy", backward=True), "callable"),
    (dict(blocks=(0, 16)), "blocks must be"),
    (dict(head_dims=(0, 8)), "head_dims"),
    (dict(seq_multiple=0), "seq_multiple"),
    (dict(name=""), "non-empty"),
])
def test_a_malformed_declaration_is_refused_with_its_reason(kw, words):
    with pytest.raises(ContractError, match=words):
        implementation(**{"name": "x", **kw}, register=False)(lambda q, k, v, **_: q)


def test_a_plugin_declaring_nothing_runs_with_the_defaults():
    @implementation(name="bare", register=False)
    def bare(q, k, v, *, causal=False, scale=None):
        return q

    record = bare.__flashcheck__
    assert record.dtypes == ("float32",) and record.causal == ("bottom_right",) and not record.has_backward


def test_repeated_impl_and_the_environment_select_the_same_implementations():
    args = ["-m", "properties", "-q", "--collect-only", "properties/test_forward.py"]
    both = _pytest(*args, "--impl", "examples/numpy_rowwise.py:attention", "--impl", "flashcheck.impls.numpy_ref:dense_forward")
    env = _pytest(*args, env={"FLASHCHECK_IMPL": "examples/numpy_rowwise.py:attention,impls.numpy_ref:dense_forward"})
    for run in (both, env):
        assert "[numpy-rowwise]" in run.stdout and "[numpy-dense]" in run.stdout, run.stdout[-2000:]
        assert "[torch-tiled]" not in run.stdout, "built-ins must not run when implementations are named"


def test_a_bad_impl_stops_pytest_with_one_clear_line():
    run = _pytest("-m", "properties", "--collect-only", "--impl", "nowhere.py:f")
    assert run.returncode != 0 and "no such file" in run.stderr, run.stderr[-2000:]
