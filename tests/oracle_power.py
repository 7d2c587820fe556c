"""How much the oracle can see: which perturbations of a correct result it rejects.

For every dtype and logit regime, cases are drawn; the output of a correct fused kernel (the
rounding model, flashcheck/oracle/rounding.py) is perturbed, and ``flashcheck.oracle.compare`` must reject it. A
perturbation counts only where its effect is at least 4x that correct kernel's largest error
and at least 2 ulps (smaller ones a correct kernel may make); the rate is rejections over counted cases. The correct
kernel itself, and torch-tiled, must never be rejected.

    python -m tests.oracle_power [N] [--old PATH]   # the table; --old scores another oracle.py

tests/test_oracle_power.py asserts the rates on a smaller sample in CI.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from collections import defaultdict

import numpy as np

from flashcheck import oracle as orc_new
from flashcheck.oracle.rounding import DTYPES
from flashcheck.strategies import REGIMES, AttentionCase

GRADS = ("dq", "dk", "dv")


def draw_cases(dtype: str, regime: str, n: int, long: bool = True):
    """n deterministic, varied cases; about one in four has lengths in the hundreds."""
    rng = np.random.default_rng([DTYPES.index(dtype), REGIMES.index(regime), n])
    for i in range(n):
        big = long and i % 4 == 3
        sq, sk = (int(rng.integers(128, 600)), int(rng.integers(128, 600))) if big else \
            (int(rng.integers(2, 48)), int(rng.integers(2, 48)))
        hkv = int(rng.integers(1, 3))
        d = int(rng.choice([4, 8, 16, 32, 64])) if not big else int(rng.choice([4, 8, 16]))
        causal = [None, "bottom_right", "top_left"][int(rng.integers(3))]
        scale = [None, 0.5, 2.0, 30.0, float(rng.uniform(0.05, 3))][int(rng.integers(5))]
        yield AttentionCase(batch=1, hq=hkv * int(rng.integers(1, 3)), hkv=hkv, sq=sq, sk=sk, d=d, dv=d,
                            causal=causal, scale=scale, dtype=dtype, regime=regime, seed=int(rng.integers(2**31)))


def _ulp(x, t):
    return 2 * orc_new.half_spacing(x, t)


def perturbations(case, name, good, want, err):
    """(label, perturbed result) pairs, each sized at 4x the correct error and 2 ulps where it lands."""
    t = orc_new.result_dtype(case.dtype, name)
    finite = np.isfinite(want)
    if not finite.any():
        return
    mag = np.abs(np.where(finite, want, 0))
    size = lambda at: max(4 * err, 2 * float(_ulp(want[at], t)))  # noqa: E731
    top = np.unravel_index(np.argmax(mag), mag.shape)
    one = good.copy()
    one[top] += size(top) * (1 if want[top] >= 0 else -1)
    yield "one entry", one
    row = good.copy()
    row[top[:-1]] += np.sign(np.where(np.isfinite(want[top[:-1]]), want[top[:-1]], 0)) * size(top)
    yield "one row" if name in ("o", "dq") else "one key", row
    rel = size(top) / max(float(mag[top]), 1e-300)
    yield "all scaled", np.where(finite, good * (1 + rel), good)
    if name != "lse":
        yield "zero", np.where(finite, 0.0, good)
        yield "negated", np.where(finite, -good, good)
    if name == "lse":
        yield "bf16 LSE", orc_new.quantize(want, "bfloat16")


def counted(perturbed, good, want, err, t) -> bool:
    """Does the perturbation's effect reach 4x the correct error and 2 ulps at its largest entry?"""
    with np.errstate(invalid="ignore"):  # -inf - -inf where a row sees no key: not counted
        delta = np.abs(np.where(np.isfinite(want), perturbed - good, 0))
    at = np.unravel_index(np.argmax(delta), delta.shape)
    return delta[at] >= 4 * err and delta[at] >= 2 * _ulp(want[at], t) * 0.999


def rejects(orc, case, name, got) -> bool:
    try:
        orc.compare(case, name, got)
    except AssertionError:
        return True
    return False


def score(orc, dtypes=("float16", "bfloat16", "float32"), n=40, long=True, correct=None):
    """{(dtype, regime, result, perturbation): [rejected, counted]} and false alarms of correct kernels."""
    rates = defaultdict(lambda: [0, 0])
    alarms = []
    for dtype in dtypes:
        for regime in REGIMES:
            for case in draw_cases(dtype, regime, n, long):
                truth, good = orc_new.truth(case), orc_new.model(case)
                for name in orc_new.RESULTS:
                    want, mine = truth[name], good[name]
                    t = orc_new.result_dtype(dtype, name)
                    err = orc_new.max_error(mine, want, t)
                    if rejects(orc, case, name, mine):
                        alarms.append((case, name, "rounding model"))
                    for label, bad in perturbations(case, name, mine, want, err):
                        if counted(bad, mine, want, err, t):
                            hit = rates[(dtype, regime, name, label)]
                            hit[0] += rejects(orc, case, name, bad)
                            hit[1] += 1
                    bias = np.where(np.isfinite(want), mine * 1.01, mine)  # 1% too large everywhere
                    hit = rates[(dtype, regime, name, "1% too large")]
                    hit[0] += rejects(orc, case, name, bias)
                    hit[1] += 1
                if correct is not None:
                    got = correct(case)
                    alarms += [(case, name, "correct kernel") for name in got if rejects(orc, case, name, got[name])]
    return rates, alarms


def torch_tiled(case):
    from flashcheck.contract import call
    from flashcheck.impls import torch_tiled as tt  # noqa: F401  (registers torch-tiled)
    from flashcheck.contract import REGISTRY

    res = call.run(REGISTRY["torch-tiled"], case, *case.inputs())
    return {n: getattr(res, n) for n in orc_new.RESULTS}


def table(rates) -> list[str]:
    by = defaultdict(dict)
    labels = sorted({k[3] for k in rates})
    for (dtype, regime, name, label), (hit, total) in rates.items():
        by[(dtype, name, label)][regime] = f"{hit}/{total}" if total else "-"
    rows = ["| dtype | result | perturbation | " + " | ".join(REGIMES) + " |", "|---" * (3 + len(REGIMES)) + "|"]
    for (dtype, name, label) in sorted(by, key=lambda k: (k[0], orc_new.RESULTS.index(k[1]), labels.index(k[2]))):
        rows.append(f"| {dtype} | {name} | {label} | " + " | ".join(by[(dtype, name, label)].get(r, "-")
                                                              for r in REGIMES) + " |")
    return rows


def _load(path):
    spec = importlib.util.spec_from_file_location("oracle_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", nargs="?", type=int, default=40)
    ap.add_argument("--old", help="score this oracle.py instead of the current one")
    args = ap.parse_args(argv)
    orc = _load(args.old) if args.old else orc_new
    rates, alarms = score(orc, n=args.n, correct=None if args.old else torch_tiled)
    print("\n".join(table(rates)))
    print(f"\nfalse alarms on correct kernels: {len(alarms)}")
    for case, name, who in alarms[:10]:
        print(f"  {who} {name}: {case!r}")


if __name__ == "__main__":
    sys.exit(main())
