"""Where the benchmark lives: the repository root, the tests folder (``tests/tiny.py``) and the entry-point script."""

import os

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCHMARKS)
TESTS = os.path.join(ROOT, "tests")
#: ``benchmarks/compare.py``: the command the workers are started with and the one recorded in the report.
COMPARE_SCRIPT = os.path.join(BENCHMARKS, "compare.py")
