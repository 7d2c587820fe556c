"""The suite's own trustworthiness: no false alarm on a correct kernel that declares
its limits, no check that cannot fail, and reports that blame the right thing.

The kernels are in mutants/untrusted.py; the properties are called here in process, on
one implementation each. What only a pytest run shows (skips, ordering, FlakyFailure turned
into a message) is checked through pytest itself in mutants/test_examples.py.
"""
import functools
import re

import pytest
import torch
from hypothesis.errors import UnsatisfiedAssumption

from flashcheck import oracle as orc
from flashcheck import report
from flashcheck import strategies as fs
from flashcheck.contract import call, capabilities, implementation, load
from mutants import untrusted as ut
from flashcheck.properties import helpers as ph
from flashcheck.properties import test_backward, test_bad_input, test_forward, test_invariance, test_known_issues
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import context

pytestmark = pytest.mark.properties


def record(fn):
    return fn.__flashcheck__


def test_top_left_with_equal_lengths_is_not_asked_for_masked_positions():
    why = capabilities.missing(record(ut.no_masked_positions), ["masked"])
    assert why and "equal lengths" in why[0], f"expected a skip naming equal lengths, got {why}"


def test_a_causal_only_kernel_is_not_asked_for_non_causal_properties():
    causal_only = implementation(name="c", causal="top_left", causal_only=True, register=False)(lambda q, k, v: q)
    why = capabilities.missing(record(causal_only), ["non_causal"])
    assert why == ["c is causal_only: it has no non-causal mode"], why


def test_bad_input_starts_from_a_case_the_kernel_accepts():
    """Refusing a too-short case is not refusing a batch mismatch: the check must see the broadcast."""
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_bad_input.test_malformed_shapes_raise_a_named_error(record(ut.checks_lengths_only), "batch")


def cuda_only(refusal):
    """A kernel declared for CUDA that runs on the meta device (the test's stand-in for CUDA on a CPU
    machine) and meets CPU inputs with ``refusal`` raised, or, for None, with an answer."""
    def attention(q, k, v, *, causal=False, scale=None):
        if q.device.type != "meta" and refusal is not None:
            raise RuntimeError(refusal)
        return torch.zeros(q.shape[:3] + v.shape[-1:], device=q.device, dtype=q.dtype)

    return record(implementation(name="cuda-only", devices=("cuda",), dtypes=("float64",), register=False)(attention))


@pytest.mark.parametrize("refusal", [
    "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)",  # Triton
    "custom call not found for platform cpu",  # JAX's words (... not found for platform cpu)
    "Only interpret mode is supported on CPU backend",  # Pallas
    "something unrelated went wrong",  # a refusal all the same
])
def test_any_error_for_inputs_on_an_undeclared_device_counts_as_a_refusal(monkeypatch, refusal):
    monkeypatch.setattr(call, "device_for", lambda impl: "meta")
    test_bad_input.test_inputs_on_an_undeclared_device_are_refused(cuda_only(refusal))


def test_an_answer_for_inputs_on_an_undeclared_device_fails(monkeypatch):
    monkeypatch.setattr(call, "device_for", lambda impl: "meta")
    with pytest.raises(pytest.fail.Exception, match=r"declares devices=\('cuda',\) but did not raise for inputs "
                                                    r"on the cpu: it returned a result"):
        test_bad_input.test_inputs_on_an_undeclared_device_are_refused(cuda_only(None))


@pytest.mark.parametrize("check", [
    lambda impl: test_bad_input.test_malformed_shapes_raise_a_named_error(impl, "rank"),
    lambda impl: test_bad_input.test_query_heads_not_a_multiple_of_kv_heads_is_refused(impl),
    lambda impl: test_bad_input.test_unsupported_dtype_is_refused(impl),
], ids=["shape", "heads", "dtype"])
def test_a_kernel_that_refuses_everything_fails_the_bad_input_checks(check):
    with pytest.raises(pytest.fail.Exception, match="refused a case inside its own declarations"):
        check(record(ut.not_implemented))


def test_nan_from_the_kernel_is_blamed_on_the_kernel_not_the_reference():
    with pytest.raises(AssertionError) as info:
        test_invariance.test_permuting_keys_and_values_together_leaves_output_unchanged(impl=record(ut.nan_output))
    said = str(info.value)
    assert "reference" not in said and "own result" in said, f"wrong blame: {said}"


def test_a_kernel_that_answers_differently_twice_is_named_nondeterministic():
    said = report.nondeterminism(record(ut.first_call_wrong), Case(sq=3, sk=5, d=4, dv=4, seed=7))
    assert "race or nondeterminism" in said and "largest difference" in said and "case: AttentionCase(" in said, said


def test_the_oracle_code_is_not_counted_as_tested_by_its_own_comparisons():
    dense = load("numpy-dense")
    assert capabilities.missing(dense, ["independent"]), "numpy-dense must be skipped where it meets itself"
    assert not capabilities.missing(load("numpy-tiled"), ["independent"])
    for prop in (test_forward.test_output_matches_dense_float64,
                 test_forward.test_lse_is_natural_log_sum_exp_of_scaled_logits,
                 test_backward.test_gradients_match_analytic_float64):
        needs = [n for m in getattr(prop, "pytestmark", []) if m.name == "requires" for n in m.args]
        assert "independent" in needs, f"{prop.__name__} compares with the truth but runs on numpy-dense"


