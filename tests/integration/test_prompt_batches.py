"""The generator's prompts are the ones GRPOTrainer's dataloader gives, map-style and streamed
(a3po_trl.rollout.prompt_batches)."""

import pytest
from datasets import Dataset, IterableDataset
from helpers import logged, make_trainer
from tiny import make_prompts

from a3po_trl.rollout.prompt_batches import repeated_prompt_batches


def _texts(rows):
    return [row["prompt"][0]["content"] for row in rows]


def _stream(dataset: Dataset) -> IterableDataset:
    rows = [dict(row) for row in dataset]
    return IterableDataset.from_generator(lambda: iter(rows))


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_prompt_batches_follow_grpo_trainers_dataloader_over_epochs(tokenizer, tmp_path, kind, shuffle):
    dataset = make_prompts(10)
    train = _stream(dataset) if kind == "iterable" else dataset
    trainer = make_trainer(
        tokenizer, tmp_path, dataset=train, per_device_train_batch_size=8, steps_per_generation=1, max_steps=12
    )
    trainer.shuffle_dataset = trainer.args.shuffle_dataset = shuffle
    expected = []
    loader = trainer.get_train_dataloader()
    for epoch in range(3):  # 10 prompts, 2 per batch: 5 batches an epoch
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        expected.extend(_texts(batch) for batch in loader)
    ours = repeated_prompt_batches(train, num_generations=4, local_batch_size=8, shuffle=shuffle, seed=0)
    produced = [_texts(next(ours)) for _ in range(len(expected))]
    assert len(expected) == 15 and produced == expected
    skipped = repeated_prompt_batches(train, 4, 8, shuffle=shuffle, seed=0, skip_batches=7)
    assert _texts(next(skipped)) == expected[7]


def test_processes_take_whole_groups_of_each_global_batch():
    dataset = make_prompts(12)
    whole = repeated_prompt_batches(dataset, num_generations=4, local_batch_size=8, num_processes=1, shuffle=False)
    first = [repeated_prompt_batches(dataset, 4, 4, process_index=p, num_processes=2, shuffle=False) for p in (0, 1)]
    for _ in range(3):
        ranks = [next(source) for source in first]
        global_rows = next(whole)
        assert ranks[0] + ranks[1] == global_rows[:4] + global_rows[4:]
        assert all(len({str(row["prompt"]) for row in rank}) == 1 for rank in ranks)  # one whole group each
    with pytest.raises(ValueError, match="whole groups"):
        next(repeated_prompt_batches(dataset, 4, 6))


def test_a_stream_too_short_for_one_batch_is_an_error():
    with pytest.raises(ValueError, match="streams fewer prompts"):
        next(repeated_prompt_batches(_stream(make_prompts(1)), num_generations=4, local_batch_size=8))


def test_training_on_an_iterable_dataset(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, dataset=_stream(make_prompts(6)), max_steps=8, max_staleness=1)
    assert trainer.args.accelerator_config.dispatch_batches is False  # as GRPOTrainer sets it for streams
    trainer.train()
    producer = trainer.last_batch_producer
    assert producer.produced == producer.consumed == 8
    assert max(logged(trainer, "a3po/staleness_max")) <= 1
