"""``flashcheck sanitize FOLDER``: replay a reproducer under NVIDIA's compute-sanitizer.

A wrong value says that a kernel failed, not where. A read past a tensor, a write past an
output or a shared-memory race often shows first as a value that is only sometimes wrong (the
poisoned margins, the race property). compute-sanitizer's memcheck and racecheck tools name the
first bad access: the kernel, the thread and the address. This module reruns the reproducer a
failure wrote (``python -m flashcheck replay FOLDER``) under each tool, and reports each tool's
first error and its error count.

Exit status: 0 when every tool ran clean, 1 when one reported errors, 2 when it could not run
(no compute-sanitizer found, or a tool that did not start).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

TOOLS = ("memcheck", "racecheck")
MARK = "========= "  # how compute-sanitizer starts each of its own lines
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
CONTEXT = 6  # lines shown after a tool's first error (the access, the thread, the address, the kernel)


@dataclass
class Finding:
    tool: str
    errors: int | None  # None: the tool printed no summary (it did not run to the end)
    first: list[str]  # the first error and the lines that say where, without the marks
    status: int  # the exit status of the sanitized replay

    def report(self) -> str:
        if self.errors is None:
            return (f"{self.tool}: no error summary (the replay exited with {self.status} before the tool "
                    "finished); its output is above")
        if not self.errors:
            return f"{self.tool}: clean (0 errors)"
        lines = "\n".join(f"    {line}" for line in self.first)
        return f"{self.tool}: {self.errors} error(s); the first:\n{lines}"


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else in CUDA_HOME's or the default CUDA install's bin/."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        path = os.path.join(home, "bin", "compute-sanitizer") if home else None
        if path and os.access(path, os.X_OK):
            return path
    return None


def parse(tool: str, output: str, status: int) -> Finding:
    """The first error block of one tool's output, and its error count."""
    own = [line[len(MARK):].rstrip() for line in output.splitlines() if line.startswith(MARK)]
    counts = [int(m.group(1)) for line in own if (m := SUMMARY.search(line))]
    body = [line for line in own if not line.startswith("COMPUTE-SANITIZER") and not SUMMARY.search(line)]
    start = next((i for i, line in enumerate(body) if line.strip() and not line.startswith(" ")), None)
    first = [] if start is None else [line.strip() for line in body[start:start + 1 + CONTEXT] if line.strip()]
    return Finding(tool, counts[-1] if counts else None, first, status)


def run(folder: str, impl: str | None = None, tools=TOOLS, sanitizer: str | None = None) -> list[Finding]:
    sanitizer = sanitizer or find_sanitizer()
    if sanitizer is None:
        raise FileNotFoundError("compute-sanitizer was not found on PATH, in $CUDA_HOME/bin or in "
                                "/usr/local/cuda/bin: it comes with the CUDA toolkit")
    replay = [sys.executable, "-m", "flashcheck", "replay", folder] + (["--impl", impl] if impl else [])
    findings = []
    for tool in tools:
        # torch's caching allocator hands out pieces of larger blocks, inside which memcheck sees no
        # bound: without it each tensor is its own allocation, and a read past one is an error
        argv = [sanitizer, "--tool", tool, "--print-limit", "20", *replay]
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        findings.append(parse(tool, done.stdout + "\n" + done.stderr, done.returncode))
    return findings


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="flashcheck sanitize")
    parser.add_argument("folder")
    parser.add_argument("--impl")
    parser.add_argument("--tool", action="append", choices=TOOLS)
    args = parser.parse_args(argv)
    try:
        findings = run(args.folder, args.impl, tuple(args.tool or TOOLS))
    except FileNotFoundError as exc:
        print(f"flashcheck sanitize: {exc}", file=sys.stderr)
        return 2
    print("\n".join(["", "flashcheck sanitize: " + args.folder] + [f.report() for f in findings]))
    if any(f.errors for f in findings):
        return 1
    return 2 if any(f.errors is None for f in findings) else 0
