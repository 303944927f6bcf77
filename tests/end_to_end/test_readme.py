"""The README's usage snippet runs as written (on this CPU machine, offline)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def _usage_snippet() -> str:
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    usage = readme[readme.index("## Usage") :]
    return re.search(r"```python\n(.*?)```", usage, re.DOTALL).group(1)


def test_usage_snippet_runs_as_written(tmp_path):
    snippet = _usage_snippet()
    assert "AsyncA3POTrainer" in snippet and "trainer.train()" in snippet
    script = tmp_path / "usage.py"
    script.write_text(snippet + "\nprint('global_step', trainer.state.global_step)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "global_step 4" in result.stdout
