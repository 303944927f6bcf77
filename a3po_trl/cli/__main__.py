"""``python -m a3po_trl.cli grpo ...``, ``accelerate launch [options] -m a3po_trl.cli grpo ...``: train in this
process (``a3po-trl grpo`` launches this)."""

from a3po_trl.cli import run

if __name__ == "__main__":
    raise SystemExit(run())
