#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the default demo: asynchronous A-3PO on SmolLM2-135M-Instruct
# (converted offline from a PyPI wheel) with generated math word problems, greedy held-out accuracy before and after.
# Extra arguments go to examples/train_gsm8k.py, e.g. `bash scripts/demo.sh --max_steps 10`.
# OUTPUT_DIR (default outputs/demo) receives the model, metrics.jsonl, training.png and results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# The demo needs nothing from the Hugging Face Hub; set HF_HUB_OFFLINE=0 to train a hub model instead.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
OUTPUT_DIR="${OUTPUT_DIR:-outputs/demo}"
python examples/train_gsm8k.py --output_dir "$OUTPUT_DIR" "$@"
python - "$OUTPUT_DIR/results.json" <<'PY'
import json
import sys

results = json.load(open(sys.argv[1]))
for label in ("before", "after"):
    if label in results:
        print(f"accuracy {label}: {results[label]['accuracy']:.1%} +- {results[label]['stderr']:.1%}")
print(f"plot: {results['plot']}")
PY