def test_an_output_outside_the_visible_values_is_reported_with_its_entry_and_range():
    # the bound is an array per entry: formatting it as one number raised TypeError, blamed on the kernel
    with pytest.raises(AssertionError) as info:
        test_forward.test_output_lies_within_the_visible_values(impl=record(ut.beyond_the_values))
    said = str(info.value)
    assert re.search(r"o\[[\d, ]+\] = \S+ lies outside \[min, max\] = \[\S+, \S+\] of the values its row sees, "
                     r"by \S+ beyond the slack \S+; \d+ of \d+ entries outside", said), said
    assert "case: AttentionCase(" in said, said


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError(f"{fn} did not raise")


def test_an_error_of_the_suite_itself_is_not_blamed_on_the_kernel():
    from flashcheck import report

    impl = record(ut.not_implemented)
    case = Case(sq=2, sk=2)
    suite = _raised(lambda: orc.entries(case, "no-such-result", None))  # raised in flashcheck/
    kernel = _raised(lambda: ph.forward(impl, case))  # raised in the kernel's own file, through flashcheck/contract/call.py
    # a kernel that is a library's own function: it raises from inside torch, with no frame of its own
    sdpa = implementation(name="sdpa-itself", dtypes=("float64",), register=False)(
        functools.partial(torch.nn.functional.scaled_dot_product_attention))
    library = _raised(lambda: ph.forward(record(sdpa), case))  # TypeError: no causal= keyword
    said = {name: report.Failure(impl, "test_x", case, exc, "").render(None).splitlines()[-1]
            for name, exc in (("suite", suite), ("kernel", kernel), ("library", library))}
    assert said["suite"].startswith("  flashcheck itself raised ") and "a bug in the suite" in said["suite"], said
    assert said["kernel"].startswith("  not-implemented raised NotImplementedError"), said
    assert said["library"].startswith("  not-implemented raised TypeError"), said


def test_an_in_place_write_to_a_float64_input_is_seen():
    with pytest.raises(AssertionError, match="modified its input q"):
        test_invariance.test_inputs_are_never_modified(impl=record(ut.halves_q_in_place))


@pytest.mark.parametrize("path", ["plain", "no_grad", "inference_mode"])
def test_an_in_place_write_on_the_inference_path_alone_is_seen(path):
    from mutants import fixed_tiles

    inner = test_invariance.test_inputs_are_never_modified.hypothesis.inner_test
    with pytest.raises(AssertionError, match=f"modified its input q when called {re.escape(call.PATHS[path])}"):
        inner(impl=fixed_tiles.q_scaled_in_place.__flashcheck__, case=Case(sq=2, sk=3, d=4, dv=4), path=path)
    inner(impl=fixed_tiles.q_scaled_in_place.__flashcheck__, case=Case(sq=2, sk=3, d=4, dv=4), path="autograd")


def test_a_known_issue_must_fail_as_declared_not_just_fail():
    with pytest.raises(AssertionError, match="not as declared"):
        test_known_issues.test_each_known_issue_still_reproduces(record(ut.wrong_at_zero_scale))


# @example pins: each either runs as written or is reported.
BLOCKY = implementation(name="blocky", blocks=(16, 32), dtypes=("float64",),
                        register=False)(lambda *a, **kw: ut.nan_output(*a, **kw))
ISSUED = record(ut.wrong_at_zero_scale)
PICKY = implementation(name="picky", supports=lambda c: c.sk > 1 or "one key is not supported",
                       dtypes=("float64",), register=False)(lambda *a, **kw: ut.nan_output(*a, **kw))


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")  # reject() outside a test
@pytest.mark.parametrize("kernel,pin,said", [
    (BLOCKY.__flashcheck__, Case(sk=2, block_k=1), "@example Case(sk=2, block_k=1) refitted: block_k 1 -> 16"),
    (ISSUED, Case(sk=3, scale=0.0), "not run: known issue 'scale 0.0 returns NaN'"),
    (PICKY.__flashcheck__, Case(), "not run: one key is not supported"),
])
def test_a_pin_that_cannot_run_as_written_is_reported(kernel, pin, said, monkeypatch):
    test = context.begin(pins=frozenset({pin}))
    try:
        fs.fit(kernel, pin)
    except UnsatisfiedAssumption:
        pass
    assert any(said in line for line in test.pin_reports), f"expected {said!r} in {test.pin_reports}"
    test.pin_reports.clear()
    fs.fit(kernel, Case(sk=5, d=3, dv=3, block_q=16, block_k=16))  # not a pin, runs unchanged or refitted quietly
    assert test.pin_reports == []
    context.end()


def test_a_capture_that_raised_once_is_reported_as_an_error_not_as_nondeterminism():
    from flashcheck.contract.launch import CaptureFailed
    try:
        try:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        except RuntimeError as exc:
            raise CaptureFailed("k declares cuda_graphs=True but raised while its call was captured in a CUDA "
                                "graph: RuntimeError: CUDA error") from exc
    except CaptureFailed as failed:
        said = report.nondeterminism(record(ut.first_call_wrong), Case(sq=3, sk=5, d=4, dv=4, seed=7), first=failed)
    assert "raised RuntimeError on the first call and returned on the retry" in said, said
    assert "captured in a CUDA graph" in said and "race or nondeterminism" not in said, said
