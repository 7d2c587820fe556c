"""Seconds per case of the oracle (the float64 truth and the rule's bounds) at a gpu-lane shape.

    OMP_NUM_THREADS=2 python bench/oracle_cost.py [LABEL]

Four cases of batch 3, 4 query heads on 2, Sq 256, Sk 300, D 64 (fp16, bf16, fp32; causal modes),
each judged as a forward property judges it (O and LSE) and as a backward one does (O, LSE, dQ,
dK, dV), from empty caches; the best of three rounds. To compare two trees, run it from each
(``PYTHONPATH=<tree> python bench/oracle_cost.py before``) in one session: only ratios mean anything.
"""
import sys
import time

from flashcheck import oracle as orc
from flashcheck.oracle import rule
from flashcheck.strategies import AttentionCase as Case
from flashcheck.strategies.case import quantize

CASES = [Case(batch=3, hq=4, hkv=2, sq=256, sk=300, d=64, dv=64, dtype=dt, causal=c, seed=i)
         for i, (dt, c) in enumerate([("float16", "bottom_right"), ("bfloat16", None), ("float32", "top_left"),
                                      ("float16", None)])]
JUDGED = {"forward": ("o", "lse"), "backward": ("o", "lse", "dq", "dk", "dv")}


def clear():
    for cached in (rule.truth, rule._rounding_bounds, rule._parts, rule._probs, rule._dscores, rule.allowed):
        cached.cache_clear()


def main(label: str) -> None:
    orc.truth(Case(sq=4, sk=4, d=4, dv=4))  # imports and first calls out of the timing
    best = {}
    for _ in range(3):
        for kind, names in JUDGED.items():
            clear()
            start = time.perf_counter()
            for case in CASES:
                truth = orc.truth(case)
                for name in names:  # a result exact in t: every entry within its bound
                    orc.compare(case, name, truth[name] if name == "lse" else quantize(truth[name], case.dtype))
            best[kind] = min(best.get(kind, float("inf")), (time.perf_counter() - start) / len(CASES))
    print(label, " ".join(f"{kind} {seconds:.3f} s per case" for kind, seconds in best.items()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
