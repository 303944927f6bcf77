"""``python -m benchmarks.compare``: TRL's GRPOTrainer vs AsyncA3POTrainer, one concern per module.

``cli`` is the entry point: its command line and ``main`` (``__main__`` runs it). The work divides into:

- ``plan``: the configurations, their defaults (model presets, quick/full run lengths) and the ordered plan of runs;
- ``worker``: what a worker subprocess does for one configuration (the runs themselves go through the shared runner,
  :mod:`benchmarks.common.runner`: a subprocess per run, reruns on a disturbed machine, resuming);
- ``trainers``: the model, data, rewards, training arguments and trainer of one configuration (inside the worker);
- ``microbench``: the loglinear vs recompute proximal log-probs micro-benchmark (inside the worker);
- ``metrics``: per-step series from the trainers' logs, per-run summaries, aggregates over seeds;
- ``analysis``: ideal vs achieved pipelining, final reward loglinear vs recompute, the targets and whether they
  were met;
- ``report``: the report dictionary (the JSON), profile summaries, ``--merge-from``;
- ``markdown`` and ``plot``: the report as markdown tables and as a PNG.

Only the worker's modules import torch, transformers and trl, and only inside functions; ``plot`` imports
matplotlib when it draws.
"""
