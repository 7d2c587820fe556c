"""Using flashcheck from a kernel's own directory: what runs, what it says when misused, what a failure reads like.

Each pytest run here starts in an empty temporary directory holding only a kernel file,
as a kernel author's repository would, and reaches the suite through the plugin alone.
"""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flashcheck import implementation
from flashcheck.database import PerImplementation
from flashcheck.contract import ContractError, call, load
from flashcheck.plugin import slow_warning
from flashcheck.strategies import AttentionCase as Case
from mutants import forked

KERNEL = '''
import math
import torch
from flashcheck import implementation

@implementation(name="dense-{tag}", causal="bottom_right", dtypes=("float64", "float32"), devices={devices!r},
                backward=True)
def attention(q, k, v, *, causal=False, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)
    if causal:
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        s = s.masked_fill(j > i + k.shape[2] - q.shape[2] + {off_by}, -math.inf)
    p = torch.nan_to_num(torch.softmax(s, -1))
    return p @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)
'''


def _kernel(folder, tag="ok", devices=("cpu",), off_by=0):
    path = folder / "my_attn.py"
    path.write_text(KERNEL.format(tag=tag, devices=devices, off_by=off_by))
    return path


def _pytest(cwd, *args, env=None):
    """``python -m pytest ARGS`` as a user runs it, in a fork of a process that imported torch, NumPy,
    Hypothesis and pytest and nothing else (mutants/forked.py): about 3 s less per run on a 2-core
    machine. stdout holds stderr too."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHCHECK_", "PYTEST_ADDOPTS"))}
    return forked.pytest_run(["-p", "no:cacheprovider", *args], cwd=cwd, env={**full, **(env or {})}, timeout=300)


def test_a_kernel_run_collects_the_kernel_properties_only_from_any_directory(tmp_path):
    _kernel(tmp_path)
    run = _pytest(tmp_path, "--impl", "my_attn.py:attention", "--collect-only", "-q")
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert any("test_output_matches_dense_float64[dense-ok]" in i for i in ids), run.stdout[-2000:]
    assert all("[dense-ok" in i for i in ids), f"a test without the kernel was collected: {ids}"
    assert not any(name in run.stdout for name in ("test_strategies", "test_plugins", "test_torch_tiled")), (
        "self-tests ran on a plug-in")


@pytest.mark.parametrize("args,env,words", [
    (["--hypothesis-profile", "nope"], {}, "unknown Hypothesis profile 'nope'; flashcheck registers default, ci"),
    ([], {"FLASHCHECK_PROFILE": "nope"}, "unknown Hypothesis profile 'nope'; flashcheck registers default, ci"),
    (["--impl", "{abs}"], {}, "expected FILE.py:function, e.g. {abs}:attention"),
], ids=["hypothesis-profile", "FLASHCHECK_PROFILE", "abs-path-without-function"])
def test_a_misused_command_line_stops_with_one_clear_line(tmp_path, args, env, words):
    path = _kernel(tmp_path)
    args = [a.format(abs=path) for a in args]
    run = _pytest(tmp_path, "--impl", "my_attn.py:attention", *args, "--collect-only", env=env)
    out = (run.stdout + run.stderr).strip()
    assert run.returncode not in (0, 1) and words.format(abs=path) in out, out[-2000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out and len(out.splitlines()) <= 2, out[-2000:]


@pytest.mark.skipif(call.cuda_available(), reason="checks what happens on a machine without CUDA")
@pytest.mark.parametrize("args,env,words", [
    ([], {}, "dense-ok declares devices=('cuda',) and none is present here (no CUDA)"),
    ([], {"FLASHCHECK_PROFILE": "gpu"}, "the gpu profile is for CUDA runners and this machine has no CUDA"),
], ids=["cuda-only-kernel", "gpu-profile"])
def test_nothing_to_test_on_this_machine_stops_the_run_with_one_line(tmp_path, args, env, words):
    _kernel(tmp_path, devices=("cuda",) if not env else ("cpu", "cuda"))
    run = _pytest(tmp_path, "--impl", "my_attn.py:attention", "--collect-only", *args, env=env)
    out = (run.stdout + run.stderr).strip()
    assert run.returncode not in (0, 1) and words in out and len(out.splitlines()) <= 2, out[-2000:]


def test_no_impl_outside_a_checkout_says_so_with_the_command_to_run(tmp_path):
    run = _pytest(tmp_path, "-m", "properties")
    assert run.returncode == 5, run.stdout[-2000:]
    line = [line for line in run.stdout.splitlines() if line.startswith("flashcheck:")]
    assert line == ["flashcheck: no --impl given, so no kernel property ran; test your kernel with pytest --impl "
                    "FILE.py:function -m properties (or flashcheck check FILE.py:function)"], run.stdout[-2000:]


HEAVY = ("numpy", "torch", "hypothesis", "flashcheck.impls", "flashcheck.strategies")
LOADED = ("import sys, pytest; pytest.main(['--co', '-q', '-p', 'no:cacheprovider', *sys.argv[1:]]); "
          f"print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules)); "
          "print('PLUGIN', 'flashcheck.plugin' in sys.modules)")


def test_a_pytest_run_that_is_not_about_flashcheck_loads_nothing_heavy_for_it(tmp_path):
    (tmp_path / "test_other.py").write_text("def test_other():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHCHECK_", "PYTEST_ADDOPTS"))}

    def loaded(*args):
        run = subprocess.run([sys.executable, "-c", LOADED, *args], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        lines = run.stdout.splitlines()
        return next(line for line in lines if line.startswith("LOADED")), "PLUGIN True" in lines

    (alone, off), (with_plugin, on) = loaded("-p", "no:flashcheck.plugin"), loaded()
    named, named_on = loaded("-p", "flashcheck.plugin")  # named on the command line as well as installed
    assert (off, on, named_on) == (False, True, True), f"plugin loaded: blocked {off}, installed {on}, named {named_on}"
    # other plugins may import some of these themselves (Hypothesis's own plugin, pytest-benchmark)
    assert with_plugin == alone, f"expected flashcheck's plugin to add nothing to {alone}, got {with_plugin}"
    assert named == alone, f"expected -p flashcheck.plugin to add nothing to {alone}, got {named}"
    assert "numpy" not in with_plugin and "flashcheck.impls" not in with_plugin, with_plugin


def test_a_run_whose_every_kernel_property_was_skipped_fails_unless_allowed(tmp_path):
    _kernel(tmp_path)  # declares no LSE: every LSE property skips
    args = ("--impl", "my_attn.py:attention", "-k", "lse", "-q")
    strict, allowed = _pytest(tmp_path, *args), _pytest(tmp_path, *args, "--allow-skip")
    assert strict.returncode == 1, strict.stdout[-2000:]
    assert "every kernel property was skipped for dense-ok (dense-ok does not declare lse)" in strict.stdout
    assert allowed.returncode == 0, allowed.stdout[-2000:]


def test_a_failure_reads_in_ten_lines_and_replays_from_another_directory(tmp_path):
    kernel_dir, elsewhere = tmp_path / "kernel", tmp_path / "elsewhere"
    kernel_dir.mkdir(), elsewhere.mkdir()
    _kernel(kernel_dir, tag="off-by-one", off_by=1)  # sees one key too many at the diagonal
    run = _pytest(kernel_dir, "--impl", "my_attn.py:attention", "-k", "test_output_matches_dense_float64",
                  env={"CI": "true"})
    assert run.returncode == 1, run.stdout[-3000:]
    lines = run.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("___") and "dense-off-by-one" in line)
    block = lines[start + 1:next(i for i in range(start + 1, len(lines)) if lines[i].startswith(("___", "===")))]
    assert 4 <= len(block) <= 10, "\n".join(block)
    assert block[0] == "dense-off-by-one: test_output_matches_dense_float64 failed (o)", block[0]
    assert block[1].startswith("  case = AttentionCase(") and "causal='bottom_right'" in block[1], block[1]
    assert "block_q" not in block[1], "block sizes shown for a kernel that takes none"
    # the pin it failed on first (sq=5, sk=9) was shrunk further, to one query row that sees no key
    assert "shrunk from the pinned example" in block[1] and "sq=2" in block[1], block[1]
    assert "wrong o by query row (X wrong, . right): X." in run.stdout, "\n".join(block)
    replay = [line.split("replay: ")[1] for line in block if "replay: " in line][0]
    assert replay.startswith("flashcheck replay /"), replay
    assert "/test_output_matches_dense_float64-dense-off-by-one-" in replay, f"named after the kernel: {replay}"
    folder = replay.split("flashcheck replay ")[1]
    again = subprocess.run([sys.executable, "-m", "flashcheck", "replay", folder], cwd=elsewhere,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "reproduced" in again.stdout, again.stdout + again.stderr


FLIPPING = '''
import math
import torch
from flashcheck import implementation

CALLS = [0]

@implementation(name="flipping", causal=None, dtypes=("float64",), deterministic=True)
def attention(q, k, v, *, causal=False, scale=None):
    CALLS[0] += 1
    if CALLS[0] % 2:  # every other call sums the keys in reverse: right within rounding, not bit for bit
        k, v = k.flip(2), v.flip(2)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    p = torch.softmax(scale * q @ k.repeat_interleave(g, 1).transpose(-1, -2), -1)
    return p @ v.repeat_interleave(g, 1)
'''


USER_PIN_TEST = textwrap.dedent('''
    from hypothesis import example, given
    from flashcheck import strategies as fs
    from flashcheck.strategies import AttentionCase as Case

    @given(case=fs.cases())
    @example(case=Case(sq=3, sk=3, causal="top_left"))
    def test_my_own_pin(impl, case):
        fs.fit(impl, case)
''')


def test_a_users_pin_not_run_as_written_warns_and_the_suites_own_pins_never_do(tmp_path):
    _kernel(tmp_path)  # bottom-right only: the suite's top-left pins are refitted, and so is the user's
    (tmp_path / "test_mine.py").write_text(USER_PIN_TEST)
    run = _pytest(tmp_path, "--impl", "my_attn.py:attention", "test_mine.py", "-q", "-k",
                  "test_my_own_pin or test_output_matches_dense_float64", env={"CI": "true"})
    assert run.returncode == 0, run.stdout[-3000:]
    warned = [line for line in run.stdout.splitlines() if "PinNotAsWritten" in line]
    assert len(warned) == 1 and "@example Case(sq=3, sk=3, causal='top_left') refitted: causal 'top_left' -> " \
        "'bottom_right'" in warned[0], f"expected one warning, for the user's pin alone: {warned}"


def test_a_property_failing_on_its_first_case_runs_before_the_others(tmp_path):
    (tmp_path / "flipping.py").write_text(FLIPPING)
    run = _pytest(tmp_path, "--impl", "flipping.py:attention", "-x", "-q", "-k",
                  "test_output_matches_dense_float64 or test_repeated_calls", env={"CI": "true"})
    assert run.returncode == 1, run.stdout[-3000:]
    assert ("flashcheck: 1 property failed on a first case" in run.stdout
            and "run first: test_repeated_calls_on_one_input_are_bitwise_identical[flipping]" in run.stdout), (
        run.stdout[-3000:])
    assert re.search(r"^1 failed, \d+ deselected", run.stdout, re.M), (
        f"expected the failing property alone to run under -x, before the passing one:\n{run.stdout[-1500:]}")
    kept = _pytest(tmp_path, "--impl", "flipping.py:attention", "-x", "-q", "-k",
                   "test_output_matches_dense_float64 or test_repeated_calls",
                   env={"CI": "true", "FLASHCHECK_FIRST_PASS": "0"})
    assert "failed on a first case" not in kept.stdout and re.search(r"^1 failed, 1 passed", kept.stdout, re.M), (
        f"expected FLASHCHECK_FIRST_PASS=0 to keep pytest's order (the passing property first):\n{kept.stdout[-1500:]}")


def _torch_kernel(fn, **declared):
    return implementation(name="misused", register=False, **declared)(fn).__flashcheck__


CASE = Case(sq=3, sk=4, d=2, dv=2, dtype="float32")


@pytest.mark.parametrize("fn,declared,words", [
    (lambda q, k, v, **_: np.zeros((1, 1, 3, 2), np.float32), {},
     "misused returned o as numpy.ndarray, expected torch.Tensor (a NumPy kernel declares framework='numpy')"),
    (lambda q, k, v, **_: q[:, :, :2], {}, "misused returned o of shape (1, 1, 2, 2), expected (B, Hq, Sq, Dv) = "
                                           "(1, 1, 3, 2)"),
    (lambda q, k, v, **_: (q, q), {}, "misused returned a tuple of 2; return o alone, or declare lse=True and return (o, lse)"),
    (lambda q, k, v, **_: q, {"lse": True}, "misused declares lse=True but returned Tensor, not (o, lse)"),
], ids=["numpy-from-torch-kernel", "wrong-shape", "tuple-without-lse", "lse-missing"])
def test_a_result_of_the_wrong_kind_is_named_in_one_line(fn, declared, words):
    impl = _torch_kernel(fn, **declared)
    with pytest.raises(call.ContractViolation) as info:
        call.run(impl, CASE, *CASE.inputs()[:3])
    assert str(info.value) == words


def test_a_kernel_refusing_a_case_is_told_to_declare_its_limits():
    def refuses(q, k, v, **_):
        raise NotImplementedError("head dim 2 not supported")

    with pytest.raises(NotImplementedError, match=r"declare its limits in @implementation\(...\) \(dtypes=, "
                                                   r"head_dims=") as info:
        call.run(_torch_kernel(refuses), CASE, *CASE.inputs()[:3])
    assert "head dim 2 not supported" in str(info.value) and "sq=3" in str(info.value)


def test_a_slow_kernel_gets_a_warning_with_the_expected_time():
    assert slow_warning("k", calls=2, seconds=10.0) is None, "two calls are not a measurement"
    assert slow_warning("k", calls=10, seconds=1.0) is None, "0.1 s per call is fine"
    line = slow_warning("k", calls=4, seconds=2.0)
    assert line.startswith("flashcheck: k takes 0.50 s per call here") and "~25 s per property" in line, line


def test_a_bad_spec_for_a_file_without_function_names_the_decorated_ones(tmp_path):
    path = _kernel(tmp_path)
    with pytest.raises(ContractError, match=rf"expected FILE.py:function, e.g. {path}:attention"):
        load(str(path))


def test_saved_examples_are_kept_per_implementation_and_never_for_self_tests(tmp_path):
    db = PerImplementation(tmp_path)
    try:
        PerImplementation.current = "kernel-a"
        db.save(b"test", b"failing case")
        assert list(db.fetch(b"test")) == [b"failing case"]
        PerImplementation.current = "kernel-b"
        assert list(db.fetch(b"test")) == [], "a failure of kernel-a replayed for kernel-b"
        PerImplementation.current = None
        db.save(b"test", b"self-test draw")
        assert list(db.fetch(b"test")) == [], "a self-test saved or read an example"
    finally:
        PerImplementation.current = None
    assert [p.name for p in tmp_path.iterdir()] == ["kernel-a"]


def test_the_examples_are_self_contained(tmp_path):
    """Every example plug-in loads from a copy of examples/ alone (no path outside it)."""
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))
    assert examples, "no examples"
    for path in examples:
        (tmp_path / path.name).write_text(path.read_text())
    code = textwrap.dedent("""
        import re, sys
        from pathlib import Path
        from flashcheck.contract import load
        for path in sorted(Path(".").glob("*.py")):
            names = re.findall(r"^@implementation\\((?:.|\\n)*?^def (\\w+)", path.read_text(), re.M)
            assert names, f"{path}: no decorated function"
            for name in names:
                load(f"{path.resolve()}:{name}")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-1500:]


