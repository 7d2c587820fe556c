"""Examples per second of the gpu lane, as it was and as it is, side by side in one run.

    python bench/gpu_lane_speed.py --out DIR [--window 240] [--seed 1] [--nights 2] [--then OLD_CHECKOUT]

Starts eight pytest processes at once (the gpu lane's ``-n 8``, without needing pytest-xdist):
triton-fused and examples/triton_autotuned.py, each in two arms, each arm two processes that share the
kernel properties of test_forward, test_backward, test_invariance and test_features as xdist's workers
would: both collect every test, and each test runs in whichever process reaches it first (a claim file
per test), so that neither sits idle while the other has tests left:

- ``before``: the lane as it first ran, every draw a new shape (FLASHCHECK_SHAPE_BUCKETS=0) and
  every process on all the cores (torch's default, as xdist's workers had it);
- ``now``: shapes from the run's buckets, and each process on its share of the cores
  (OMP_NUM_THREADS = cores / 8, what the plugin gives xdist's workers);
- ``then`` (with ``--then DIR``, in place of ``before``): the suite as an older commit had it, a
  checkout of it in DIR (``git archive COMMIT | tar -x -C DIR``), run on all the cores. Its oracle,
  strategies, profiles and kernels are all the old ones; this tree's timing module counts its
  examples (loaded by file, through a two-line plug-in the script writes).

Every process runs the gpu profile from one --hypothesis-seed and one bucket seed; each
(implementation, arm) pair has its own example database per night and its own empty Triton cache, so
that no pair reuses another's compiles, and every process keeps module bytecode in one shared folder. A process still running after --window seconds is stopped; the
examples it finished count (FLASHCHECK_TIMING_LOG, flashcheck/timing.py). Prints one row per
pair: tests finished, examples, seconds (to the window, or to the last test's end), examples per second
(and per second busy: the processes' own run time), then where both processes' seconds went
(Triton's JIT; the rest of the tests' own time, mostly the examples; outside any test: start-up and
collection), the examples per second the pair would reach with every kernel already compiled, and
failures; then the speed-ups, and after the last of several nights the speed-up over all of them (their
examples and seconds pooled: the old tree's rate moves with its draws). Logs and the JSON lines go to
DIR. The whole run takes the window plus about a minute, per night.

``--nights 2`` runs it all again as a nightly job's next night would: a new --hypothesis-seed,
the same bucket seed (FLASHCHECK_BUCKET_SEED, fixed in the job) and each pair's Triton cache
from the night before, which a CUDA runner keeps between runs. Free draws meet new shapes each
night; the buckets meet the kernels the cache already holds. ``--caches DIR --first-night N`` goes
on from N earlier nights whose caches DIR kept: a device call too short for four nights runs two,
and the next call two more.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPLS = {"triton-fused": "triton-fused",
         "triton-autotuned": str(ROOT / "examples" / "triton_autotuned.py") + ":attention"}
ARMS = {"before": dict(buckets=0, threads=os.cpu_count() or 1),
        "then": dict(buckets=0, threads=os.cpu_count() or 1),
        "now": dict(buckets=1, threads=max(1, (os.cpu_count() or 1) // 8))}
FILES = ("properties/test_forward.py", "properties/test_backward.py", "properties/test_invariance.py",
         "properties/test_features.py")
PROCESSES = 2  # per arm: the lane's eight workers, four pairs
# Every arm's processes load this plug-in: a test runs in the first of them to claim it. (An earlier
# version gave each process half of the files; the one whose half was cheaper sat idle, up to half the
# window, and examples per second measured the split.)
SHARE = """import hashlib
import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    name = hashlib.sha256(item.nodeid.encode()).hexdigest()
    try:
        os.close(os.open(os.path.join(os.environ["FLASHCHECK_BENCH_CLAIMS"], name), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pytest.skip("the arm's other process runs this test")
"""
# The arm "then"'s plug-in: an older tree has no timing module of its own (or an older one).
SHIM = """import importlib.util


def pytest_configure(config):
    spec = importlib.util.spec_from_file_location("flashcheck_timing_now", {path!r})
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)
    timing.register(config, "gpu")
"""


def launch(impl, spec, arm, part, args, out: Path, caches: Path, night: int):
    name = f"{impl}-{arm}-part{part}-night{night}"
    claims = caches / f"claims-{impl}-{arm}-night{night}"
    claims.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FLASHCHECK_PROFILE=args.profile, FLASHCHECK_SHAPE_BUCKETS=str(ARMS[arm]["buckets"]),
               OMP_NUM_THREADS=str(ARMS[arm]["threads"]),
               FLASHCHECK_BUCKET_SEED=str(args.seed), FLASHCHECK_TIMING_LOG=str(out / f"{name}.jsonl"),
               FLASHCHECK_DB=str(caches / f"db-{impl}-{arm}-night{night}"), FLASHCHECK_BENCH_CLAIMS=str(claims),
               TRITON_CACHE_DIR=str(caches / f"triton-{impl}-{arm}"),
               # bytecode of every module, kept as a CUDA runner's site-packages keep it: an image without
               # it (read-only, or PYTHONDONTWRITEBYTECODE) compiled about 6 s of source in every process
               PYTHONPYCACHEPREFIX=str(caches / "pycache"), PYTHONDONTWRITEBYTECODE="",
               # eight processes on one GPU: JAX, where a built-in loads it, takes only what it uses
               XLA_PYTHON_CLIENT_PREALLOCATE="false",
               # the lane's xdist workers never run flashcheck's first pass (one uncounted case of
               # every property before the run proper); these plain pytest processes would
               FLASHCHECK_FIRST_PASS="0",
               # pytest's order in every arm: the gpu profile's default (longest test first, from
               # flashcheck/lane_walls.jsonl) finishes a whole lane sooner, but in a window it spends the
               # first seconds on the slowest tests, and examples per second would measure the order
               FLASHCHECK_ORDER_BY="0")
    env.pop("FLASHCHECK_IMPL", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly", "-q",
           "-p", "flashcheck_bench_share", "--impl", spec, f"--hypothesis-seed={args.seed + night}", *FILES]
    cwd = ROOT
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(caches), env.get("PYTHONPATH")) if p)
    if arm == "then":  # the old tree first on the path; this tree's timing through the shim, its table off
        cwd = args.then
        env["PYTHONPATH"] = os.pathsep.join((str(args.then), env["PYTHONPATH"]))
        env["FLASHCHECK_TIMING"] = "0"
        cmd += ["-p", "flashcheck_then_timing"]
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return dict(name=name, impl=impl, arm=arm, night=night, proc=proc, log=log, start=time.time(),
                end=None, stopped=False)


def wait(runs, window):
    deadline = time.time() + window
    while any(r["end"] is None for r in runs):
        for r in runs:
            if r["end"] is None and r["proc"].poll() is not None:
                r["end"] = time.time()
        if time.time() > deadline:
            for r in runs:
                if r["end"] is None:
                    os.killpg(r["proc"].pid, signal.SIGKILL)  # pytest and any compile workers it started
                    r["proc"].wait()
                    r["end"], r["stopped"] = time.time(), True
        time.sleep(1)
    for r in runs:
        r["log"].close()


def summarize(runs, out: Path, night: int):
    pairs = {}
    for r in runs:
        p = pairs.setdefault((r["impl"], r["arm"]), dict(tests=0, examples=0, seconds=0.0, jit=0.0, failed=0,
                                                             stopped=0, in_tests=0.0, no_jit=0.0, span=0.0))
        records = []
        path = out / f"{r['name']}.jsonl"
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        examples = [x for x in records if x["kind"] == "example"]
        tests = [x for x in records if x["kind"] == "test"]
        p["examples"] += len(examples)
        p["tests"] += len(tests)
        # the processes ran at once: the pair's time is that of its longer-running process
        p["seconds"] = max(p["seconds"], r["end"] - r["start"])
        p["span"] += r["end"] - r["start"]
        done = {t["test"] for t in tests}
        last = {}  # an unfinished test's seconds and compiles, as far as its last example
        for x in examples:
            if x["test"] not in done:
                last[x["test"]] = (x["t"], x["jit"] or 0.0)
        jit = sum(t["jit"] or 0.0 for t in tests) + sum(j for _, j in last.values())
        p["jit"] += jit
        p["in_tests"] += sum(t["wall"] for t in tests) + sum(w for w, _ in last.values())
        # what this process would have taken with every kernel already compiled: the pair's is the longer one's
        p["no_jit"] = max(p["no_jit"], r["end"] - r["start"] - jit)
        p["failed"] += sum(t["outcome"] == "failed" for t in tests)
        p.setdefault("failures", []).extend(t["test"] for t in tests if t["outcome"] == "failed")
        p["stopped"] += r["stopped"]
        per_test = p.setdefault("per_test", {})  # test -> [examples, seconds]: the tests' own rates (matched)
        for x in examples:
            per_test.setdefault(x["test"].split("::")[-1], [0, 0.0])[0] += 1
        for t in tests:
            per_test.setdefault(t["test"].split("::")[-1], [0, 0.0])[1] += t["wall"]
        for name, (w, _) in last.items():
            per_test.setdefault(name.split("::")[-1], [0, 0.0])[1] += w
    lines = [f"night {night + 1}" + (" (each pair's Triton cache from the night before)" if night else " (empty caches)"),
             f"{'implementation':18} {'arm':7} {'tests':>5} {'examples':>8} {'seconds':>7} {'ex/s':>6} "
             f"{'busy/s':>6} {'jit s':>7} {'other s':>7} {'rest s':>6} {'no-jit ex/s':>11} {'failed':>6}  stopped"]
    for (impl, arm), p in sorted(pairs.items()):
        p["rate"] = p["examples"] / p["seconds"] if p["seconds"] else 0.0
        # the examples per second of the processes' own run time, times their number: below ex/s only where
        # one process ran out of tests before the other (at most one test's time, as with xdist)
        p["busy_rate"] = PROCESSES * p["examples"] / p["span"] if p["span"] else 0.0
        # seconds of both processes: compiling, the rest of the tests' own time, outside any test (start-up)
        other, rest = p["in_tests"] - p["jit"], p["span"] - p["in_tests"]
        ceiling = p["examples"] / p["no_jit"] if p["no_jit"] > 0 else 0.0
        lines.append(f"{impl:18} {arm:7} {p['tests']:5d} {p['examples']:8d} {p['seconds']:7.0f} "
                     f"{p['rate']:6.2f} {p['busy_rate']:6.2f} {p['jit']:7.0f} {other:7.0f} {rest:6.0f} {ceiling:11.2f} {p['failed']:6d}  "
                     f"{p['stopped']} of {PROCESSES} processes at the window")
    for impl in IMPLS:
        for base in ("before", "then"):
            old, now = pairs.get((impl, base)), pairs.get((impl, "now"))
            if old and now and old["rate"]:
                would, took, n = matched(old, now)
                lines.append(f"{impl}: now {now['rate'] / old['rate']:.1f}x the examples per second of {base} "
                             f"({now['busy_rate'] / old['busy_rate']:.1f}x per second busy"
                             + (f"; matched, {would / took:.1f}x on the {n} tests both ran)" if took else ")"))
    for (impl, arm), p in sorted(pairs.items()):
        lines += [f"  failed ({impl}, {arm}): {t}" for t in p["failures"]]
    (out / f"speed-night{night + 1}.json").write_text(json.dumps({f"{i} {a}": p for (i, a), p in pairs.items()},
                                                                 indent=1))
    return lines, pairs


def matched(old, now):
    """(would, took, tests): over the tests both arms ran, the seconds the old arm would take for the new
    arm's examples at its own rate per test, and the new arm's seconds. Examples per second in a window
    also measure which tests each arm reached: the faster arm gets further, to tests whose examples may
    be cheaper or dearer. Test by test, the two arms' rates are compared on the same work."""
    would = took = 0.0
    n = 0
    for name, (ex, sec) in now.get("per_test", {}).items():
        old_ex, old_sec = old.get("per_test", {}).get(name, (0, 0.0))
        if ex and old_ex and sec > 0:
            would, took, n = would + ex * old_sec / old_ex, took + sec, n + 1
    return would, took, n


def overall(nights):
    """The speed-ups over every night at once (``nights``: summarize's pairs, one dict per night): the
    old tree's rate moves with its draws from night to night, so one night's ratio is a noisy measure."""
    total, pooled = {}, {}
    for pairs in nights:
        for key, p in pairs.items():
            t = total.setdefault(key, dict(examples=0, seconds=0.0, span=0.0))
            for name in t:
                t[name] += p[name]
        for (impl, arm), old in pairs.items():
            if arm != "now" and (impl, "now") in pairs:
                would, took, _ = matched(old, pairs[impl, "now"])
                both = pooled.setdefault((impl, arm), [0.0, 0.0])
                both[0], both[1] = both[0] + would, both[1] + took
    lines = []
    for impl in IMPLS:
        now = total.get((impl, "now"))
        for base in ("before", "then"):
            old = total.get((impl, base))
            if old and now and old["examples"] and old["span"]:
                rate = now["examples"] / now["seconds"] / (old["examples"] / old["seconds"])
                busy = now["examples"] / now["span"] / (old["examples"] / old["span"])
                would, took = pooled.get((impl, base), (0.0, 0.0))
                lines.append(f"{impl}, all {len(nights)} nights: now {rate:.1f}x the examples per second of {base} "
                             f"({busy:.1f}x per second busy" + (f"; matched, {would / took:.1f}x" if took else "")
                             + f"; {now['examples']} examples against {old['examples']})")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "scratch" / "lane_speed")))
    ap.add_argument("--window", type=float, default=240.0, help="seconds before unfinished processes are stopped")
    ap.add_argument("--seed", type=int, default=1, help="--hypothesis-seed and FLASHCHECK_BUCKET_SEED of every process")
    ap.add_argument("--profile", default="gpu", help="Hypothesis profile (ci tries the script on a CPU machine)")
    ap.add_argument("--nights", type=int, default=1, help="runs in a row, each with the caches of the one before")
    ap.add_argument("--caches", type=Path, default=None,
                    help="keep the Triton caches and example databases here (default: a temporary folder), so "
                         "that a later run with --first-night goes on where this one stopped")
    ap.add_argument("--first-night", type=int, default=0,
                    help="the number of nights already run on --caches (their seeds are skipped)")
    ap.add_argument("--then", type=Path, default=None,
                    help="a checkout of an older commit: its suite is the baseline arm instead of 'before'")
    args = ap.parse_args()
    if args.then is not None:
        args.then = args.then.resolve()
        if not (args.then / "properties" / "test_forward.py").is_file():
            ap.error(f"--then {args.then}: not a flashcheck checkout (no properties/test_forward.py)")
    arms = ("then" if args.then else "before", "now")
    args.out.mkdir(parents=True, exist_ok=True)
    lines, nights = [], []
    with tempfile.TemporaryDirectory(prefix="lane-speed-") as tmp:
        if args.caches is not None:  # kept for a later invocation's --first-night
            args.caches.mkdir(parents=True, exist_ok=True)
            tmp = str(args.caches.resolve())
        (Path(tmp) / "flashcheck_then_timing.py").write_text(SHIM.format(path=str(ROOT / "flashcheck" / "timing.py")))
        (Path(tmp) / "flashcheck_bench_share.py").write_text(SHARE)
        for night in range(args.first_night, args.first_night + args.nights):
            runs = [launch(impl, spec, arm, part, args, args.out, Path(tmp), night)
                    for impl, spec in IMPLS.items() for arm in arms for part in range(PROCESSES)]
            wait(runs, args.window)
            tonight, pairs = summarize(runs, args.out, night)
            lines += tonight
            nights.append(pairs)
            print("\n".join(tonight), flush=True)
        if len(nights) > 1:
            pooled = overall(nights)
            lines += pooled
            print("\n".join(pooled), flush=True)
    with open(args.out / "speed.txt", "a") as f:  # a later --first-night adds its nights
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
