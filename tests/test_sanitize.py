"""``flashcheck sanitize`` (flashcheck/sanitize.py), with a stand-in compute-sanitizer on PATH that
prints what the real one prints for a read past a tensor, and records how it was called."""
import os
import stat
import sys

import pytest

from flashcheck import cli
from flashcheck import sanitize as sz

MEMCHECK = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at attn_fwd+0x1a30
=========     by thread (64,0,0) in block (1,0,0)
=========     Address 0x7f3a00000200 is out of bounds
=========     and is 2 bytes after the nearest allocation at 0x7f3a00000000 of size 512 bytes
=========
========= ERROR SUMMARY: 3 errors
"""
CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A compute-sanitizer that logs its arguments and environment, then prints ``$FAKE_OUTPUT_<tool>``."""
    script = tmp_path / "bin" / "compute-sanitizer"
    script.parent.mkdir()
    log = tmp_path / "calls.txt"
    script.write_text(f"""#!{sys.executable}
import os, sys
tool = sys.argv[sys.argv.index("--tool") + 1]
with open({str(log)!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + " | caching off: " + os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "") + "\\n")
sys.stdout.write(os.environ.get("FAKE_OUTPUT_" + tool, ""))
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_first_memcheck_error_and_the_count_are_reported(fake, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_OUTPUT_memcheck", MEMCHECK)
    monkeypatch.setenv("FAKE_OUTPUT_racecheck", CLEAN)
    status = cli.main(["sanitize", "reproducers/case-1", "--impl", "my_attn.py:attention"])
    out = capsys.readouterr().out
    assert status == 1, f"expected exit 1 on a memcheck error, got {status}"
    assert "memcheck: 3 error(s); the first:\n    Invalid __global__ read of size 2 bytes\n    at attn_fwd+0x1a30" in out, out
    assert "is out of bounds" in out and "racecheck: clean (0 errors)" in out, out
    calls = fake.read_text().splitlines()
    assert [c.split()[:2] for c in calls] == [["--tool", "memcheck"], ["--tool", "racecheck"]], calls
    assert all("-m flashcheck replay reproducers/case-1 --impl my_attn.py:attention" in c for c in calls), calls
    assert all(c.endswith("caching off: 1") for c in calls), f"expected torch's caching allocator off, got {calls}"


def test_a_clean_run_exits_0_and_one_tool_can_be_chosen(fake, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_OUTPUT_racecheck", CLEAN)
    assert cli.main(["sanitize", "reproducers/case-1", "--tool", "racecheck"]) == 0
    assert "racecheck: clean (0 errors)" in capsys.readouterr().out
    assert [c.split()[:2] for c in fake.read_text().splitlines()] == [["--tool", "racecheck"]]


def test_a_tool_that_never_summarizes_is_not_called_clean(fake, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_OUTPUT_memcheck", "========= COMPUTE-SANITIZER\n========= Error: no CUDA device\n")
    assert cli.main(["sanitize", "reproducers/case-1", "--tool", "memcheck"]) == 2
    assert "memcheck: no error summary" in capsys.readouterr().out


def test_without_compute_sanitizer_the_error_names_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sz, "find_sanitizer", lambda: None)
    assert cli.main(["sanitize", "reproducers/case-1"]) == 2
    assert "compute-sanitizer was not found" in capsys.readouterr().err
