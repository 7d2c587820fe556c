"""Hypothesis profiles, registered in one place and loaded by the pytest plugin (flashcheck/plugin.py).

Pick one with ``--hypothesis-profile NAME`` or ``FLASHCHECK_PROFILE=NAME``; ``ci`` loads
by itself when the CI environment variable is set. FLASHCHECK_SKIP_EXAMPLES=1 drops the
``@example`` pins, so that only generated and shrunk cases can fail (the mutant test uses it).
FLASHCHECK_RANDOMIZE=1 keeps a profile's settings but lifts its derandomization, so that
``--hypothesis-seed N`` draws a different sample: how CI's profile is swept for false alarms.
"""
import os

from hypothesis import HealthCheck, Phase, settings

# Kernels are slow per example by nature (compiles, interpreters): that is not a test smell.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
# Explaining a failure re-runs the test many times to annotate lines; shrinking already
# tells a kernel author what they need, so the fast profiles skip it.
_NO_EXPLAIN = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)

settings.register_profile("default", max_examples=40, deadline=None, suppress_health_check=_SLOW_OK,
                          phases=_NO_EXPLAIN)
settings.register_profile("ci", max_examples=25, derandomize=True, database=None, deadline=None,
                          suppress_health_check=_SLOW_OK, phases=_NO_EXPLAIN, print_blob=True)
settings.register_profile("gpu", max_examples=30, deadline=None, suppress_health_check=_SLOW_OK,
                          phases=_NO_EXPLAIN)
settings.register_profile("thorough", max_examples=2000, deadline=None, suppress_health_check=_SLOW_OK)
# Nightly, on CUDA: the gpu profile's draws, and the scale property's every target (strategies/scale.py):
# a few examples, each of them gigabytes
settings.register_profile("gpu-scale", settings.get_profile("gpu"), max_examples=6)


def without_pins(profile: str) -> str:
    """The same profile minus the @example pins: kills must come from generation and shrinking."""
    name = f"{profile}-nopins"
    base = settings.get_profile(profile)
    settings.register_profile(name, base, phases=[p for p in base.phases if p is not Phase.explicit])
    return name


def randomized(profile: str) -> str:
    """The same profile, drawn from the run's seed instead of one fixed stream per test."""
    name = f"{profile}-random"
    settings.register_profile(name, settings.get_profile(profile), derandomize=False)
    return name


def default_profile() -> str:
    if os.environ.get("FLASHCHECK_PROFILE"):
        return os.environ["FLASHCHECK_PROFILE"]
    return "ci" if os.environ.get("CI") else "default"


NAMES = ("default", "ci", "gpu", "gpu-scale", "thorough")


def load(name: str) -> None:
    """Load profile ``name`` (drawn from the run's seed under FLASHCHECK_RANDOMIZE, minus the pins
    under FLASHCHECK_SKIP_EXAMPLES); a clear error if unknown."""
    if name.removesuffix("-nopins").removesuffix("-random") not in NAMES:
        raise ValueError(f"unknown Hypothesis profile {name!r}; flashcheck registers {', '.join(NAMES)} "
                         "(--hypothesis-profile NAME or FLASHCHECK_PROFILE=NAME)")
    if os.environ.get("FLASHCHECK_RANDOMIZE"):
        name = randomized(name)
    settings.load_profile(without_pins(name) if os.environ.get("FLASHCHECK_SKIP_EXAMPLES") else name)


# Loaded on import so that a bare ``python -c`` sees the same settings as pytest; an unknown
# name is left for the pytest plugin to refuse with one line (an import must not fail on it).
if default_profile() in NAMES:
    load(default_profile())
