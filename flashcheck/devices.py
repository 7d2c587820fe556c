"""One GPU per pytest-xdist worker: the gpu lane spread over every GPU of a runner.

The controller (the pytest process that starts the workers) lists the GPUs to use and hands the
list to each worker; worker ``gwN`` takes GPU ``N mod len(list)`` and sets CUDA_VISIBLE_DEVICES
to it before anything in it initializes CUDA, so torch, Triton and JAX alike see that one device
as device 0. ``-n auto`` then starts FLASHCHECK_WORKERS_PER_GPU workers per GPU (default: half
the cores, shared out over the GPUs: the float64 truth runs on the host). A failure names the
GPU it ran on; its reproducer runs on whatever device the replaying machine has.

- FLASHCHECK_GPUS: the GPUs to use, as CUDA_VISIBLE_DEVICES writes them ("0,1", or UUIDs);
  default: CUDA_VISIBLE_DEVICES if set, else every GPU torch counts.
- FLASHCHECK_WORKERS_PER_GPU: workers per GPU for ``-n auto``.

Also how a run's workers share the host (their torch threads) and its queue (worksteal in the gpu
profile), and what happens when a kernel loses the CUDA context.
"""
from __future__ import annotations

import os

GPUS_ENV, PER_GPU_ENV, KEY = "FLASHCHECK_GPUS", "FLASHCHECK_WORKERS_PER_GPU", "flashcheck_gpus"
RAN_ON_ENV = "FLASHCHECK_RAN_ON"  # set in a pinned worker: the GPU a failure names


def _split(text: str) -> list[str]:
    return [g.strip() for g in text.split(",") if g.strip()]


def gpus() -> list[str]:
    """The GPUs to spread over, in the controller (where counting them may initialize CUDA)."""
    for env in (GPUS_ENV, "CUDA_VISIBLE_DEVICES"):
        if os.environ.get(env) is not None:
            return _split(os.environ[env])
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as xdist's -n auto counts them), not the host's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def workers_per_gpu(n_gpus: int, cores: int | None = None) -> int:
    text = os.environ.get(PER_GPU_ENV)
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{PER_GPU_ENV}={text!r}: expected a whole number of workers >= 1")
        return n
    cores = cores or usable_cores()
    return max(1, cores // 2 // max(1, n_gpus))


def gpu_of(worker: str, listed: list[str]) -> str | None:
    """The GPU of xdist worker ``gwN``: round-robin over the list, so -n k spreads evenly."""
    if not listed or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    return listed[int(worker[2:]) % len(listed)]


def pin(worker: str, listed: list[str]) -> str | None:
    """In a worker, before CUDA is initialized: see only its GPU. Returns that GPU, or None."""
    gpu = gpu_of(worker, listed)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        os.environ[RAN_ON_ENV] = f"GPU {gpu} (of the {len(listed)} listed: {','.join(listed)}; xdist worker {worker})"
    return gpu


def ran_on() -> str | None:
    """The GPU this process was pinned to, in words, for a failure report."""
    return os.environ.get(RAN_ON_ENV)


def lost_context() -> str | None:
    """Whether this process's CUDA context is lost, and to what: a kernel that faults (a misaligned
    or illegal address, a device-side assert) leaves a sticky error that every later CUDA call in
    the process raises again, so each later test would fail for it. Cheap: one tiny kernel."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - whatever the fault, the context is unusable
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    return None


def stop_if_lost(item) -> None:
    """After a test: if the CUDA context is lost, end this process's run with a line that says why.
    An xdist worker exits, and xdist starts a fresh one for the tests left (it reports the test
    that ran last as the one the worker crashed in: the test whose kernel faulted, or the one after
    it, as the fault surfaces at the next synchronization)."""
    err = lost_context()
    if err is None:
        return
    line = (f"flashcheck: the CUDA context of this process was lost during or just after {item.nodeid} ({err}): "
            "a kernel faulted, and every later CUDA call here would fail for it")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import sys

        print(line + "; this xdist worker exits and a fresh one takes the remaining tests", file=sys.stderr, flush=True)
        os._exit(3)
    item.session.shouldstop = line + "; the run stops (under pytest-xdist, -n N, a fresh worker takes over)"


# How a pytest-xdist run spreads over the workers (the plugin calls these at configure time).

def pin_workers(config):
    """The xdist controller fixes the list of GPUs in the environment, which its workers inherit,
    and each worker then sees only its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:
        pin(worker, _split(os.environ.get(GPUS_ENV, "")))
    elif config.getoption("numprocesses", None) and os.environ.get(GPUS_ENV) is None:
        listed = gpus()
        if listed:
            os.environ[GPUS_ENV] = ",".join(listed)


def auto_workers(config):
    """``-n auto`` in the gpu profile: FLASHCHECK_WORKERS_PER_GPU workers on each GPU (None elsewhere)."""
    from flashcheck.strategies import profiles

    profile = config.getoption("hypothesis_profile", None) or profiles.default_profile()
    listed = gpus() if str(profile).startswith("gpu") else []
    return len(listed) * workers_per_gpu(len(listed)) if listed else None


BLAS_ENVS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
COMPILE_ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def share_cores(config):
    """An xdist worker takes its share of the cores for the float64 truth on the host: eight
    workers each running torch on every core spend their time switching, not computing. A thread
    count the user set (OMP_NUM_THREADS) is left alone.

    numpy's BLAS (the truth's and the bounds' matrix products) reads its thread count once, when it
    loads, so the controller sets it in the environment its workers inherit. OpenBLAS's threads spin
    while they wait for work: two workers on two cores, each with a BLAS thread per core, ran the
    oracle 8x slower (16.7 s against 2.0 s for the same four cases) than with one thread each.
    Inductor's compile pool is shared out the same way: by default each worker starts a process per
    core for its compiles."""
    if not hasattr(config, "workerinput"):
        spawning = config.getoption("numprocesses", None)
        share = usable_cores() // spawning if isinstance(spawning, int) and spawning > 1 else 0
        for env in BLAS_ENVS + (COMPILE_ENV,):
            user_set = os.environ.get(env) or (env in BLAS_ENVS and os.environ.get("OMP_NUM_THREADS"))
            if share and not user_set:
                os.environ[env] = str(max(1, share))
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(max(1, usable_cores() // workers))


def steal_work(config, profile):
    """``-n N`` in the gpu profile schedules with xdist's "worksteal": its tests last from a second to
    minutes (a compile-per-shape kernel's feature properties), and "load", xdist's default, hands each
    worker its share of the queue up front, so the run waits on whichever drew the slow ones. An idle
    worker steals queued tests instead. A --dist given on the command line is kept."""
    if profile != "gpu" or os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "dist", None) != "load":
        return
    if any(a == "-d" or a.startswith("--dist") for a in map(str, config.invocation_params.args)):
        return
    try:
        from xdist.scheduler import WorkStealingScheduling  # noqa: F401  (pytest-xdist >= 3.2)
    except ImportError:
        return
    config.option.dist = "worksteal"
