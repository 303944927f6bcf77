"""Math word-problem datasets in GSM8K format, for reinforcement learning with verifiable rewards.

Every dataset built here has the columns:

* ``prompt``: conversational, ``[{"role": "system", ...}, {"role": "user", "content": question}]``; the system
  message asks the model to end with ``#### <number>``.
* ``question``: the problem text.
* ``answer``: a GSM8K-style solution ending in ``#### N``, as :func:`.rewards.correctness_reward` expects.

Sources are the real GSM8K (:func:`load_gsm8k`, from the hub or from local files) and an offline generator of
GSM8K-style problems with exactly known integer answers (:func:`generate_arithmetic_problems`,
:func:`make_math_splits`). Generated solutions write every step as a GSM8K calculator annotation
``a * b = <<a*b=c>>c``, so each answer can be re-derived from the solution text alone.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets

from .arithmetic_templates import DifficultySpec, difficulty_spec, generate_problem_texts

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "DifficultySpec",
    "difficulty_spec",
    "generate_arithmetic_problems",
    "load_gsm8k",
    "make_math_splits",
    "to_prompt_dataset",
]

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step, then write the final answer "
    "on the last line as '#### <number>'."
)


# --------------------------------------------------------------------------------------------------------------
# Prompt formatting
# --------------------------------------------------------------------------------------------------------------


def _make_prompt(question: str, system_prompt: str | None) -> list[dict[str, str]]:
    """The conversational prompt for one question."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": question}]


def to_prompt_dataset(
    ds: datasets.Dataset,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    *,
    question_column: str = "question",
    answer_column: str = "answer",
) -> datasets.Dataset:
    """Add the conversational ``prompt`` column to a dataset of questions and answers.

    Args:
        ds: A dataset with a question column and an answer column (GSM8K's schema by default).
        system_prompt: The system message placed before each question; None or ``""`` for none.
        question_column: Name of the column holding the problem text.
        answer_column: Name of the column holding the solution (``... #### N``) or the bare answer.

    Returns:
        The dataset with ``prompt`` (conversational), ``question`` and ``answer`` (both strings); other columns
        are kept. An existing ``prompt`` column is replaced.

    Raises:
        ValueError: If a column is missing.
    """
    missing = [column for column in (question_column, answer_column) if column not in ds.column_names]
    if missing:
        raise ValueError(
            f"to_prompt_dataset: missing column(s) {missing}; the dataset has {ds.column_names}. Pass "
            "question_column=/answer_column= naming the columns that hold the problem and its answer."
        )

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        question = str(row[question_column])
        return {
            "prompt": _make_prompt(question, system_prompt),
            "question": question,
            "answer": str(row[answer_column]),
        }

    remove = ["prompt"] if "prompt" in ds.column_names else None
    converted = ds.map(convert, remove_columns=remove, desc="Formatting prompts")
    front = ["prompt", "question", "answer"]
    return converted.select_columns(front + [c for c in converted.column_names if c not in front])


def _records(questions: list[str], solutions: list[str], system_prompt: str | None) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "prompt": [_make_prompt(question, system_prompt) for question in questions],
            "question": questions,
            "answer": solutions,
        }
    )


def generate_arithmetic_problems(
    n: int,
    difficulty: str | int = "easy",
    seed: int = 0,
    *,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    exclude: Iterable[str] = (),
) -> datasets.Dataset:
    """Generate ``n`` distinct GSM8K-style word problems with exact integer answers, offline.

    Problems come from varied templates (shopping, stock changes over a week, production rates, equal sharing,
    ages, travel distances, percentage discounts). The difficulty sets the number ranges and the number of
    arithmetic steps (see :func:`difficulty_spec`): basic one step and easy 1-2 steps with numbers up to 20,
    medium 2-3 steps up to 100, hard 3-5 steps up to 1000.

    Each ``answer`` is a solution with one step per line written as a GSM8K calculator annotation
    (``3 * 4 = <<3*4=12>>12``), the last step giving the answer, and a final line ``#### N``.

    Args:
        n: Number of problems.
        difficulty: ``"basic"``, ``"easy"``, ``"medium"``, ``"hard"`` or an integer level 0-5.
        seed: Random seed; the same arguments always give the same dataset.
        system_prompt: System message of each prompt (None for none).
        exclude: Question texts that must not be generated (to hold out an evaluation set).

    Returns:
        A dataset with columns ``prompt``, ``question`` and ``answer``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    spec = difficulty_spec(difficulty)
    questions, solutions = generate_problem_texts(n, spec, random.Random(seed), set(exclude))
    return _records(questions, solutions, system_prompt)


def make_math_splits(
    num_train: int,
    num_eval: int,
    difficulty: str | int = "easy",
    seed: int = 0,
    *,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Generate a training set and a held-out evaluation set with no question in common.

    The evaluation set depends only on ``num_eval``, ``difficulty`` and ``seed`` (not on ``num_train``), so runs
    with different training sizes are evaluated on the same problems.

    Returns:
        ``(train_ds, eval_ds)``, each as described in :func:`generate_arithmetic_problems`.
    """
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"num_train and num_eval must be >= 0, got {num_train} and {num_eval}")
    spec = difficulty_spec(difficulty)
    eval_rng, train_rng = random.Random(f"a3po-trl-eval-{seed}"), random.Random(seed)
    eval_questions, eval_solutions = generate_problem_texts(num_eval, spec, eval_rng, set())
    train_questions, train_solutions = generate_problem_texts(num_train, spec, train_rng, set(eval_questions))
    return (
        _records(train_questions, train_solutions, system_prompt),
        _records(eval_questions, eval_solutions, system_prompt),
    )


