"""The plug-in path: loading by file and module, repeated --impl, FLASHCHECK_IMPL, clear errors."""
import os
import sys
from pathlib import Path

import pytest

from flashcheck.contract import ContractError, KnownIssue, builtins, implementation, load
from flashcheck.impls import builtin
from flashcheck.strategies import context
from mutants import forked

pytestmark = pytest.mark.properties
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _in_the_checkout(monkeypatch):
    """Specs below are relative to the checkout, wherever pytest was started."""
    monkeypatch.chdir(ROOT)


def _pytest(*args, env=None):
    """A whole pytest run in a fork of the warm server (mutants/forked.py); stdout holds stderr too."""
    full_env = {k: v for k, v in os.environ.items() if k != "FLASHCHECK_IMPL"} | (env or {})
    return forked.pytest_run(["-p", "no:cacheprovider", *args], cwd=ROOT, env=full_env, timeout=300)


def test_load_by_file_and_by_module_give_the_declared_record():
    by_file = load("examples/numpy_rowwise.py:attention")
    by_module = load("flashcheck.impls.numpy_ref:tiled_forward")
    assert by_file.name == "numpy-rowwise" and by_file.framework == "numpy"
    assert by_module.name == "numpy-tiled" and by_module.blocks == "any"
    assert load("numpy-dense").name == "numpy-dense"  # a built-in by its name


SIBLING_PLUGIN = """
from flashcheck import implementation
from {helper} import attend

@implementation(name="{name}", register=False)
def attention(q, k, v, *, causal=False, scale=None):
    return attend(q, k, v)
"""


def test_a_plugin_imports_its_sibling_files_by_path_from_any_directory_and_by_module_from_its_own(
        tmp_path, monkeypatch):
    kernel, elsewhere = tmp_path / "kernel", tmp_path / "elsewhere"
    kernel.mkdir(), elsewhere.mkdir()
    (kernel / "sibling_kernel_a.py").write_text("def attend(q, k, v):\n    return q\n")
    (kernel / "sibling_kernel_b.py").write_text("def attend(q, k, v):\n    return q\n")
    (kernel / "plug_by_path.py").write_text(SIBLING_PLUGIN.format(helper="sibling_kernel_a", name="by-path"))
    (kernel / "plug_by_module.py").write_text(SIBLING_PLUGIN.format(helper="sibling_kernel_b", name="by-module"))
    cwd = str(Path.cwd())
    # as the pytest command starts: neither the current directory nor the plug-in's folder on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", cwd, str(kernel))])
    monkeypatch.chdir(elsewhere)
    assert load(f"{kernel}/plug_by_path.py:attention").name == "by-path"
    monkeypatch.chdir(kernel)
    assert load("plug_by_module:attention").name == "by-module"
    for name in ("sibling_kernel_a", "sibling_kernel_b", "plug_by_module"):
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.parametrize("spec,words", [
    ("nowhere/missing.py:attention", "no such file"),
    ("examples/numpy_rowwise.py:nope", "has no attribute 'nope'"),
    ("flashcheck.contract.checks:check_inputs", "not decorated"),
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
    (dict(tiles=(32,)), "tiles must be"),
    (dict(tiles=(32, 0)), "tiles must be"),
    (dict(tiles=(32, 48), blocks="any"), "not both"),
    (dict(head_dims=(0, 8)), "head_dims"),
    (dict(seq_multiple=0), "seq_multiple"),
    (dict(name=""), "non-empty"),
    (dict(head_dims={0, 16}), "head_dims"),
    (dict(head_dims=range(0)), "head_dims"),
    (dict(min_seq=0), "min_seq"),
    (dict(min_seq=20, max_seq=16), "min_seq"),
    (dict(min_seq=5, max_seq=7, seq_multiple=8), "no length is a multiple"),
    (dict(causal=None, causal_only=True), "causal_only"),
    (dict(supports="short ones"), "supports must be a callable"),
    (dict(known_issues=[KnownIssue("x", lambda c: True, {}, failure="(")]), "failure must be a regex"),
])
def test_a_malformed_declaration_is_refused_with_its_reason(kw, words):
    with pytest.raises(ContractError, match=words):
        implementation(**{"name": "x", **kw}, register=False)(lambda q, k, v, **_: q)


