import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny import make_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(autouse=True)
def no_leaked_generation_threads():
    """Every test must leave no a3po generation thread behind."""
    yield
    leaked = [t for t in threading.enumerate() if t.name.startswith("a3po-generation")]
    assert not leaked, f"generation threads still alive after the test: {leaked}"
