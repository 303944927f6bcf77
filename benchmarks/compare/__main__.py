"""``python -m benchmarks.compare``: see :mod:`benchmarks.compare.cli`."""

from .cli import main

main()