def _issue(witness, applies=lambda c: True):
    return KnownIssue("x", applies, witness, failure="nan")


# (declaration, witness, words naming the declaration the witness breaks)
OUTSIDE = [
    (dict(dtypes=("float32",)), dict(), r"dtype 'float64' is not in dtypes=\('float32',\)"),
    (dict(causal="top_left"), dict(causal="bottom_right"), r"causal 'bottom_right' is not in causal="),
    (dict(causal_only=True), dict(causal=None), "causal_only"),
    (dict(gqa=False), dict(hq=2, hkv=1), "gqa=False"),
    (dict(head_dims=(16, 128)), dict(d=16, dv=8), r"dv=8 is outside head_dims=\(16, 128\)"),
    (dict(head_dims={16, 32}), dict(d=24, dv=16), r"d=24 is outside head_dims=\[16, 32\]"),
    (dict(equal_head_dims=True), dict(d=2, dv=3), "equal_head_dims"),
    (dict(seq_multiple=16), dict(sq=16, sk=20), "sk=20 is not a multiple of seq_multiple=16"),
    (dict(min_seq=2), dict(sq=1, sk=2), "sq=1 is below min_seq=2"),
    (dict(max_seq=8), dict(sk=9), "sk=9 is above max_seq=8"),
    (dict(equal_lengths=True), dict(sq=2, sk=3), "equal_lengths"),
    (dict(masked_rows=False), dict(sq=3, sk=1, causal="bottom_right"), "masked_rows=False"),
    (dict(blocks=(32, 64)), dict(block_q=32), r"block_k=16 is not in blocks=\(32, 64\)"),
    (dict(scale_arg=False), dict(scale=0.0), "scale_arg=False"),
    (dict(), dict(softcap=1e6), "softcap is on, but it does not declare softcap=True"),
    (dict(precision="naive"), dict(precision="fused"), "precision='fused', but it declares precision='naive'"),
    (dict(supports=lambda c: c.sk > 1 or "one key is not supported"), dict(), "one key is not supported"),
    (dict(), dict(seq=3), r"names \['seq'\], which are not AttentionCase fields"),
    (dict(), dict(hq=3, hkv=2), "not a valid case: hq"),
]


@pytest.mark.parametrize("kw,witness,words", OUTSIDE, ids=[w for _, _, w in OUTSIDE])
def test_a_known_issue_whose_witness_lies_outside_the_declaration_is_refused_naming_it(kw, witness, words):
    with pytest.raises(ContractError, match=words) as info:
        implementation(name="x", **{"dtypes": ("float64",), **kw}, known_issues=[_issue(witness)],
                       register=False)(lambda q, k, v, **_: q)
    assert "known issue 'x': its witness" in str(info.value), str(info.value)


def test_a_known_issue_whose_witness_its_own_predicate_rejects_is_refused():
    with pytest.raises(ContractError, match=r"applies\(\) is False"):
        implementation(name="x", dtypes=("float64",), known_issues=[_issue(dict(sk=2), applies=lambda c: c.sk == 1)],
                       register=False)(lambda q, k, v, **_: q)


def test_a_known_issue_whose_predicate_raises_on_its_witness_is_refused():
    with pytest.raises(ContractError, match=r"its applies\(\) raised on its witness .*ZeroDivisionError"):
        implementation(name="x", dtypes=("float64",), known_issues=[_issue(dict(), applies=lambda c: 1 / 0)],
                       register=False)(lambda q, k, v, **_: q)


def test_a_witness_inside_the_declaration_loads_and_is_judged_by_the_kernel_s_precision():
    from flashcheck.contract import capabilities

    record = implementation(name="x", dtypes=("float16",), causal="top_left", head_dims=(8, 8), precision="naive",
                            softcap=True, known_issues=[_issue(dict(d=8, dv=8, dtype="float16", softcap=2.0))],
                            register=False)(lambda q, k, v, **_: q).__flashcheck__
    case = capabilities.witness_case(record, record.known_issues[0])
    assert case.precision == "naive" and case.softcap == 2.0, case