def _failure_with_rows_wrong(rows, blocks, tiles=None, block=4):
    from flashcheck import oracle as orc
    from flashcheck.report import Failure

    impl = _torch_kernel(lambda q, k, v, **_: q, blocks=blocks, tiles=tiles)
    case = Case(sq=8, sk=8, d=2, dv=3, block_q=block, block_k=block)
    got = orc.truth(case).o.copy()
    got[:, :, rows, 1] += 1.0
    entries = orc.entries(case, "o", got)
    return Failure(impl, "test_x", case, AssertionError("misused o: wrong"), "", entries=entries)


def test_the_error_map_marks_wrong_rows_and_the_kernels_tiles():
    text = _failure_with_rows_wrong([4, 5, 6, 7], blocks="any").render(None).splitlines()
    assert text[1] == "  case = AttentionCase(sq=8, sk=8, d=2, dv=3, block_q=4, block_k=4)  # shrunk, fitted to misused"
    assert re.match(r"  o\[0, 0, [4-7], 1\]: expected -?[\d.]+, got -?[\d.]+ \(error 1, relative error [\d.e+-]+, "
                    r"allowed [\d.e+-]+\); "
                    r"4 of 24 entries wrong$", text[2]), text[2]
    assert text[3] == "  wrong o by query row (X wrong, . right; | every 4): ....|XXXX", text[3]
    assert text[4] == "  wrong in batch 0 of 1, heads 0 of 1, 1 of 3 value dims", text[4]
    untiled = _failure_with_rows_wrong([0], blocks=None).render(None).splitlines()
    assert "block_q" not in untiled[1] and untiled[3].endswith("): X......."), untiled


