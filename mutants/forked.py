"""Whole pytest runs in forks of one warm process: each run a fresh process, its imports paid once.

The harness judges every mutant by a whole ``python -m pytest`` run in a process of its own, as a
user's run is. A fresh interpreter spends about 3 s (twice that on a loaded 2-core machine)
importing torch, NumPy, Hypothesis and pytest before it tests anything, and CI runs some sixty
such processes. Here one server process imports those four, and nothing else, then forks a child
per run; the child takes the run's environment, directory and arguments and starts pytest as
``python -m pytest`` does. Nothing has run in the server, so each child starts where a fresh
process would once its imports were done.

What a fork shares that a fresh process would not is import-time state, so the server imports
only modules that read none of the run's own settings: flashcheck (whose Hypothesis profile, and
Triton's interpreter switch, are read at import) is imported by the child, as in a fresh process.
The server is started with the environment of the first run, and its children inherit its hash
seed, which only makes their runs more alike.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

SERVER = r"""
import json, os, sys
import numpy, torch, hypothesis, pytest  # what every run imports first; nothing of flashcheck

for line in sys.stdin:
    run = json.loads(line)
    out = os.open(run["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            sys.stdin = open(os.devnull)
            os.environ.clear()
            os.environ.update(run["env"])
            os.chdir(run["cwd"])
            sys.path[0] = run["cwd"]  # as `python -m` puts the directory it starts in
            sys.argv = ["pytest", *run["args"]]
            code = pytest.console_main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(out)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""

_server: subprocess.Popen | None = None


def _start(env) -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   env=env, text=True)
        atexit.register(_server.kill)
    return _server


def _reply(server, timeout: float | None) -> dict:
    ready, _, _ = select.select([server.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError
    line = server.stdout.readline()
    if not line:
        raise RuntimeError(f"the pytest fork server exited ({server.poll()})")
    return json.loads(line)


def pytest_run(args, *, cwd, env, timeout: float) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in ``cwd`` with environment ``env``, as ``subprocess.run`` with
    ``capture_output=True, text=True`` gives it (stdout and stderr together, in stdout)."""
    server = _start(env)
    with tempfile.NamedTemporaryFile(prefix="forked-pytest-", suffix=".log", delete=False) as f:
        out = f.name
    try:
        # the server imported Hypothesis before pytest could mark its plugin for assertion rewriting:
        # a warning a fresh process would not print, about a module with no assertions of ours
        args = ["-W", "ignore::pytest.PytestAssertRewriteWarning", *args]
        server.stdin.write(json.dumps({"args": list(args), "cwd": str(cwd), "env": dict(env), "out": out}) + "\n")
        server.stdin.flush()
        pid = _reply(server, 60)["pid"]
        try:
            rc = _reply(server, timeout)["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            _reply(server, 60)
            raise subprocess.TimeoutExpired(["pytest", *args], timeout) from None
        with open(out, errors="replace") as f:
            output = f.read()
    finally:
        os.unlink(out)
    return subprocess.CompletedProcess(["pytest", *args], rc, output, "")
