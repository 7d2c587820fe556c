"""A kernel author's first hour, replayed: README's quick start in a fresh venv, then examples/ci/'s jobs.

One fresh virtual environment (no system site-packages) is built for the module by running
README's CPU quick start literally in an empty directory holding only my_attn.py, with one
substitution: the checkout's path stands for "/path/to/flashcheck". The quick start installs
torch from the package index alone (README gives the CPU index as the faster option, apart).
The CI template's steps then run from a scratch kernel repository with that environment first
on PATH.
"""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.skipif(not (ROOT / "examples" / "ci" / "flashcheck.yml").is_file(),
                                reason="needs a flashcheck checkout"),
              pytest.mark.xdist_group("fresh-venv")]  # one worker builds the venv, once


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLASHCHECK_", "PYTEST_", "PYTHON", "VIRTUAL_ENV", "HYPOTHESIS_"))}
    return {**env, "CI": "true", **extra}


def _bash(script, cwd, env, timeout=900):
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def quick_start() -> str:
    """README's CPU quick-start commands, as written."""
    readme = (ROOT / "README.md").read_text()
    cpu = readme.split("### CPU", 1)[1]
    return re.search(r"```bash\n(.*?)```", cpu, re.S).group(1)


@pytest.fixture(scope="module")
def kernel_repo(tmp_path_factory):
    """An empty directory, my_attn.py, and README's quick start run in it (a fresh .venv)."""
    repo = tmp_path_factory.mktemp("kernel-repo")
    (repo / "my_attn.py").write_text((ROOT / "examples" / "my_attn.py").read_text())
    script = quick_start()
    assert "--index-url" not in script and "/path/to/flashcheck" in script, "the quick start must need PyPI alone"
    script = script.replace("/path/to/flashcheck", str(ROOT)).replace("python3 -m venv", f"{sys.executable} -m venv")
    shipped = "import flashcheck.properties as p, os; print(sorted(os.listdir(os.path.dirname(p.__file__))))"
    run = _bash(script + f"python -c '{shipped}'\npython -c 'import flashcheck; print(flashcheck.__file__)'\n", repo,
                _clean_env())
    return repo, run


def test_readme_quick_start_runs_the_kernel_properties_in_a_fresh_venv(kernel_repo):
    repo, run = kernel_repo
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert re.search(r"\d+ passed", out) and " failed" not in out, out[-3000:]
    installed = run.stdout.strip().splitlines()[-1]
    assert installed.startswith(str(repo / ".venv")), f"flashcheck was not imported from the fresh venv: {installed}"
    shipped = {n for n in ast.literal_eval(run.stdout.strip().splitlines()[-2]) if n.endswith(".py")}
    kernel_properties = {p.name for p in (ROOT / "properties").glob("*.py")}
    assert shipped == kernel_properties, (f"expected the wheel's properties to be the kernel properties "
                                          f"{sorted(kernel_properties)}, got {sorted(shipped)}")
    assert not (repo / ".hypothesis").exists(), "Hypothesis wrote .hypothesis/ into the kernel's repository"


def _steps(job):
    import yaml

    workflow = yaml.safe_load((ROOT / "examples" / "ci" / "flashcheck.yml").read_text())
    return workflow["env"], [s["run"] for s in workflow["jobs"][job]["steps"] if "run" in s]


def _job_env(repo, workflow_env, **extra):
    venv_bin = repo / ".venv" / "bin"
    env = {**{k: str(v) for k, v in workflow_env.items()}, "FLASHCHECK_SOURCE": str(ROOT), "TORCH_INDEX": "",
           "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}", **extra}
    return _clean_env(**env)


def test_ci_template_cpu_job_passes_on_a_correct_kernel(kernel_repo):
    repo, first = kernel_repo
    assert first.returncode == 0, "the quick start failed; see the test above"
    env_vars, steps = _steps("cpu")
    # the steps as written; one property is enough here (the quick start above ran them all)
    env = _job_env(repo, env_vars, PYTEST_ADDOPTS="-k test_output_matches_dense_float64")
    for step in steps:
        run = _bash(step, repo, env)
        assert run.returncode == 0, f"step {step!r} failed:\n{(run.stdout + run.stderr)[-3000:]}"
    assert re.search(r"\b1 passed", run.stdout), run.stdout[-2000:]


def test_ci_template_gpu_job_installs_what_it_runs_and_refuses_a_machine_without_cuda(kernel_repo):
    from flashcheck.contract.call import cuda_available

    if cuda_available():
        pytest.skip("this machine has CUDA: the job would run")
    repo, _ = kernel_repo
    env_vars, steps = _steps("gpu")
    assert any('pip install "$FLASHCHECK_SOURCE"' in s for s in steps), f"the gpu job installs nothing: {steps}"
    check = [s for s in steps if "flashcheck check" in s]
    assert len(check) == 1, steps
    # the install step is the cpu job's, run above into the same environment
    run = _bash(check[0], repo, _job_env(repo, env_vars))
    out = (run.stdout + run.stderr).strip()
    assert run.returncode not in (0, 1) and "this machine has no CUDA" in out and len(out.splitlines()) <= 2, out


def test_ci_template_nightly_job_keeps_a_failure_for_the_next_night(kernel_repo):
    """The thorough job's database (FLASHCHECK_DB, cached between nights) holds a failure found once,
    and the cache is saved after a failing night too."""
    repo, _ = kernel_repo
    import yaml

    job = yaml.safe_load((ROOT / "examples" / "ci" / "flashcheck.yml").read_text())["jobs"]["thorough"]
    saves = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/cache/save")]
    assert saves and saves[0].get("if") == "always()", "the example database must be saved when the night fails"
    assert float(job["env"]["FLASHCHECK_PROPERTY_SECONDS"]) * 45 < 60 * job["timeout-minutes"], (
        "the night's per-property budget must fit its time limit")
    broken = (ROOT / "examples" / "my_attn.py").read_text().replace("cols > rows + sk - sq", "cols > rows + sk - sq + 1")
    assert broken != (ROOT / "examples" / "my_attn.py").read_text()
    (repo / "broken_attn.py").write_text(broken)
    env_vars, steps = _steps("thorough")
    check = [s for s in steps if "flashcheck check" in s]
    assert len(check) == 1, steps
    # a short night: the default profile, one property, no pins (a pinned failure is not saved)
    env = _job_env(repo, env_vars, FLASHCHECK_IMPL="broken_attn.py:attention", FLASHCHECK_NIGHTLY_PROFILE="default",
                   FLASHCHECK_SKIP_EXAMPLES="1", PYTEST_ADDOPTS="-k test_output_matches_dense_float64")
    env.pop("CI")
    nights = [_bash(check[0], repo, env) for _ in range(2)]
    for night in nights:
        assert night.returncode == 1, night.stdout[-3000:]
    db = repo / env_vars["FLASHCHECK_DB"]
    saved = [p for p in db.rglob("*") if p.is_file()]
    assert saved and all(p.relative_to(db).parts[0].startswith("my-attn-") for p in saved), saved
    cases = [re.search(r"case = (AttentionCase\([^)]*\))", n.stdout).group(1) for n in nights]
    assert cases[0] == cases[1], f"the second night did not start from the saved failure: {cases}"