def test_the_case_shows_block_sizes_at_their_defaults_for_a_kernel_that_takes_or_fixes_them():
    for declared in (dict(blocks="any"), dict(blocks=None, tiles=(16, 16))):
        text = _failure_with_rows_wrong([0], block=16, **declared).render(None).splitlines()
        assert text[1].startswith("  case = AttentionCase(sq=8, sk=8, d=2, dv=3, block_q=16, block_k=16)"), (
            f"{declared}: expected the 16x16 blocks in the case, got {text[1]}")


def test_a_kernel_that_does_not_raise_on_bad_input_is_the_verdict_not_a_bug_in_the_suite():
    from flashcheck.report import Failure

    try:
        with pytest.raises(ValueError):
            pass  # the kernel returned on a malformed input
    except pytest.fail.Exception as exc:
        error = exc
    text = Failure(_torch_kernel(lambda q, k, v, **_: q), "test_x", None, error, "", params="rank").render(None)
    line = text.splitlines()[1]  # pytest 8 writes "<class 'ValueError'>", pytest 9 "ValueError"
    assert line.startswith("  DID NOT RAISE") and "ValueError" in line, text


def test_numpy_scalar_reprs_in_a_message_read_as_plain_numbers():
    from flashcheck.report import plain_numbers

    text = "expected np.float64(0.25), got np.float32(nan) at (np.int64(0), 1)"
    assert plain_numbers(text) == "expected 0.25, got nan at (0, 1)", plain_numbers(text)


