"""python -m flashcheck: the flashcheck command, for an interpreter whose scripts are not on PATH."""
import sys

from flashcheck.cli import main

sys.exit(main())
