"""Tests for a3po_trl.tasks.rewards: answer extraction and the TRL reward functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po_trl.tasks.rewards import (
    FORMAT_REWARD,
    completion_to_text,
    correctness_reward,
    extract_answer,
    extract_reference_answer,
    format_reward,
)


class _Opaque:
    """An arbitrary object with a stable repr (for test ids)."""

    def __repr__(self):
        return "<opaque>"


GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)

EXTRACTION_CASES = [
    # explicit markers
    ("#### 42", "42"),
    ("Some work 3 + 4 = 7\n#### 42", "42"),
    ("#### $1,234.00", "1234"),
    ("####42", "42"),
    ("\\boxed{42}", "42"),
    ("Final Answer: The final answer is $\\boxed{1,000}$. I hope it is correct.", "1000"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("\\boxed{\\text{42 apples}}", "42"),
    ("\\boxed{x = 4}", "4"),
    ("The answer is 42.", "42"),
    ("answer: $42", "42"),
    ("Answer = 77", "77"),
    ("The answer is therefore **$18**.", "18"),
    ("The answer is -7.", "-7"),
    ("The answer is 1/3", "1/3"),
    # marker priority over later numbers and over other markers
    ("#### 42\nThe answer is 7", "42"),
    ("\\boxed{5} and then 9 more", "5"),
    ("The answer is 5. Wait, recompute. The answer is 6.", "6"),
    ("The answer is 10 apples, since 3 + 7 = 10 and 2 more is 12", "10"),
    # last number fallback, with formatting
    ("1,234", "1234"),
    ("-7", "-7"),
    ("$5.00", "5"),
    ("42 apples", "42"),
    ("50%", "50"),
    ("So she drives 12 km", "12"),
    ("3.50", "3.5"),
    ("12.0", "12"),
    (".5", "0.5"),
    ("Total: $1,234.50", "1234.5"),
    ("-$1,000", "-1000"),
    ("$-5", "-5"),
    ("(-7)", "-7"),
    ("\u2212 8", "-8"),
    ("1 2 3", "3"),
    ("I think 5 apples + 3 = 8 apples", "8"),
    ("x = 5 - 3 = 2", "2"),
    ("pages 10-12", "12"),
    ("COVID-19", "19"),
    ("12,34", "34"),
    ("-0", "0"),
    # no answer at all
    ("no number here", None),
    ("", None),
    (None, None),
    ("####", None),
    ("\\boxed{", None),
    ("\u00e9\u6f22\u5b57\U0001f600\x00\ufffd", None),
    ("9" * 200, None),
    (True, None),
    (_Opaque(), None),
    # non-string inputs
    (42, "42"),
    (3.5, "3.5"),
    ([{"role": "assistant", "content": "#### 9"}], "9"),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACTION_CASES, ids=[repr(c[0])[:40] for c in EXTRACTION_CASES])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extraction_table_is_large():
    assert len(EXTRACTION_CASES) >= 25


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (GSM8K_SOLUTION, "72"),
        ("42", "42"),
        ("1,000", "1000"),
        (" 18 ", "18"),
        (5, "5"),
        ("Step 1: 3 + 4 = <<3+4=7>>7\n#### 1,234", "1234"),
        ("#### -3", "-3"),
        ("", None),
        (None, None),
        ("no digits", None),
    ],
)
def test_extract_reference_answer(answer, expected):
    assert extract_reference_answer(answer) == expected


def test_completion_to_text():
    assert completion_to_text("plain") == "plain"
    assert completion_to_text([{"role": "assistant", "content": "hi"}]) == "hi"
    assert completion_to_text({"role": "assistant", "content": "one"}) == "one"
    multi_turn = [
        {"role": "assistant", "content": "calling a tool"},
        {"role": "tool", "content": "tool says 99"},
        {"role": "assistant", "content": "#### 5"},
    ]
    assert completion_to_text(multi_turn) == "calling a tool\n#### 5"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "#### 3"}]}]
    assert completion_to_text(parts) == "#### 3"
    assert completion_to_text(None) == ""
    assert completion_to_text(17) == ""


def _conversational(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("wrap", [lambda text: text, _conversational], ids=["string", "conversational"])
def test_correctness_reward(wrap):
    completions = [
        wrap("48 / 2 = 24, 48 + 24 = 72\n#### 72"),
        wrap("The answer is 72."),
        wrap("I get 71"),
        wrap("It is \\boxed{72.0}"),
        wrap("#### 1,000"),
        wrap(""),
    ]
    answers = [GSM8K_SOLUTION, "72", GSM8K_SOLUTION, "#### 72", "1000", "72"]
    prompts = [[{"role": "user", "content": "q"}]] * len(completions)
    rewards = correctness_reward(prompts, completions, answer=answers, trainer_state=None)
    assert rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_correctness_reward_as_trl_calls_it():
    rewards = correctness_reward(prompts=["q"], completions=["#### 7"], completion_ids=[[1, 2]], answer=["7"])
    assert rewards == [1.0]


def test_correctness_reward_degenerate_inputs():
    assert correctness_reward(["q"], ["#### 7"]) == [0.0]  # no answer column
    assert correctness_reward(["q", "q"], ["#### 7", "#### 8"], answer=["7"]) == [1.0, 0.0]  # short column
    assert correctness_reward(["q"], ["#### 7"], answer=["no number"]) == [0.0]
    assert correctness_reward(["q"], [None], answer=["7"]) == [0.0]
    assert correctness_reward(None, None, answer=None) == []
    assert correctness_reward(None, [], answer=[]) == []
    assert correctness_reward(None, ["#### 7"], answer="7") == [1.0]  # a scalar answer applies to all


@pytest.mark.parametrize("wrap", [lambda text: text, _conversational], ids=["string", "conversational"])
def test_format_reward(wrap):
    completions = [
        wrap("work\n#### 12"),
        wrap("\\boxed{12}"),
        wrap("The answer is 12."),
        wrap("Answer: 12"),
        wrap("it is 12"),
        wrap("#### (none)"),
        wrap(""),
    ]
    rewards = format_reward(["q"] * len(completions), completions)
    assert rewards == [FORMAT_REWARD] * 4 + [0.0] * 3
    assert FORMAT_REWARD == 0.5


def test_format_reward_degenerate_inputs():
    assert format_reward(None, None) == []
    assert format_reward(None, [None, 3, {"weird": True}]) == [0.0, 0.0, 0.0]


def test_reward_functions_have_names():
    assert correctness_reward.__name__ == "correctness_reward"
    assert format_reward.__name__ == "format_reward"


_JUNK = st.one_of(
    st.text(),
    st.text(alphabet=st.sampled_from(list("0123456789,.$-#\\boxed{}answer: %\u2212\n "))),
    st.none(),
    st.integers(),
    st.floats(),
    st.lists(st.dictionaries(st.sampled_from(["role", "content", "text"]), st.one_of(st.text(), st.none()))),
)


@settings(max_examples=300, deadline=None)
@given(completion=_JUNK, reference=_JUNK)
def test_never_raises_on_junk(completion, reference):
    result = extract_answer(completion)
    assert result is None or isinstance(result, str)
    assert extract_reference_answer(reference) is None or isinstance(extract_reference_answer(reference), str)
    assert correctness_reward(None, [completion], answer=[reference]) in ([0.0], [1.0])
    assert format_reward(None, [completion]) in ([0.0], [FORMAT_REWARD])


@settings(max_examples=200, deadline=None)
@given(value=st.integers(min_value=-(10**12), max_value=10**12), prefix=st.text(max_size=30))
def test_roundtrip_of_marked_integers(value, prefix):
    text = f"{prefix}\n#### {value:,}"
    assert extract_answer(text) == str(value)
    assert correctness_reward(None, [text], answer=[f"#### {value}"]) == [1.0]