def test_a_heatmap_is_drawn_only_where_matplotlib_is_installed(tmp_path, monkeypatch):
    from flashcheck.report import heatmap

    failure = _failure_with_rows_wrong([1, 2], blocks=None)
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
        assert heatmap(failure, tmp_path / "none.png") is False and not (tmp_path / "none.png").exists()
    pytest.importorskip("matplotlib")
    assert heatmap(failure, tmp_path / "error.png") is True
    assert (tmp_path / "error.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_dropout_reproducer_replays_the_property_that_failed(tmp_path, monkeypatch, capsys):
    """The dense truth knows no kernel's keep mask: holding a dropout case to it read as a mismatch on every
    result. Replay runs the failed property instead, or says it cannot."""
    from flashcheck import repro

    monkeypatch.setenv("FLASHCHECK_REPRO_DIR", str(tmp_path))
    case = Case(hq=2, sq=8, sk=6, d=4, dv=4, causal="bottom_right", dropout_p=0.1, dropout_seed=3)
    prop = "properties/test_dropout.py::test_the_same_seed_gives_bitwise_the_same_results_and_another_seed_differs"
    out = repro.write(case, "torch-tiled", f"{prop}[torch-tiled]", "message")
    assert repro.main([str(out)]) == 0, capsys.readouterr().out
    assert f"property: {prop}" in capsys.readouterr().out
    other = repro.write(case, "torch-tiled", "properties/test_dropout.py::read_mask[torch-tiled]", "message")
    assert repro.main([str(other)]) == 2, "expected a dropout case it cannot judge to be refused"


def test_a_race_reproducer_replays_the_race_property_not_one_plain_call(tmp_path, monkeypatch, capsys):
    """A race shows only over repeated calls at the property's batch, and a launch bug only in its launch
    context: replay, and so ``flashcheck sanitize``, runs the property that failed."""
    from flashcheck import repro

    monkeypatch.setenv("FLASHCHECK_REPRO_DIR", str(tmp_path))
    case = Case(hq=2, sq=5, sk=6, d=4, dv=4, causal="bottom_right", dtype="float32")
    prop = "properties/test_races.py::test_repeated_calls_at_a_large_batch_each_stay_within_the_bound"
    out = repro.write(case, "torch-tiled", f"{prop}[torch-tiled]", "message")
    assert repro.main([str(out)]) == 0, capsys.readouterr().out
    assert f"property: {prop}" in capsys.readouterr().out
    plain = repro.write(case, "torch-tiled", "properties/test_forward.py::test_output_matches_dense_float64[torch-tiled]",
                        "message")
    assert repro.main([str(plain)]) == 0
    assert "property:" not in capsys.readouterr().out, "expected a plain property replayed as one call"


def test_a_test_whose_inputs_are_not_the_case_s_own_writes_no_reproducer(tmp_path):
    """The scale property draws its inputs on the device: a reproducer of case.inputs() would replay
    other numbers (and, past 2^31 elements, fill the host's memory). It says so instead."""
    _kernel(tmp_path, tag="off-by-one", off_by=1)
    (tmp_path / "elsewhere.py").write_text(
        "import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n"
        "    from flashcheck.strategies import context\n\n"
        "    context.current().no_reproducer = 'inputs drawn elsewhere'\n")
    run = _pytest(tmp_path, "-p", "elsewhere", "--impl", "my_attn.py:attention", "-k",
                  "test_output_matches_dense_float64", env={"CI": "true", "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 1, run.stdout[-2000:]
    assert "none: inputs drawn elsewhere" in run.stdout, run.stdout[-2000:]
    assert not (tmp_path / "reproducers").exists(), "expected no reproducer folder"
