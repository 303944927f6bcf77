#!/usr/bin/env bash
# The lowest versions pyproject.toml allows of trl, transformers, peft, accelerate and datasets, in an environment of
# their own (.venv-lowest) layered over .venv's packages (torch and everything else shared, older dependencies pip
# needs for these installed on top), running the named subset: the unit tests and the GRPO equivalence tests.
# .venv (scripts/setup.sh) holds the highest allowed versions, as pip resolves them. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN="${A3PO_MAIN_VENV:-.venv}"
VENV="${A3PO_LOWEST_VENV:-.venv-lowest}"
[ -x "$VENV/bin/python" ] || "$MAIN/bin/python" -m venv "$VENV"
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
# a .pth file named to sort last: the environment's own packages come first on sys.path, then .venv's
"$MAIN/bin/python" -c "$purelib" >"$("$VENV/bin/python" -c "$purelib")/zz_a3po_main_venv.pth"
lowest=$("$VENV/bin/python" - <<'PY'
import re

text = open("pyproject.toml").read()
dependencies = text[text.index("dependencies = [") : text.index("]", text.index("dependencies = ["))]
for name, version in re.findall(r'"(trl|transformers|peft|accelerate|datasets)(?:>=|==)([0-9][^,"]*)', dependencies):
    print(f"{name}=={version}")
PY
)
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet $lowest
"$VENV/bin/python" -m pip list 2>/dev/null | grep -E '^(torch|trl|transformers|peft|accelerate|datasets) '
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit tests/integration/test_grpo_equivalence.py "$@"
