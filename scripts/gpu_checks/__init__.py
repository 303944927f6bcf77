"""The parts of ``scripts/gpu_check.py``: what is trained (:mod:`.model`), one training run and what it measures
(:mod:`.runs`, :mod:`.figures`), the checks (:mod:`.checks`) and how they are judged (:mod:`.verdict`)."""