AGREE = [d for d in {repr(d): d for d, _, _ in OUTSIDE if "supports" not in d}.values()]


@pytest.mark.parametrize("kw", AGREE, ids=[repr(d) for d in AGREE])
def test_the_witness_check_and_the_strategies_agree_on_what_lies_inside_a_declaration(kw):
    """Two readings of one declaration: a case passes the witness check exactly when fitting leaves it as it is."""
    from itertools import product

    from flashcheck.contract import capabilities
    from flashcheck.strategies import AttentionCase, draw

    record = implementation(name="x", **{"dtypes": ("float64",), **kw}, register=False)(lambda q, k, v, **_: q)
    record = record.__flashcheck__
    grid = product(((1, 1), (3, 1), (16, 20), (16, 16)), ((16, 16), (24, 8), (2, 3)), (1, 2),
                   (None, "bottom_right", "top_left"))
    verdicts = set()
    for n, ((sq, sk), (d, dv), hkv, causal) in enumerate(grid):  # the other fields alternate along the grid
        block = (16, 32)[n % 2]
        case = AttentionCase(sq=sq, sk=sk, d=d, dv=dv, hq=2, hkv=hkv, causal=causal, block_q=block, block_k=block,
                             scale=(None, 0.0)[n // 2 % 2], dtype=("float64", "float32")[n // 4 % 2],
                             softcap=(0.0, 1e6)[n // 8 % 2], precision=record.precision)
        inside = not capabilities._witness_fields(case, record)
        assert inside == (draw.within(record, case) == case), (kw, case, capabilities._witness_fields(case, record))
        verdicts.add(inside)
    assert verdicts == {True, False}, f"the grid met only one verdict for {kw}: it tests nothing there"


def test_a_plugin_declaring_nothing_runs_with_the_defaults():
    @implementation(name="bare", register=False)
    def bare(q, k, v, *, causal=False, scale=None):
        return q

    record = bare.__flashcheck__
    assert record.dtypes == ("float32",) and record.causal == ("bottom_right",) and not record.has_backward


def _few_fixed_examples():
    from hypothesis import HealthCheck, settings

    return settings(max_examples=8, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


def _budgeted(prop, seconds):
    context.begin(budget=seconds, pins=frozenset(getattr(prop, "flashcheck_pins", ())))
    try:
        prop()
    except context.BudgetSpent:
        pass  # the plugin's pytest_pyfunc_call passes a property its budget ended
    finally:
        context.end()


def test_a_spent_time_budget_ends_a_property_after_the_cases_already_run():
    from hypothesis import given

    from flashcheck import strategies as fs

    impl = load("numpy-dense")
    ran, drawn = [], []

    @_few_fixed_examples()
    @given(fs.cases().map(lambda c: drawn.append(c) or c))
    def prop(case):
        ran.append(fs.fit(impl, case))

    _budgeted(prop, 0.0)  # spent as soon as the first generated case starts it
    assert len(ran) == 1, f"expected the first generated case alone once the budget is spent, ran {len(ran)}"
    # refused one by one, later draws went on until Hypothesis's limit of invalid ones (458 here)
    assert len(drawn) == 2, f"expected the property to end at the first draw past its budget, drew {len(drawn)}"


def test_pins_that_outlast_the_budget_still_leave_one_generated_case():
    """In the gpu lane, a property's pins (compiling kernels) can take longer than its whole budget;
    the budget then must not refuse every generated case, which Hypothesis reports as Unsatisfiable,
    and the plugin as "no case fits its declarations"."""
    import time

    from hypothesis import example, given

    from flashcheck import strategies as fs

    impl = load("numpy-dense")
    pin = fs.AttentionCase(sq=3, sk=5)
    ran = []

    @_few_fixed_examples()
    @given(fs.cases())
    @example(pin)
    def prop(case):
        ran.append(fs.fit(impl, case))
        time.sleep(0.05)  # every case outlasts the budget: the pin alone would spend it

    prop.flashcheck_pins = (pin,)
    _budgeted(prop, 0.01)
    assert ran[:1] == [pin] and len(ran) == 2, f"expected the pin, then one generated case; ran {ran}"


def test_a_case_failing_as_the_budget_ends_is_replayed_and_reported_not_called_flaky():
    """The gpu lane reported a jax-cudnn failure as "the same input gave different results": the
    budget ran out while Hypothesis replayed the failing case, and refused the replay."""
    import time

    from hypothesis import given

    from flashcheck import strategies as fs

    impl = load("numpy-dense")
    ran = []

    @_few_fixed_examples()
    @given(fs.cases())
    def prop(case):
        ran.append(fs.fit(impl, case))
        time.sleep(0.02)  # the first case outlasts the budget
        raise AssertionError("wrong everywhere")

    undo = context.watch_failures(prop)
    try:
        with pytest.raises(AssertionError, match="wrong everywhere"):
            _budgeted(prop, 0.01)
    finally:
        undo()
    assert len(ran) >= 2 and ran[-1] == ran[0], f"expected the failing case replayed as it was, ran {ran}"


def test_a_property_ended_by_its_budget_passes_with_what_it_ran():
    """Refusals right after the first generated case trip Hypothesis's filter health check: the
    gpu lane reported such properties as "no case fits its declarations" and skipped them."""
    run = _pytest("-m", "properties", "-q", "-rs", "--impl", "examples/numpy_rowwise.py:attention",
                  "properties/test_forward.py::test_output_matches_dense_float64",
                  env={"FLASHCHECK_PROPERTY_SECONDS": "0.001"})
    assert run.returncode == 0 and "1 passed" in run.stdout, (
        f"expected the property to pass on its pins and first generated case, got:\n{run.stdout[-1500:]}")


def test_repeated_impl_and_the_environment_select_the_same_implementations():
    args = ["-m", "properties", "-q", "--collect-only", "properties/test_forward.py"]
    both = _pytest(*args, "--impl", "examples/numpy_rowwise.py:attention", "--impl", "flashcheck.impls.numpy_ref:dense_forward")
    env = _pytest(*args, env={"FLASHCHECK_IMPL": "examples/numpy_rowwise.py:attention,flashcheck.impls.numpy_ref:dense_forward"})
    for run in (both, env):
        assert "[numpy-rowwise]" in run.stdout and "[numpy-dense]" in run.stdout, run.stdout[-2000:]
        assert "[torch-tiled]" not in run.stdout, "built-ins must not run when implementations are named"


def test_a_bad_impl_stops_pytest_with_one_clear_line():
    run = _pytest("-m", "properties", "--collect-only", "--impl", "nowhere.py:f")
    assert run.returncode != 0 and "no such file" in run.stdout, run.stdout[-2000:]


def test_head_dims_may_be_a_range_a_stepped_range_or_a_set():
    declare = lambda hd: implementation(name="x", head_dims=hd, register=False)(lambda q, k, v, **_: q).__flashcheck__
    assert declare((16, 64)).head_dims == (16, 64) and declare(range(16, 65)).head_dims == (16, 64)
    stepped, chosen = declare(range(8, 33, 8)), declare({16, 32, 64, 128, 256})
    assert stepped.head_dims == frozenset({8, 16, 24, 32}) and stepped.nearest_head_dim(13) == 16
    assert chosen.head_dim_ok(128) and not chosen.head_dim_ok(100) and chosen.nearest_head_dim(1) == 16


def test_a_kernel_without_a_scale_argument_is_called_without_one():
    from flashcheck.properties import helpers as ph
    from flashcheck.strategies import AttentionCase, fit

    @implementation(name="no-scale", dtypes=("float64",), scale_arg=False, register=False)
    def no_scale(q, k, v, *, causal=False):
        return numpy_free_dense(q, k, v)

    case = fit(no_scale.__flashcheck__, AttentionCase(sq=2, sk=3, d=4, dv=4, scale=0.5))
    assert case.scale is None, "a kernel that takes no scale is only drawn the default one"
    assert ph.forward(no_scale.__flashcheck__, case).o.shape == (1, 1, 2, 4)


def numpy_free_dense(q, k, v):
    import torch

    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v


ALL_BUILTINS = [n for _, names in builtin.MODULES for n in names]


@pytest.mark.parametrize("name", ALL_BUILTINS)
def test_each_builtin_implementation_loads_here_or_says_why(name):
    if name in builtin.UNAVAILABLE:
        pytest.skip(f"{name} is unavailable here: {builtin.UNAVAILABLE[name]}")
    assert name in {i.name for i in builtins()}, f"{name} neither loaded nor said why"


def test_a_builtin_by_name_imports_its_own_module_only():
    import subprocess

    code = ("import sys; from flashcheck.contract import load; load('numpy-dense'); "
            "print(sorted(m for m in sys.modules if m.startswith('flashcheck.impls.') and m != 'flashcheck.impls.builtin'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['flashcheck.impls.numpy_ref']", f"expected only numpy_ref imported, got {out.strip()}"


def test_an_unavailable_builtin_by_name_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # "import jax" now raises ImportError, as where it is missing
    monkeypatch.delitem(sys.modules, "flashcheck.impls.jax_attn", raising=False)
    with pytest.raises(ContractError, match="jax-xla.*unavailable here.*needs jax"):
        load("jax-xla")


def test_a_builtin_module_that_fails_to_import_is_reported_with_its_error():
    names, unavailable = builtin.load_modules([("flashcheck.impls.numpy_ref", ["numpy-dense"]),
                                               ("flashcheck.impls.no_such_module_here", ["ghost-a", "ghost-b"])])
    assert names == ["numpy-dense"]
    assert set(unavailable) == {"ghost-a", "ghost-b"}
    assert "ModuleNotFoundError" in unavailable["ghost-a"] and "no_such_module_here" in unavailable["ghost-a"]


def test_a_failed_sdpa_probe_says_why():
    sdpa = pytest.importorskip("flashcheck.impls.sdpa")
    from torch.nn.attention import SDPBackend

    assert sdpa.probe(SDPBackend.MATH) is None
    why = sdpa.probe(SDPBackend.EFFICIENT_ATTENTION, device="cpu")  # a CUDA kernel, asked on the CPU
    assert why and why.startswith("RuntimeError: "), why


def test_input_validation_has_its_own_marker():
    run = _pytest("-q", "--collect-only", "-m", "input_validation", "--impl", "numpy-dense", "properties/")
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert collected and all("test_bad_input.py" in line or "test_malformed" in line for line in collected), (
        run.stdout[-2000:])


SHORT_KEYS_PLUGIN = '''
import numpy as np
from flashcheck import KnownIssue, implementation
from flashcheck.oracle import reference

SHORT = KnownIssue("wrong below 4 keys", lambda c: c.sk < 4, dict(sq=4, sk=2), failure="off by more than allowed")

@implementation(name="short-keys", dtypes=("float64",), devices=("cpu",), lse=True, framework="numpy",
                known_issues=[SHORT])
def attention(q, k, v, *, causal=False, scale=None):
    o, lse = reference.dense_forward(q, k, v, causal=causal, scale=scale)
    return (2 * o if k.shape[2] < 4 else o), lse
'''


def test_a_property_never_calls_a_sub_case_that_lies_inside_a_known_issue(tmp_path):
    """The merged-halves property once called jax-pallas on half the keys, inside its declared
    "below 16 keys" issue, and reported that declared failure as a new one. Here the issue is below 4."""
    plugin = tmp_path / "short_keys.py"
    plugin.write_text(SHORT_KEYS_PLUGIN)
    run = _pytest("-m", "properties", "-q", "--impl", f"{plugin}:attention",
                  "properties/test_invariance.py::test_keys_split_into_chunks_merged_by_lse_equal_the_whole")
    assert run.returncode == 0 and " passed" in run.stdout, (
        f"expected the property to pass, splitting only where both halves lie outside the issue:\n{run.stdout[-3000:]}")
