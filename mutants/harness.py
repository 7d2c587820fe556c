"""Run the property suite against one implementation exactly as a user would, and read the verdict.

Each run is a whole ``python -m pytest`` in a process of its own (a fork of a warm server that has
only imported torch, NumPy, Hypothesis and pytest: mutants/forked.py says why and what differs)."""
from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

from flashcheck.strategies.case import CASE_PATTERN
from mutants import forked

ROOT = Path(__file__).resolve().parent.parent
RESULTS: list = []  # (spec, bug class, Verdict) of this session, for the table
# Cheapest properties first, so a kill is found as early as it can be; -x stops at it.
FILES = ["properties/test_forward.py", "properties/test_backward.py", "properties/test_invariance.py",
         "properties/test_bad_input.py"]
VALUES = FILES[:2]  # precision bugs show in the values themselves
# The feature matrix's mutants break a feature, so its properties are what must kill them.
FEATURE_FILES = ["properties/test_features.py", "properties/test_dropout.py"]


@dataclass
class Verdict:
    spec: str
    killed: bool
    seconds: float
    test: str = ""
    case: str = ""
    output: str = ""


def run_suite(spec: str, pins: bool = True, timeout: float = 600, files=FILES, shrink: bool = True,
              profile: str = "ci") -> Verdict:
    """``pytest -m properties -x --impl SPEC`` under ``profile`` (the ci one unless a mutant shows
    only in another's draws: gpu-scale's giant cases), in a fresh process.

    ``pins=False`` drops the @example pins: the kill must then come from generated cases
    and the case reported is what the shrinker reached; ``shrink=False`` reports the first
    failing case as found (a kill that is not held to a small case needs no shrinking).
    """
    with tempfile.TemporaryDirectory() as repro_dir:
        env = {**os.environ, "CI": "true", "FLASHCHECK_PROFILE": profile, "FLASHCHECK_REPRO_DIR": repro_dir}
        env.pop("FLASHCHECK_IMPL", None)
        env.pop("FLASHCHECK_SKIP_EXAMPLES", None)
        if not pins:
            env["FLASHCHECK_SKIP_EXAMPLES"] = "1"
        env.pop("FLASHCHECK_NO_SHRINK", None)
        if not shrink:
            env["FLASHCHECK_NO_SHRINK"] = "1"
        args = ["-m", "properties", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--impl", spec, *files]
        start = time.perf_counter()
        proc = forked.pytest_run(args, cwd=ROOT, env=env, timeout=timeout)
        seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"pytest could not run {spec} (exit {proc.returncode}):\n{out[-3000:]}")
    failed = re.search(r"^FAILED (\S+)", out, re.M)
    cases = re.findall(f"case(?::| =) ({CASE_PATTERN.pattern})", out)
    return Verdict(spec, proc.returncode == 1, seconds, failed.group(1) if failed else "",
                   cases[-1] if cases else "", out)


def outcomes(specs, files, *args, pins: bool = True, timeout: float = 600) -> tuple[dict, str]:
    """Run ``pytest -m properties`` on ``files`` for every spec at once (one process, the ci
    profile) and return ({test id: (outcome, message)}, the whole output). A failure's message
    is the whole report a user reads (the plugin's short report), not only its first line."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "CI": "true", "FLASHCHECK_PROFILE": "ci", "FLASHCHECK_REPRO_DIR": tmp}
        for name in ("FLASHCHECK_IMPL", "FLASHCHECK_SKIP_EXAMPLES"):
            env.pop(name, None)
        if not pins:
            env["FLASHCHECK_SKIP_EXAMPLES"] = "1"
        xml = Path(tmp) / "junit.xml"
        cmd = ["-m", "properties", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={xml}",
               *(a for s in specs for a in ("--impl", s)), *args, *files]
        proc = forked.pytest_run(cmd, cwd=ROOT, env=env, timeout=timeout)
        out = proc.stdout + proc.stderr
        if proc.returncode not in (0, 1) or not xml.exists():
            raise RuntimeError(f"pytest could not run {specs} (exit {proc.returncode}):\n{out[-3000:]}")
        results = {}
        for case in ElementTree.parse(xml).iter("testcase"):
            test = f"{case.get('classname')}::{case.get('name')}"
            verdict = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            message = "" if verdict is None else verdict.get("message", "")
            if verdict is not None and verdict.tag in ("failure", "error"):
                message = f"{message}\n{verdict.text or ''}"
            results[test] = ("passed", "") if verdict is None else (verdict.tag, message)
    return results, out


def parse(case_repr: str):
    """The AttentionCase a report printed."""
    from flashcheck import AttentionCase

    return eval(case_repr, {"AttentionCase": AttentionCase})


def table(results) -> list[str]:
    """README's mutant table, as markdown rows."""
    rows = ["| mutant | bug class | pins | killed | seconds | shrunk case | killed by |",
            "|---|---|---|---|---|---|---|"]
    for spec, what, pins, v in results:
        case = v.case.replace("AttentionCase(", "(") if v.case else "-"
        rows.append(f"| `{spec.split(':')[-1]}` | {what} | {'with' if pins else 'without'} "
                    f"| {'yes' if v.killed else 'no'} | {v.seconds:.1f} "
                    f"| `{case}` | `{v.test.split('::')[-1]}` |")
    for pins in (True, False):
        kills = sorted(v.seconds for _, what, p, v in results if v.killed and what != "correct" and p is pins)
        if kills:
            rows.append(f"\nmedian seconds to kill {'with' if pins else 'without'} pins: "
                        f"{statistics.median(kills):.1f} over {len(kills)} mutants")
    return rows
