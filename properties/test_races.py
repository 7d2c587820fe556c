"""Races: one input called again and again at a large batch, with many programs in flight."""
import numpy as np
import pytest
from hypothesis import example, given, note

from flashcheck import oracle as orc
from flashcheck import strategies as fs
from flashcheck.contract import call
from flashcheck.oracle.rounding import RESULTS
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies import draw as fs_draw

pytestmark = pytest.mark.properties


@given(case=fs.cases())
@example(case=Case(hq=2, hkv=1, sq=17, sk=33, d=16, dv=16, causal="bottom_right"))  # partial tiles, GQA
def test_repeated_calls_at_a_large_batch_each_stay_within_the_bound(impl, case):
    """Every call is judged on its own (a kernel need not be deterministic); a call that fails after
    earlier ones passed on the same input is a race. Whether the calls repeat bit for bit is noted.
    The first call also faces the bias check; the later ones the per-entry rule (a race moves entries)."""
    lim = fs_draw.limits()
    top = lim["race_seq"]  # past two 64-row tiles, so a partial last tile still has programs beside it
    case = fs.fit(impl, case.replace(batch=lim["race_batch"], sq=min(case.sq, top), sk=min(case.sk, top)))
    q, k, v, do = case.inputs()
    do = do if impl.has_backward else None
    first, repeats = None, lim["repeats"]
    for r in range(repeats):
        res = call.run(impl, case, q, k, v, do)
        names = [n for n in RESULTS if getattr(res, n) is not None]
        same = [n for n in names if first is not None
                and np.array_equal(getattr(res, n), getattr(first, n), equal_nan=True)]
        note(f"call {r + 1}: {', '.join(same) or 'nothing'} bit for bit as the first call")
        who = f"{impl.name} (call {r + 1} of {repeats} on one input at batch {case.batch}" + (
            ", the earlier calls within the bound: a race)" if r else ")")
        for name in names:
            if first is None:
                orc.compare(case, name, getattr(res, name), who=who)
            elif name not in same:  # a result equal to the first's, bit for bit, has passed already
                _judge_where_it_differs(case, name, getattr(res, name), getattr(first, name), who)
        first = first or res


def _judge_where_it_differs(case, name, got, first, who):
    """A later call against the truth, entry by entry, where it differs from the first call (every other
    entry is the first call's, judged already): the rule's per-entry verdicts at a fraction of the cost
    (the gpu profile repeats 20 calls at batch 60). A wrong entry gets the full comparison and its report."""
    with np.errstate(invalid="ignore"):
        at = np.nonzero(~((got == first) | (np.isnan(got) & np.isnan(first))))
    want = orc.truth(case)[name]
    limit = np.broadcast_to(orc.allowed(case, name), want.shape)
    if orc.entries(case, name, got[at], want=want[at], budget=limit[at]).wrong.any():
        orc.compare(case, name, got, who=who)
