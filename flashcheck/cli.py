"""The ``flashcheck`` command.

    flashcheck check my_attn.py:attention [--profile NAME] [--gpu] [--allow-skip] [-- PYTEST ARGS]
    flashcheck replay reproducers/<name> [--impl SPEC]
    flashcheck sanitize reproducers/<name> [--impl SPEC] [--tool memcheck|racecheck]

``check`` is ``pytest -m properties --impl SPEC`` run from the current directory through the
plugin: the same tests, the same reports, the same reproducers. ``--gpu`` runs the gpu
profile (larger shapes, fp16/bf16) and refuses to start without CUDA.
"""
from __future__ import annotations

import argparse
import subprocess
import sys


def _check(args, extra) -> int:
    argv = [sys.executable, "-m", "pytest", "-m", "gpu or properties" if args.gpu else "properties",
            "-p", "no:cacheprovider"]
    for spec in args.spec:
        argv += ["--impl", spec]
    profile = "gpu" if args.gpu else args.profile
    if profile:
        argv += ["--hypothesis-profile", profile]
    if args.allow_skip:
        argv.append("--allow-skip")
    # a fresh interpreter: pytest must import the kernel and the suite itself (assertion rewriting)
    return subprocess.call(argv + extra)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="flashcheck", description="Property-based tests for FlashAttention "
                                     "kernels: run them on yours, replay a failure.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run the kernel properties on an implementation",
                           description="Run flashcheck's kernel properties on SPEC (FILE.py:function, "
                                       "module:function or a built-in name). Arguments after -- go to pytest.")
    check.add_argument("spec", nargs="+", help="FILE.py:function, module:function or a built-in name")
    check.add_argument("--profile", help="Hypothesis profile: default, ci, gpu or thorough "
                                         "(default: ci when CI is set, else default)")
    check.add_argument("--gpu", action="store_true", help="the gpu profile on CUDA; fails without CUDA")
    check.add_argument("--allow-skip", action="store_true", help="accept a run in which nothing could be tested")
    replay = sub.add_parser("replay", help="replay a reproducer folder written by a failure",
                            description="Replay a reproducer folder against the implementation that failed, "
                                        "or another (--impl). Exit 1 while it still fails.")
    replay.add_argument("folder", help="the reproducer folder (reproducers/<name>)")
    replay.add_argument("--impl", help="FILE.py:function, module:function or a built-in name")
    sanitize = sub.add_parser("sanitize", help="replay a reproducer under compute-sanitizer (CUDA)",
                              description="Replay a reproducer folder under compute-sanitizer's memcheck and "
                                          "racecheck and report each tool's first error. Exit 1 on an error.")
    sanitize.add_argument("folder", help="the reproducer folder (reproducers/<name>)")
    sanitize.add_argument("--impl", help="FILE.py:function, module:function or a built-in name")
    sanitize.add_argument("--tool", action="append", choices=("memcheck", "racecheck"),
                          help="one tool (repeatable; default: both)")
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args, extra)
    if args.command == "sanitize":
        from flashcheck import sanitize as sz

        return sz.main([args.folder] + (["--impl", args.impl] if args.impl else [])
                       + [f"--tool={t}" for t in args.tool or ()])
    from flashcheck import repro

    return repro.main([args.folder] + (["--impl", args.impl] if args.impl else []))


if __name__ == "__main__":
    sys.exit(main())
