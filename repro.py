"""Standalone reproducers: written when a property fails, replayed with one command.

    python -m repro reproducers/<name>                    # against the implementation that failed
    python -m repro reproducers/<name> --impl my.py:attn  # against any other

A reproducer folder holds case.py (the shrunk AttentionCase as code), inputs.npz (the
exact q, k, v, dO), failure.txt (the property and its message) and repro.py (the same
command as a script). Replay runs forward (and backward where declared) and holds every
result to the oracle, printing one line per result; the exit status is 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
SCRIPT = '''"""Replays this reproducer: python {rel}/repro.py [--impl SPEC]"""
import sys
from pathlib import Path

sys.path.insert(0, {root!r})
import repro

sys.exit(repro.main([str(Path(__file__).parent), *sys.argv[1:]]))
'''


def folder() -> Path:
    return Path(os.environ.get("FLASHCHECK_REPRO_DIR", ROOT / "reproducers"))


def write(case, spec: str, test_id: str, message: str) -> Path:
    """Write a reproducer for ``case`` failing ``test_id`` on implementation ``spec``."""
    name = test_id.split("::")[-1].split("[")[0]
    tag = hashlib.sha1(f"{test_id}{case!r}".encode()).hexdigest()[:8]
    out = folder() / f"{name}-{spec.rsplit(':', 1)[-1]}-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    q, k, v, do = case.inputs()
    np.savez(out / "inputs.npz", q=q, k=k, v=v, do=do)
    (out / "case.py").write_text(f"from strategies import AttentionCase\n\nCASE = {case!r}\nIMPL = {spec!r}\n")
    (out / "failure.txt").write_text(f"{test_id}\n\n{message}\n")
    (out / "repro.py").write_text(SCRIPT.format(rel=out, root=str(ROOT)))
    return out


def load_case(path: Path):
    namespace: dict = {}
    exec((path / "case.py").read_text(), namespace)
    return namespace["CASE"], namespace["IMPL"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--impl", help="FILE.py:function or module:function (default: the one that failed)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import oracle as orc
    from impls import call, load

    case, spec = load_case(args.folder)
    saved = np.load(args.folder / "inputs.npz")
    inputs = [saved[n] for n in ("q", "k", "v", "do")]
    if any(not np.array_equal(a, b) for a, b in zip(inputs, case.inputs())):
        print("warning: this NumPy draws different inputs for the case; replaying the saved ones")
    impl = load(args.impl or spec)
    print(f"case: {case!r}\nimplementation: {impl.name} ({args.impl or spec})")
    case = case if case.dtype in impl.dtypes else case.replace(dtype=impl.dtypes[0])
    res = call.run(impl, case, *inputs[:3], inputs[3] if impl.has_backward else None)
    failed = 0
    for name in ("o", "lse", "dq", "dk", "dv", "dsinks"):
        got = getattr(res, name)
        if got is None:
            continue
        try:
            orc.compare(case, name, got, who=impl.name)
            worst = orc.max_error(got, orc.truth(case)[name], orc.result_dtype(case.dtype, name))
            print(f"  {name:4} ok    max error {worst:.3e} (allowed per entry, at most "
                  f"{float(orc.allowed(case, name)[0].max(initial=0)):.3e})")
        except AssertionError as exc:
            failed += 1
            print(f"  {name:4} FAIL  {str(exc).splitlines()[0]}")
    print("reproduced: the implementation disagrees with the oracle" if failed else "passes on this case")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
