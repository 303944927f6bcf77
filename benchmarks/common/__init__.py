"""What the benchmark scripts share, one concern per module:

- ``runner``: the one resumable configuration x seed runner: a study's cells, one subprocess per run, its record back
  on stdout, one JSON file per finished run, resuming; the machine's load recorded for every run;
- ``intervals``: t intervals over seeds (scipy's exact quantile), paired differences, t-test p-values, Holm's
  correction within a family, two one-sided tests of equivalence against a declared margin;
- ``study_plot``: the staleness study's plot (held-out and training reward per staleness bound);
- ``machine``: CPU used by other processes during a run, waiting for a quiet machine, what the machine is;
- ``provenance``: the block every record carries (when, at which commit, on which machine, other processes' share of
  it, each thread's intra-op threads, ``OMP_WAIT_POLICY``, what was not recorded), and the check that refuses a
  record without it;
- ``internals``: every name of ``a3po_trl``'s internals that a benchmark reads (the engine's counters, the generator's
  backend, the source locations a profile is sorted by), so that a rename in the package is fixed here once;
- ``tiny``: an ``AsyncA3POTrainer`` on the tiny random model of :mod:`a3po_trl.tasks.tiny_model`, for measurements
  of the trainer's own overhead.
"""