# --------------------------------------------------------------------------------------------------------------
# Real GSM8K
# --------------------------------------------------------------------------------------------------------------

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_GSM8K_COLUMNS = ("question", "answer")


def _looks_local(source: str) -> bool:
    """Whether ``source`` names a local path rather than a hub dataset."""
    return (
        Path(source).expanduser().exists()
        or source.startswith((".", "/", "~", "\\"))
        or Path(source).suffix.lower() in _FILE_BUILDERS
    )


def _load_directory(path: Path, split: str, config: str | None) -> datasets.Dataset:
    """Load a plain data directory (e.g. a clone of a hub dataset), with ``config`` when it defines one."""
    if config:
        try:
            return datasets.load_dataset(str(path), config, split=split)
        except ValueError:
            pass
    return datasets.load_dataset(str(path), split=split)


def _load_local(path: Path, split: str, config: str | None) -> datasets.Dataset:
    """Load a local file or directory as one split."""
    if not path.exists():
        raise ValueError(
            f"GSM8K source {str(path)!r} does not exist. Pass an existing .json/.jsonl/.parquet/.arrow/.csv file, "
            "a directory written by Dataset.save_to_disk, or a hub dataset name such as 'openai/gsm8k'."
        )
    builder = None if path.is_dir() else _FILE_BUILDERS.get(path.suffix.lower())
    if not path.is_dir() and builder is None:
        raise ValueError(
            f"Unsupported GSM8K file type {path.suffix!r} for {str(path)!r}; use one of "
            f"{sorted(_FILE_BUILDERS)} or a directory written by Dataset.save_to_disk."
        )
    try:
        if builder is not None:
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
        elif (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = _load_directory(path, split, config)
    except Exception as exc:
        raise ValueError(f"Could not read GSM8K data from {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"{str(path)!r} has splits {sorted(loaded)}, not {split!r}; pass split= with one of them."
            )
        loaded = loaded[split]
    return loaded


def load_gsm8k(
    source: str | Path = "openai/gsm8k",
    split: str = "train",
    config: str | None = "main",
    *,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
) -> datasets.Dataset:
    """Load GSM8K (or a dataset in its schema) and convert it to the ``prompt``/``question``/``answer`` format.

    Args:
        source: A hub dataset name (default ``"openai/gsm8k"``; needs internet), or a local ``.json``,
            ``.jsonl``, ``.parquet``, ``.arrow`` or ``.csv`` file, or a directory written by
            ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, with GSM8K's columns ``question`` and
            ``answer``. A single file is taken whole, whatever ``split`` says.
        split: The split to load from the hub or from a saved ``DatasetDict``.
        config: The hub configuration (``"main"`` or ``"socratic"`` for GSM8K); ignored for local files and
            ``save_to_disk`` directories.
        system_prompt: System message of each prompt (None for none).

    Returns:
        The converted dataset (extra columns are kept).

    Raises:
        ValueError: If a local source is missing or unreadable, or lacks the ``question``/``answer`` columns.
    """
    source_str = str(source)
    if isinstance(source, Path) or _looks_local(source_str):
        ds = _load_local(Path(source_str).expanduser(), split, config)
    else:
        ds = datasets.load_dataset(source_str, config, split=split)
    missing = [column for column in _GSM8K_COLUMNS if column not in ds.column_names]
    if missing:
        raise ValueError(
            f"GSM8K source {source_str!r} lacks column(s) {missing} (it has {ds.column_names}). load_gsm8k expects "
            "GSM8K's schema: a 'question' string and an 'answer' string ending in '#### <number>'. Rename the "
            "columns first (ds.rename_column('problem', 'question')) or call to_prompt_dataset(ds, "
            "question_column=..., answer_column=...) on a dataset you loaded yourself."
        )
    return to_prompt_dataset(ds, system_prompt)
