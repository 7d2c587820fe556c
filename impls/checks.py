"""flashcheck.impls.checks, the input checks a kernel module may call, lives in flashcheck.contract.checks."""
from flashcheck.contract.checks import *  # noqa: F401,F403
from flashcheck.contract.checks import __all__  # noqa: F401
