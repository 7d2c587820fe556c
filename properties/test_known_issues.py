"""Declared known issues still reproduce; when one stops, its declaration should go."""
import pytest

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.properties import helpers as ph

pytestmark = pytest.mark.properties


def test_each_known_issue_still_reproduces(impl):
    if not impl.known_issues:
        pytest.skip(f"{impl.name} declares no known issues")
    for issue in impl.known_issues:
        case = fs.AttentionCase(**issue.witness)
        assert issue.applies(case), f"{impl.name}: the witness of {issue.text!r} is outside its own predicate"
        res = ph.backward(impl, case) if impl.has_backward else ph.forward(impl, case)
        try:
            for name in ph.RESULTS:
                if getattr(res, name) is not None:
                    orc.compare(case, name, getattr(res, name), who=impl.name)
        except AssertionError:
            continue
        pytest.fail(f"{impl.name}: known issue {issue.text!r} no longer reproduces on {case!r}; "
                    "remove it from the declaration")
