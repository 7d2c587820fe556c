"""The property suite, through pytest exactly as a user runs it, on kernels that test the suite itself:

- correct plug-ins declaring every contract keyword (examples/) pass with no failure, no skip
  without a reason and no health-check error;
- the same kernel with one ulp of run-to-run noise fails on determinism;
- a property no case of which fits a kernel is skipped with the reason, a kernel whose answers
  change between calls is named nondeterministic, one whose first call raised (or failed to
  compile) and whose retry returned is said to have done so, and numeric verdicts come first.
"""
import re

import pytest

from mutants import harness

pytestmark = pytest.mark.mutants

# In the order pytest collects them from the folder, so the ordering check means something.
FILES = ["properties/test_backward.py", "properties/test_bad_input.py", "properties/test_forward.py",
         "properties/test_invariance.py", "properties/test_known_issues.py"]
EXAMPLES = {"sdpa-causal-only": "examples/sdpa_causal_only.py:attention",
            "strict": "examples/strict_plugin.py:attention"}
UNTRUSTED = ["no_masked_positions", "causal_by_supports", "first_call_wrong", "causal_only_ulp_noise",
             "first_call_raises", "compiles_on_the_retry"]


# Each fixture runs a whole property suite in a subprocess: the tests that read one share an
# xdist group, so that one worker builds it once instead of each worker building its own.
@pytest.fixture(scope="module")
def examples():
    return harness.outcomes(list(EXAMPLES.values()), FILES)


@pytest.fixture(scope="module")
def untrusted():
    # Without the pins: a pin that fails is reported as it is; Hypothesis replays only generated cases.
    return harness.outcomes([f"mutants/untrusted.py:{k}" for k in UNTRUSTED], FILES[:1] + FILES[2:4],
                            "-k", "masked_positions and no-masked or permuting and causal-by or output_matches "
                                  "and (first-call or ulp-noise or compiles-on) or bitwise and ulp-noise", pins=False)


def of(results, name):
    return {test: verdict for test, verdict in results.items() if f"[{name}" in test}


@pytest.mark.xdist_group("examples-plugins")
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_correct_plugin_declaring_its_limits_passes_the_whole_suite(examples, name):
    results, out = examples
    mine = of(results, name)
    failed = {t: m for t, (o, m) in mine.items() if o in ("failure", "error")}
    assert not failed, f"{name} is correct but failed:\n" + "\n".join(f"{t}: {m}" for t, m in failed.items())
    # every skip names the kernel and a declaration; none is the fallback for a property no case of which fit
    unexplained = {t: m for t, (o, m) in mine.items() if o == "skipped" and (name not in m or "no case" in m)}
    assert not unexplained, f"{name}: skips that do not say which declaration rules the property out: {unexplained}"
    ran = [t for t, (o, _) in mine.items() if o == "passed"]
    assert len(ran) >= 15, f"{name}: only {len(ran)} tests ran: {sorted(mine)}"
    health = re.search(r".*(FailedHealthCheck|Unsatisfiable).*", out)
    assert not health, f"a health-check error in the run of the examples: {health.group(0)}"


@pytest.mark.xdist_group("examples-plugins")
def test_the_deterministic_example_is_checked_for_determinism(examples):
    results, _ = examples
    test = "test_invariance::test_repeated_calls_on_one_input_are_bitwise_identical[sdpa-causal-only]"
    assert [v for t, v in results.items() if t.endswith(test)] == [("passed", "")], sorted(results)


@pytest.mark.xdist_group("examples-plugins")
def test_numeric_properties_run_before_input_validation(examples):
    order = list(examples[0])
    validation = [i for i, t in enumerate(order) if "test_bad_input" in t]
    assert validation and min(validation) > max(i for i, t in enumerate(order) if "test_bad_input" not in t), order


@pytest.mark.xdist_group("untrusted-plugins")
def test_the_same_kernel_with_ulp_noise_fails_on_determinism(untrusted):
    results = of(untrusted[0], "sdpa-causal-only-ulp-noise")
    outcome, message = results[next(t for t in results if "bitwise_identical" in t)]
    assert outcome == "failure" and "deterministic=True" in message and "differ" in message, (outcome, message)
    accurate = results[next(t for t in results if "output_matches" in t)]
    assert accurate == ("passed", ""), f"one ulp of noise is within the oracle's tolerance: {accurate}"


@pytest.mark.xdist_group("untrusted-plugins")
def test_a_property_no_case_of_which_fits_is_skipped_with_the_reason(untrusted):
    masked = of(untrusted[0], "no-masked-positions")
    assert [v for t, v in masked.items() if "masked_positions" in t] == [
        ("skipped", "no position is masked for no-masked-positions: no-masked-positions has no bottom-right causal "
                    "mode, the only one in which a query row sees no key; no-masked-positions declares equal "
                    "lengths: a key is seen by no query only when Sk > Sq")]
    refused = of(untrusted[0], "causal-by-supports")
    outcome, message = refused[next(t for t in refused if "permuting" in t)]
    assert outcome == "skipped" and "last refusal: it has no non-causal mode" in message, (outcome, message)


@pytest.mark.xdist_group("untrusted-plugins")
def test_different_answers_to_one_input_are_reported_as_nondeterminism(untrusted):
    results = of(untrusted[0], "first-call-wrong")
    outcome, message = results[next(t for t in results if "output_matches" in t)]
    assert outcome == "failure" and "race or nondeterminism" in message and "Flaky" not in message, message


@pytest.mark.parametrize("name,said", [
    ("first-call-raises", "first-call-raises raised RuntimeError on the first call and returned on the retry"
                          ": an error that did not recur, not different results\n"
                          "  the error: RuntimeError: first-call-raises: out of workspace memory"),
    ("compiles-on-the-retry", "compiles-on-the-retry failed to compile on the first call and returned on the retry"),
])
@pytest.mark.xdist_group("untrusted-plugins")
def test_an_error_that_does_not_recur_is_reported_as_what_it_was_not_as_nondeterminism(untrusted, name, said):
    results = of(untrusted[0], name)
    outcome, message = results[next(t for t in results if "output_matches" in t)]
    assert outcome == "failure" and said in message, (outcome, message)
    assert "race or nondeterminism" not in message and "Flaky" not in message, message
