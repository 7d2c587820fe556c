"""Declared known issues still reproduce as declared; when one stops, its declaration should go."""
import re

import pytest

from flashcheck import oracle as orc
from flashcheck.contract import capabilities
from flashcheck.properties import helpers as ph

pytestmark = pytest.mark.properties


def failures(impl, case) -> list[str]:
    """Every way ``impl`` fails on ``case``: the oracle's mismatch messages, or the error it raised."""
    try:
        res = ph.backward(impl, case) if impl.has_backward else ph.forward(impl, case)
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}"]
    found = []
    for name in ph.RESULTS:
        if getattr(res, name) is not None:
            try:
                orc.compare(case, name, getattr(res, name), who=impl.name)
            except AssertionError as exc:
                found.append(str(exc))
    return found


def test_each_known_issue_still_reproduces(impl):
    if not impl.known_issues:
        pytest.skip(f"{impl.name} declares no known issues")
    for issue in impl.known_issues:
        # inside the declaration and the issue's predicate: @implementation checked that (capabilities)
        case = capabilities.witness_case(impl, issue)
        found = failures(impl, case)
        if not found:
            pytest.fail(f"{impl.name}: known issue {issue.text!r} no longer reproduces on {case!r}; "
                        "remove it from the declaration")
        assert any(re.search(issue.failure, f, re.IGNORECASE) for f in found), (
            f"{impl.name}: the witness of known issue {issue.text!r} fails, but not as declared "
            f"(failure={issue.failure!r}); it failed with:\n  " + "\n  ".join(found))
