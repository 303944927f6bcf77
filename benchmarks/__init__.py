"""The benchmarks of a3po-trl, a package so that each script imports the shared library (:mod:`benchmarks.common`)
by name: run them from the repository root as modules, ``python -m benchmarks.<script>`` (``benchmarks/README.md``)."""
