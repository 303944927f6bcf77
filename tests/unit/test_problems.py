"""Tests for a3po_trl.tasks.problems: the offline problem generator, the splits and loading GSM8K from local files."""

from __future__ import annotations

import ast
import json
import re
import statistics
from fractions import Fraction

import datasets
import pyarrow as pa
import pytest

from a3po_trl.tasks import (
    DEFAULT_SYSTEM_PROMPT,
    difficulty_spec,
    generate_arithmetic_problems,
    load_gsm8k,
    make_math_splits,
    to_prompt_dataset,
)
from a3po_trl.tasks.rewards import correctness_reward, extract_reference_answer

# ----------------------------------------------------------------------------------------------------------------
# An independent checker of generated solutions
# ----------------------------------------------------------------------------------------------------------------

_ANNOTATION = re.compile(r"<<([^=<>]+)=([0-9]+)>>")
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _evaluate(node: ast.AST, operands: list[int]) -> Fraction:
    """Exact value of an arithmetic expression of integer literals; records the literals in ``operands``."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, operands)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        operands.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _evaluate(node.left, operands) / _evaluate(node.right, operands)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left, operands), _evaluate(node.right, operands))
    raise AssertionError(f"unexpected expression node {ast.dump(node)}")


def _question_numbers(question: str) -> set[int]:
    return {int(token.replace(",", "")) for token in re.findall(r"[0-9][0-9,]*", question)}


def check_solution(question: str, solution: str) -> tuple[int, int]:
    """Re-derive a generated problem's answer from its solution text; return (answer, number of steps).

    Every step is a GSM8K calculator annotation ``<<expr=result>>``: the expression must evaluate exactly to the
    result, every literal in it must come from the question (or be an earlier result, or 100 for a percentage),
    and the last result must be the ``#### N`` answer.
    """
    lines = solution.splitlines()
    assert lines[-1].startswith("#### "), solution
    final = int(lines[-1][5:])
    known = _question_numbers(question)
    if "%" in question:
        known.add(100)
    results = []
    for line in lines[:-1]:
        annotations = _ANNOTATION.findall(line)
        assert len(annotations) == 1, line
        expression, stated = annotations[0]
        operands: list[int] = []
        value = _evaluate(ast.parse(expression, mode="eval"), operands)
        assert value == int(stated), line
        assert value >= 0, line
        for operand in operands:
            assert operand in known or operand in results, f"{operand} in {line!r} comes from nowhere: {question}"
        results.append(int(stated))
    assert results, solution
    assert results[-1] == final, solution
    return final, len(results)


# ----------------------------------------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("difficulty", ["basic", "easy", "medium", "hard", 4, 5])
def test_generated_answers_are_correct(difficulty):
    ds = generate_arithmetic_problems(150, difficulty, seed=3)
    spec = difficulty_spec(difficulty)
    assert ds.column_names == ["prompt", "question", "answer"]
    assert len(ds) == 150
    for row in ds:
        answer, steps = check_solution(row["question"], row["answer"])
        assert spec.min_steps <= steps <= spec.max_steps
        assert extract_reference_answer(row["answer"]) == str(answer)
    assert correctness_reward(ds["prompt"], ds["answer"], answer=ds["answer"]) == [1.0] * len(ds)


def test_generation_is_deterministic():
    first = generate_arithmetic_problems(40, "medium", seed=7)
    second = generate_arithmetic_problems(40, "medium", seed=7)
    other = generate_arithmetic_problems(40, "medium", seed=8)
    assert first.to_dict() == second.to_dict()
    assert first["question"] != other["question"]
    assert (
        generate_arithmetic_problems(5, 2, seed=7).to_dict()
        == generate_arithmetic_problems(5, seed=7, difficulty="medium").to_dict()
    )


def test_templates_are_varied_and_questions_distinct():
    ds = generate_arithmetic_problems(300, "easy", seed=0)
    assert len(set(ds["question"])) == len(ds)
    openings = {question.split(" ")[1] for question in ds["question"]}
    assert len(openings) > 10
    keywords = ["buys", "has", "per", "shares", "years old", "km", "% off"]
    for keyword in keywords:
        assert any(keyword in question for question in ds["question"]), keyword


def test_difficulty_changes_number_ranges_and_steps():
    stats = {}
    for difficulty in ("easy", "medium", "hard"):
        ds = generate_arithmetic_problems(200, difficulty, seed=1)
        numbers = [n for question in ds["question"] for n in _question_numbers(question)]
        answers = [check_solution(q, a)[1] for q, a in zip(ds["question"], ds["answer"])]
        stats[difficulty] = (statistics.median(numbers), max(numbers), statistics.mean(answers))
    assert stats["easy"][0] < stats["medium"][0] < stats["hard"][0]
    assert stats["easy"][1] < stats["medium"][1] < stats["hard"][1]
    assert stats["easy"][2] < stats["medium"][2] < stats["hard"][2]
    assert stats["easy"][1] <= 200


def test_basic_problems_take_one_step():
    ds = generate_arithmetic_problems(200, "basic", seed=2)
    assert {check_solution(q, a)[1] for q, a in zip(ds["question"], ds["answer"])} == {1}
    assert difficulty_spec(0) is difficulty_spec("basic")


@pytest.mark.parametrize("bad", ["extreme", "", -1, 6, True, 1.5, None])
def test_unknown_difficulty(bad):
    with pytest.raises(ValueError, match="difficulty"):
        generate_arithmetic_problems(3, bad)


def test_prompt_format():
    ds = generate_arithmetic_problems(3, seed=0)
    prompt = ds[0]["prompt"]
    assert prompt[0] == {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
    assert "####" in prompt[0]["content"]
    assert prompt[1] == {"role": "user", "content": ds[0]["question"]}
    bare = generate_arithmetic_problems(3, seed=0, system_prompt=None)
    assert bare[0]["prompt"] == [{"role": "user", "content": ds[0]["question"]}]


def test_exclude_and_zero():
    ds = generate_arithmetic_problems(20, seed=0)
    excluded = generate_arithmetic_problems(20, seed=0, exclude=ds["question"][:5])
    assert not set(ds["question"][:5]) & set(excluded["question"])
    assert len(generate_arithmetic_problems(0)) == 0
    with pytest.raises(ValueError):
        generate_arithmetic_problems(-1)


def test_math_splits_are_disjoint_and_stable():
    train, eval_ds = make_math_splits(400, 100, "easy", seed=0)
    assert (len(train), len(eval_ds)) == (400, 100)
    assert not set(train["question"]) & set(eval_ds["question"])
    assert len(set(train["question"])) == 400
    again_train, again_eval = make_math_splits(400, 100, "easy", seed=0)
    assert again_train.to_dict() == train.to_dict() and again_eval.to_dict() == eval_ds.to_dict()
    _, eval_small_train = make_math_splits(10, 100, "easy", seed=0)
    assert eval_small_train["question"] == eval_ds["question"]
    _, other_eval = make_math_splits(10, 100, "easy", seed=1)
    assert other_eval["question"] != eval_ds["question"]
    for row in eval_ds:
        check_solution(row["question"], row["answer"])


# ----------------------------------------------------------------------------------------------------------------
# Loading GSM8K-format data from local files
# ----------------------------------------------------------------------------------------------------------------

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
]
EXPECTED = ["72", "10", "1234"]


def _check_loaded(ds):
    assert ds.column_names[:3] == ["prompt", "question", "answer"]
    assert ds["question"] == [row["question"] for row in GSM8K_ROWS]
    assert [extract_reference_answer(answer) for answer in ds["answer"]] == EXPECTED
    assert ds[0]["prompt"][-1] == {"role": "user", "content": GSM8K_ROWS[0]["question"]}
    assert ds[0]["prompt"][0]["role"] == "system"


def _write_json(path):
    path.write_text(json.dumps(GSM8K_ROWS), encoding="utf-8")


def _write_jsonl(path):
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS), encoding="utf-8")


def _write_parquet(path):
    datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(str(path))


def _write_csv(path):
    datasets.Dataset.from_list(GSM8K_ROWS).to_csv(str(path), index=False)


def _write_arrow_stream(path):
    table = pa.Table.from_pylist(GSM8K_ROWS)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _write_arrow_file(path):
    table = pa.Table.from_pylist(GSM8K_ROWS)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.mark.parametrize(
    ("filename", "writer"),
    [
        ("train.json", _write_json),
        ("train.jsonl", _write_jsonl),
        ("train.parquet", _write_parquet),
        ("train.csv", _write_csv),
        ("stream.arrow", _write_arrow_stream),
        ("file.arrow", _write_arrow_file),
    ],
)
def test_load_gsm8k_from_file(tmp_path, filename, writer):
    path = tmp_path / filename
    writer(path)
    _check_loaded(load_gsm8k(str(path)))
    _check_loaded(load_gsm8k(path))


def test_load_gsm8k_from_save_to_disk(tmp_path):
    datasets.Dataset.from_list(GSM8K_ROWS).save_to_disk(str(tmp_path / "single"))
    _check_loaded(load_gsm8k(tmp_path / "single"))
    arrow_files = sorted((tmp_path / "single").glob("*.arrow"))
    _check_loaded(load_gsm8k(arrow_files[0]))

    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GSM8K_ROWS), "test": datasets.Dataset.from_list(GSM8K_ROWS[:1])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    _check_loaded(load_gsm8k(tmp_path / "dict", split="train"))
    assert len(load_gsm8k(tmp_path / "dict", split="test")) == 1
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\].*'validation'"):
        load_gsm8k(tmp_path / "dict", split="validation")


def test_load_gsm8k_from_plain_data_directory(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl")
    (tmp_path / "test.jsonl").write_text(json.dumps(GSM8K_ROWS[0]) + "\n")
    _check_loaded(load_gsm8k(tmp_path, split="train"))
    assert list(load_gsm8k(tmp_path, split="test", config=None)["question"]) == [GSM8K_ROWS[0]["question"]]


def test_load_gsm8k_keeps_extra_columns_and_custom_system_prompt(tmp_path):
    path = tmp_path / "extra.jsonl"
    path.write_text("".join(json.dumps({**row, "id": i}) + "\n" for i, row in enumerate(GSM8K_ROWS)))
    ds = load_gsm8k(path, system_prompt="Be brief.")
    assert ds["id"] == [0, 1, 2]
    assert ds[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_load_gsm8k_missing_file(tmp_path):
    missing = tmp_path / "nope" / "gsm8k.jsonl"
    with pytest.raises(ValueError, match=re.escape(str(missing))) as info:
        load_gsm8k(str(missing))
    assert "does not exist" in str(info.value) and "save_to_disk" in str(info.value)
    with pytest.raises(ValueError, match="does not exist"):
        load_gsm8k("./definitely-not-here")


def test_load_gsm8k_wrong_schema(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['question', 'answer'\]") as info:
        load_gsm8k(path)
    message = str(info.value)
    assert str(path) in message and "rename_column" in message and "to_prompt_dataset" in message


def test_load_gsm8k_unreadable_and_unsupported(tmp_path):
    corrupt = tmp_path / "broken.parquet"
    corrupt.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match=re.escape(str(corrupt))):
        load_gsm8k(corrupt)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"Unsupported GSM8K file type '\.txt'"):
        load_gsm8k(text)


def test_to_prompt_dataset_custom_columns():
    raw = datasets.Dataset.from_dict({"problem": ["2+2?"], "solution": [4], "prompt": ["old"]})
    ds = to_prompt_dataset(raw, system_prompt=None, question_column="problem", answer_column="solution")
    assert ds[0]["prompt"] == [{"role": "user", "content": "2+2?"}]
    assert ds[0]["question"] == "2+2?" and ds[0]["answer"] == "4"
    assert ds.column_names[:3] == ["prompt", "question", "answer"]
    with pytest.raises(ValueError, match=r"missing column\(s\) \['question'\]"):
        to_prompt_dataset(datasets.Dataset.from_dict({"answer": ["1"]}))


def test_token_preference_rewards_the_share_of_slots_holding_the_prompts_class():
    from a3po_trl.tasks.token_preference import (
        make_token_preference_prompts,
        make_token_preference_tokenizer,
        token_preference_reward,
    )

    tokenizer = make_token_preference_tokenizer(num_classes=4, symbols=16)
    ids = tokenizer("t2 t6 t3 t14 <eos>")["input_ids"]
    assert tokenizer.decode(ids) == "t2 t6 t3 t14 <eos>"
    reward = token_preference_reward(tokenizer, max_completion_length=8)
    # class 2: t2, t6 and t14 count; t3 and the end token do not; the 3 empty slots earn nothing
    assert reward(completion_ids=[ids, ids], target=[2, 3]) == [3 / 8, 1 / 8]
    prompts = make_token_preference_prompts(10, num_classes=4, seed=1)
    assert sorted(prompts["target"]) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert all(p == f"c{k}" for p, k in zip(prompts["prompt"], prompts["target"]))
