"""Standalone reproducers: written when a property fails, replayed with one command from anywhere.

    flashcheck replay reproducers/<name>                    # against the implementation that failed
    flashcheck replay reproducers/<name> --impl my.py:attn  # against any other

A reproducer folder holds case.py (the shrunk AttentionCase as code, and where the
implementation lives: an absolute spec, its file and module name), inputs.npz (the exact
q, k, v, dO), failure.txt (the property and its full message), repro.py (the same command
as a script) and, where matplotlib is installed, error.png. Replay runs forward (and
backward where declared) and holds every result to the oracle, printing one line per
result; the exit status is 1 on a mismatch and 2 when the reproducer cannot run. A dropout
case runs the property that failed instead (the dense truth knows no kernel's keep mask).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

import numpy as np

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the folder that holds the flashcheck package
SCRIPT = '''"""Replays this reproducer: python repro.py [--impl SPEC], or flashcheck replay {here}"""
import sys
from pathlib import Path

try:
    from flashcheck import repro
except ImportError:  # flashcheck not installed in this interpreter: the checkout that wrote this
    sys.path.append({root!r})
    from flashcheck import repro

sys.exit(repro.main([str(Path(__file__).resolve().parent), *sys.argv[1:]]))
'''


def folder() -> Path:
    """Where reproducers go: $FLASHCHECK_REPRO_DIR, else reproducers/ under the current directory."""
    return Path(os.environ.get("FLASHCHECK_REPRO_DIR") or Path.cwd() / "reproducers").resolve()


def write(case, origin: dict | str, test_id: str, message: str, who: str | None = None) -> Path:
    """Write a reproducer for ``case`` failing ``test_id`` on the implementation at ``origin``
    (``flashcheck.contract.origin_of``: an absolute spec, its file and module name; or a built-in's name).
    The folder is named after the property and the implementation ``who`` (twenty kernels whose
    functions are all called ``attention`` get twenty names)."""
    origin = {"spec": origin} if isinstance(origin, str) else dict(origin)
    name = test_id.split("::")[-1].split("[")[0]
    tag = hashlib.sha1(f"{test_id}{case!r}".encode()).hexdigest()[:8]
    who = re.sub(r"[^\w.-]+", "_", who or origin["spec"].rsplit(":", 1)[-1])
    out = folder() / f"{name}-{who}-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    q, k, v, do = case.inputs()
    np.savez(out / "inputs.npz", q=q, k=k, v=v, do=do)
    (out / "case.py").write_text(f"from flashcheck.strategies import AttentionCase\n\nCASE = {case!r}\n"
                                 f"IMPL = {origin!r}\n")
    (out / "failure.txt").write_text(f"{test_id}\n\n{message}\n")
    (out / "repro.py").write_text(SCRIPT.format(here=out, root=str(PACKAGE_ROOT)))
    return out


def load_case(path: Path):
    namespace: dict = {}
    exec((path / "case.py").read_text(), namespace)
    origin = namespace["IMPL"]
    return namespace["CASE"], ({"spec": origin} if isinstance(origin, str) else origin)


def load_impl(origin: dict):
    """The implementation a reproducer names, from any directory: by module name from its
    recorded sys.path root, else by its absolute file path, else by its spec as written."""
    from flashcheck.contract import ContractError, load

    if origin.get("module") and origin.get("root"):
        if origin["root"] not in sys.path:
            sys.path.insert(0, origin["root"])
        try:
            return load(f"{origin['module']}:{origin['function']}")
        except ContractError:
            if not origin.get("path"):
                raise
    if origin.get("path") and origin.get("function"):
        return load(f"{origin['path']}:{origin['function']}")
    return load(origin["spec"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashcheck replay", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a reproducer folder (it holds case.py and inputs.npz)")
    parser.add_argument("--impl", help="FILE.py:function, module:function or a built-in name "
                                       "(default: the implementation that failed)")
    args = parser.parse_args(argv)
    from flashcheck import oracle as orc
    from flashcheck.contract import ContractError, call, load

    where = args.folder.resolve()
    if not (where / "case.py").is_file() or not (where / "inputs.npz").is_file():
        print(f"flashcheck replay: {where} is not a reproducer folder (no case.py and inputs.npz in it)")
        return 2
    case, origin = load_case(where)
    try:
        impl = load(args.impl) if args.impl else load_impl(origin)
    except ContractError as exc:
        print(f"flashcheck replay: cannot load the implementation: {exc}")
        return 2
    saved = np.load(where / "inputs.npz")
    inputs = [saved[n] for n in ("q", "k", "v", "do")]
    if any(not np.array_equal(a, b) for a, b in zip(inputs, case.inputs())):
        print("warning: this NumPy draws different inputs for the case; replaying the saved ones")
    from flashcheck.report import case_code, plain_numbers

    print(f"case = {case_code(case, impl)}\nimplementation: {impl.name} ({args.impl or origin['spec']})")
    case = case if case.dtype in impl.dtypes else case.replace(dtype=impl.dtypes[0])
    if case.dropout_p or _in_context(where):  # the property that failed is the check, not one plain call
        return _replay_property(where, impl, case)
    try:
        res = call.run(impl, case, *inputs[:3], inputs[3] if impl.has_backward else None)
    except Exception as exc:  # the kernel itself failed on the case: that reproduces a failure too
        head = plain_numbers(str(exc).splitlines()[0]) if str(exc) else ""
        print(f"  FAIL  {impl.name} raised {type(exc).__name__}: {head}")
        print("reproduced: the implementation raises on this case")
        return 1
    failed = 0
    for name in ("o", "lse", "dq", "dk", "dv", "dsinks", "dbias"):
        got = getattr(res, name)
        if got is None:
            continue
        try:
            orc.compare(case, name, got, who=impl.name)
            worst = orc.max_error(got, orc.truth(case)[name], orc.result_dtype(case.dtype, name))
            print(f"  {name:4} ok    max error {worst:.3e} (allowed per entry, at most "
                  f"{float(orc.allowed(case, name).max(initial=0)):.3e})")
        except AssertionError as exc:
            failed += 1
            print(f"  {name:4} FAIL  {plain_numbers(str(exc).splitlines()[0])}")
    print("reproduced: the implementation disagrees with the oracle" if failed else "passes on this case")
    return 1 if failed else 0


# Properties whose failure lives in how the call is made (repeated at a large batch, on two streams, in a
# CUDA graph, under torch.compile): one plain call of the case does not reproduce it, so replay (and
# ``flashcheck sanitize``, which runs replay under compute-sanitizer) runs the property itself.
CONTEXT_PROPERTIES = ("test_races.py::", "test_launch.py::")


def _in_context(where: Path) -> bool:
    failure = where / "failure.txt"
    first = failure.read_text().splitlines()[0] if failure.is_file() else ""
    return any(name in first for name in CONTEXT_PROPERTIES)


def _replay_property(where: Path, impl, case) -> int:
    """Run the property named in failure.txt on ``case`` (a suite property taking the implementation and
    the case alone): a dropout case is judged through the kernel's own mask, which only it reads, and a
    race or a launch context needs the property's own calls."""
    import importlib
    import inspect

    test_id = (where / "failure.txt").read_text().splitlines()[0]
    path, _, name = test_id.partition("::")
    module = "flashcheck." + path.split("flashcheck/")[-1].removesuffix(".py").replace("/", ".")
    try:
        test = getattr(importlib.import_module(module), name.split("[")[0]).hypothesis.inner_test
    except (ImportError, AttributeError):
        test = None
    if test is None or set(inspect.signature(test).parameters) != {"impl", "case"}:
        why = "a dropout case is not held to the dense oracle" if case.dropout_p else "one plain call does not reproduce it"
        print(f"flashcheck replay: {why}, and {test_id} is not a suite property of (impl, case) that can run it "
              f"here; run it with pytest --impl ...")
        return 2
    print(f"property: {test_id}")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    # inside Hypothesis (one example, this case, nothing saved), where a property may note() what it saw
    once = settings(max_examples=1, phases=[Phase.generate], database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))(given(c=st.just(case))(lambda c: test(impl=impl, case=c)))
    try:
        once()
    except AssertionError as exc:
        print(f"  FAIL  {str(exc).splitlines()[0]}\nreproduced: the property fails on this case")
        return 1
    print("passes on this case")
    return 0


if __name__ == "__main__":
    sys.exit(main())
