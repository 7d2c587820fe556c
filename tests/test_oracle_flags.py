"""numpy's floating-point flags are not the oracle's evidence; the values it computes are.

OpenBLAS's AVX-512 kernels raise the invalid flag when a matmul operand holds an infinity, with no
NaN in the product (the gpu lane on an H100 host, 2026-12-07: jax-xla reported as "flashcheck itself
raised RuntimeWarning: invalid value encountered in matmul"). The rounding terms hold honest
infinities (an infinite variance), so they ignore the flags and check their values instead: a NaN
bound is raised as the suite's bug, never turned into a verdict on the kernel.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from flashcheck import oracle as orc
from flashcheck.oracle import bounds
from flashcheck.strategies import AttentionCase as Case

pytestmark = pytest.mark.selftest

# The lane's shrunk case: one infinite entry in dQ's variance terms, met by BLAS at D = 5
LANE = Case(batch=60, hq=2, sq=15, sk=17, d=5, dv=5, scale=30.0, dtype="float32", regime="heavy",
            precision="tf32+dense")

SCRIPT = """
import warnings
import numpy as np
a = np.ones((2, 15, 17))
a[0, 3, 4] = np.inf
with warnings.catch_warnings(record=True) as raw:
    warnings.simplefilter("always")
    product = a @ np.full((2, 17, 5), 2.0)
print("flagged" if raw and not np.isnan(product).any() else "clean", flush=True)
warnings.simplefilter("error")
from flashcheck.oracle import rule
from flashcheck.strategies import AttentionCase
case = CASE
for name in ("o", "lse", "dq", "dk", "dv"):
    rule.allowed(case, name)
print("no warning")
"""


def _avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _avx512(), reason="OpenBLAS's AVX-512 kernels need a CPU with AVX-512")
def test_an_infinite_term_in_avx512_blas_raises_no_warning():
    env = dict(os.environ, OPENBLAS_CORETYPE="SkylakeX", OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT.replace("CASE", repr(LANE))], env=env, capture_output=True,
                         check=False, text=True, timeout=300)
    if out.stdout.startswith("clean"):
        pytest.skip("this OpenBLAS's SkylakeX kernels no longer flag an infinite operand: nothing to reproduce")
    assert out.returncode == 0 and out.stdout.split() == ["flagged", "no", "warning"], (
        f"expected the bounds of {LANE!r} without a RuntimeWarning under the flagging kernels, got "
        f"stdout {out.stdout!r}, stderr:\n{out.stderr[-3000:]}")


def test_a_nan_bound_is_raised_as_the_suites_bug(monkeypatch):
    case = Case(sq=5, sk=7, d=4, dv=4, dtype="float16")
    lse = bounds._lse
    monkeypatch.setattr(bounds, "_lse", lambda s, u: lse(s, u) * np.nan)
    pt, ds = orc.rule._parts(case), orc.rule._dscores(case)
    with pytest.raises(FloatingPointError, match=r"rounding bound of lse is NaN at .* a bug in the suite"):
        bounds.rounding_bounds(case, pt, ds, orc.rule.half_spacing)
