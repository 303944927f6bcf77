"""The training data of ``a3po-trl grpo``: TRL's dataset mixture (``datasets:`` in the config file, loaded by TRL's
``get_dataset``) or ``--dataset_name``, which takes what ``trl grpo`` takes (a Hub dataset) and also a local data file
(``.json``, ``.jsonl``, ``.parquet``, ``.csv``) or a local folder (written by ``save_to_disk``, or holding data
files), so that the command runs offline. The splits it trains and evaluates on must exist and have a ``prompt``
column; otherwise the error names the flag and the fix, before any model loads."""

from __future__ import annotations

import logging
from pathlib import Path

from .arguments import CommandLineError

logger = logging.getLogger(__name__)

#: The ``datasets`` builder of each local data file type ``--dataset_name`` takes.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_named_dataset(name: str, config_name: str | None = None, streaming: bool = False):
    """The ``DatasetDict`` (``IterableDatasetDict`` when ``streaming``) that ``--dataset_name name`` names: a local
    data file (one ``train`` split), a ``save_to_disk`` folder (a single ``Dataset`` becomes the ``train`` split), a
    folder of data files, or else a dataset on the Hub, loaded as ``trl grpo`` loads it."""
    from datasets import Dataset, DatasetDict, IterableDatasetDict, load_dataset, load_from_disk

    path = Path(name).expanduser()
    try:
        if path.is_file():
            builder = DATA_FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise CommandLineError(
                    f"--dataset_name {name}: a {path.suffix or 'suffix-less'} file; a local data file must be one of "
                    f"{', '.join(DATA_FILE_BUILDERS)} (or a folder written by save_to_disk)."
                )
            return load_dataset(builder, data_files=str(path), streaming=streaming)
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            dataset = load_from_disk(str(path))
            if isinstance(dataset, Dataset):
                dataset = DatasetDict({"train": dataset})
            if streaming:
                dataset = IterableDatasetDict({split: part.to_iterable_dataset() for split, part in dataset.items()})
            return dataset
        if path.is_dir():
            return load_dataset(str(path), name=config_name, streaming=streaming)
        if name.startswith((".", "/", "~")) or path.suffix.lower() in DATA_FILE_BUILDERS:
            raise CommandLineError(
                f"--dataset_name {name}: no such file or folder. Give an existing data file "
                f"({', '.join(DATA_FILE_BUILDERS)}), a folder (save_to_disk output or data files), or a Hub dataset "
                "name (org/name)."
            )
        return load_dataset(name, name=config_name, streaming=streaming)
    except CommandLineError:
        raise
    except (OSError, ValueError) as error:
        raise CommandLineError(
            f"--dataset_name {name}: could not load it ({type(error).__name__}: {error}). Check the name (and "
            "--dataset_config), or point it at a local data file or folder; without a network (HF_HUB_OFFLINE=1) a "
            "Hub dataset loads only from the cache."
        ) from error


def load_training_data(script_args, dataset_args, evaluate: bool):
    """``(train_dataset, eval_dataset)`` as ``trl grpo`` chooses them: the mixture when ``datasets`` is given (with a
    warning if ``dataset_name`` is too), else ``dataset_name``; the ``dataset_train_split`` split, and the
    ``dataset_test_split`` split when ``evaluate`` (``eval_strategy`` is not ``"no"``), else ``None``."""
    from trl import get_dataset

    if dataset_args.datasets:
        if script_args.dataset_name:
            logger.warning(
                "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
                "dataset and `dataset_name` will be ignored."
            )
        source = "the dataset mixture (`datasets` in the config file)"
        try:
            dataset = get_dataset(dataset_args)
        except (OSError, ValueError) as error:
            raise CommandLineError(
                f"{source}: could not load it ({type(error).__name__}: {error}). A local file there needs "
                "`path: json` (or parquet, csv) and `data_files: FILE`."
            ) from error
    elif script_args.dataset_name:
        source = f"--dataset_name {script_args.dataset_name}"
        dataset = load_named_dataset(
            script_args.dataset_name, script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise CommandLineError(
            "No dataset: pass --dataset_name (a Hub dataset, a local .json/.jsonl/.parquet/.csv file or a folder), or "
            "a dataset mixture (`datasets:` in the --config file)."
        )
    train_dataset = _split(dataset, script_args.dataset_train_split, "--dataset_train_split", source)
    check_prompt_column(train_dataset, source, script_args.dataset_train_split)
    if not evaluate:
        return train_dataset, None
    if script_args.dataset_test_split not in dataset:
        raise CommandLineError(
            f"{source} has no split {script_args.dataset_test_split!r} to evaluate on (its splits: {list(dataset)}). "
            "Name one with --dataset_test_split, set --eval_strategy no, or split the mixture with test_split_size."
        )
    eval_dataset = dataset[script_args.dataset_test_split]
    check_prompt_column(eval_dataset, source, script_args.dataset_test_split)
    return train_dataset, eval_dataset


def _split(dataset, split: str, flag: str, source: str):
    if split not in dataset:
        raise CommandLineError(f"{source} has no split {split!r} (its splits: {list(dataset)}); name one with {flag}.")
    return dataset[split]


def column_names(dataset) -> list[str]:
    """A dataset's columns; for a streaming dataset whose features are unknown, the keys of its first row."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    first = next(iter(dataset), None)
    return list(first) if first is not None else []


def check_prompt_column(dataset, source: str, split: str) -> None:
    """GRPO generates from the ``prompt`` column (a string, or a list of chat messages); refuse a split without it."""
    columns = column_names(dataset)
    if "prompt" not in columns:
        raise CommandLineError(
            f"{source}: the {split!r} split has no 'prompt' column (its columns: {columns}). GRPO generates from "
            "a 'prompt' column (text, or a list of chat messages); rename the column that holds the prompts to "
            "'prompt' in the data (datasets: dataset.rename_column('question', 'prompt')), or choose another "
            "dataset."
        )
