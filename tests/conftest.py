"""The test suite, laid out like the package's layers:

- ``unit/``: one module at a time, and no trainer is built (functional, producer, config, rewards, tasks, layout, ...);
- ``integration/``: files with tests that build or train an ``AsyncA3POTrainer``, on the tiny model (``test_schedule``,
  ``test_prompt_batches`` and ``test_plotting`` too, for their tests through the trainer; ``test_distributed`` and
  ``test_vllm`` under ``accelerate launch`` or vLLM);
- ``end_to_end/``: the README, notebooks, examples, the SmolLM2 pipeline, the benchmarks and the soak, as a user runs
  them.

Shared helpers live here, never in a ``test_*.py`` file: ``tiny.py`` (tokenizers, models, prompts, rewards) and
``helpers.py`` (building and reading a trainer); ``scripts/`` holds the programs the tests launch. This folder goes on
``sys.path`` so every test file, in whichever subfolder, imports them by name.
"""

import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny import make_tokenizer, make_tool_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tool_tokenizer():
    """The tiny tokenizer with a chat template that renders tools and tool calls (multi-turn tests)."""
    return make_tool_tokenizer()


@pytest.fixture(autouse=True)
def no_leaked_generation_threads():
    """Every test must leave no a3po generation thread behind."""
    yield
    leaked = [t for t in threading.enumerate() if t.name.startswith("a3po-generation")]
    assert not leaked, f"generation threads still alive after the test: {leaked}"
