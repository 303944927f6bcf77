"""The pieces of ``benchmarks/compare.py`` (TRL's GRPOTrainer vs AsyncA3POTrainer), one concern per module.

``benchmarks/compare.py`` is the entry point: its command line and ``main``. The work divides into:

- ``plan``: the configurations, their defaults (model presets, quick/full run lengths) and the ordered plan of runs;
- ``runner``: the orchestrator side, one worker subprocess per configuration, reruns on a disturbed machine, partial
  reports after every run;
- ``worker``: what a worker subprocess does: run its configurations and write their raw records;
- ``trainers``: the model, data, rewards, training arguments and trainer of one configuration (inside the worker);
- ``microbench``: the loglinear vs recompute proximal log-probs micro-benchmark (inside the worker);
- ``machine_load``: CPU used by other processes (``/proc/stat``) and waiting for a quiet machine;
- ``metrics``: per-step series from the trainers' logs, per-run summaries, aggregates over seeds;
- ``analysis``: ideal vs achieved pipelining, final reward loglinear vs recompute, the targets and whether they
  were met;
- ``report``: the report dictionary (the JSON), machine and profile information, ``--merge-from``;
- ``markdown`` and ``plot``: the report as markdown tables and as a PNG.

Only the worker's modules import torch, transformers and trl, and only inside functions; ``plot`` imports
matplotlib when it draws.
"""
