"""`python -m benchmarks`: see benchmarks/harness/runner.py."""
import sys

from .harness.runner import main

sys.exit(main())
