"""The cuDNN known issue's predicate: which cases it declares, and the logit statistic it reads."""
import numpy as np

from flashcheck.impls import cudnn
from flashcheck.strategies import AttentionCase as Case


def brute_lowest_row_max(case):
    q, k, _, _ = case.inputs()
    vis = np.broadcast_to(case.visible(), (case.batch, case.hq, case.sq, case.sk))
    g = case.hq // case.hkv
    peaks = [max(case.effective_scale * q[b, h, i] @ k[b, h // g, j] for j in range(case.sk) if vis[b, h, i, j])
             for b in range(case.batch) for h in range(case.hq) for i in range(case.sq) if vis[b, h, i].any()]
    return min(peaks)


def test_lowest_row_max_is_the_smallest_visible_row_peak():
    # GQA, a causal mask with rows that see nothing (Sq > Sk, bottom-right) and a window
    for case in (Case(batch=2, hq=4, hkv=2, sq=7, sk=5, d=3, dv=3, causal="bottom_right", regime="negative"),
                 Case(hq=2, sq=6, sk=9, d=4, dv=4, scale=2.0, window=(2, 1), regime="equal", seed=3)):
        got, want = cudnn.lowest_row_max(case), brute_lowest_row_max(case)
        assert np.isclose(got, want, rtol=1e-12), f"{case}: expected {want}, got {got}"


def test_the_issue_declares_low_rows_at_lengths_off_128_only():
    issue = cudnn.low_row_dq_nan("cuDNN")
    declared = {
        "the witness": Case(**issue.witness),
        "the lane's equal-regime case (a few rows near -22)": Case(sq=128, sk=64, d=16, dv=16, scale=2.0,
                                                                  dtype="float16", regime="equal", seed=1),
        "bf16 at logits near -2x its overflow point": Case(sq=64, sk=192, d=16, dv=16, dtype="bfloat16",
                                                           regime="negative"),
    }
    free = {
        "plain logits": Case(sq=128, sk=64, d=16, dv=16, dtype="float16"),
        "Sk a multiple of 128": Case(sq=128, sk=128, d=16, dv=16, dtype="float16", regime="negative"),
        "float32": Case(sq=128, sk=64, d=16, dv=16, dtype="float32", regime="negative"),
    }
    for what, case in declared.items():
        assert issue.applies(case), f"{what}: expected declared, lowest row peak {cudnn.lowest_row_max(case):.1f}"
    for what, case in free.items():
        assert not issue.applies(case), f"{what}: expected not declared"


def test_cases_too_large_for_the_host_are_judged_by_their_regime():
    issue = cudnn.low_row_dq_nan("cuDNN")
    giant = dict(batch=1024, hq=65, hkv=65, sq=16, sk=16, d=16, dv=16, dtype="float16")
    assert not issue.applies(Case(**giant)), "a giant plain case: expected not declared (its rows peak above zero)"
    assert issue.applies(Case(**giant, regime="negative")), "a giant negative case: expected declared"
