"""Reward functions for math word problems (GSM8K style), with TRL's reward-function signature.

TRL calls each reward function as ``f(prompts=..., completions=..., **dataset_columns)`` and logs it under its
``__name__``. Completions are either plain strings or conversational message lists such as
``[{"role": "assistant", "content": "..."}]``; the ground truth arrives as the dataset column ``answer``, holding a
full GSM8K solution ending in ``#### 42`` or a bare number such as ``"42"``.

Every function here is total: odd input (``None``, empty strings, unicode junk, mismatched lengths) yields ``None``
or a reward of ``0.0``, never an exception, so a single malformed sample cannot crash a training step.

Answers are compared as exact rationals after normalisation to a canonical string: ``"1,234"`` -> ``"1234"``,
``"3.50"`` -> ``"3.5"``, ``"12.0"`` -> ``"12"``, ``"-0"`` -> ``"0"``, ``"\\frac{1}{3}"`` -> ``"1/3"``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_REWARD",
    "completion_to_text",
    "correctness_reward",
    "extract_answer",
    "extract_reference_answer",
    "format_reward",
]

#: Reward that :func:`format_reward` gives a completion with a clearly marked final answer (otherwise 0.0).
FORMAT_REWARD = 0.5

# Numbers longer than this are treated as junk (and would trip Python's int-from-str digit limit).
_MAX_DIGITS = 64

# A number with an optional sign and currency sign: "-7", "$5.00", "-$1,234.5", "$ -3", ".5". A minus sign only
# counts when it is not glued to a preceding word or number, so "3-4" reads as 3 and 4, not 3 and -4.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])(?P<sign>[-\u2212\u2013])\s?)?"
    r"(?:[$\u20ac\u00a3\u00a5\u20b9]\s?(?P<sign2>[-\u2212\u2013])?)?"
    r"(?<![0-9])(?P<num>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
)
# A LaTeX or slash fraction filling a whole answer: "\frac{3}{4}", "\dfrac{3}{4}", "-3/4".
_FRACTION = re.compile(
    r"^\s*(?P<sign>[-\u2212]?)\s*(?:\\[dt]?frac\s*\{\s*(?P<a>[0-9]+)\s*\}\s*\{\s*(?P<b>[0-9]+)\s*\}"
    r"|(?P<c>[0-9]+)\s*/\s*(?P<d>[0-9]+))\s*$"
)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_PHRASE = re.compile(
    r"\banswer(?:\s+is|\s+was|\s+would\s+be|\s+will\s+be|\s+equals|\s*[:=])\s*[:=]?",
    re.IGNORECASE,
)
# How many boxed answers / answer phrases to try, last first (bounds the work on degenerate text).
_MAX_MARKERS = 20
# How far after "The answer is" the number may sit ("The answer is therefore $42").
_PHRASE_WINDOW = 40
# LaTeX and markdown wrappers that may surround a marked answer: "$", "**", "\(", "\text{...}".
_WRAPPERS = re.compile(r"\\text\s*\{|\\mathrm\s*\{|\\[()\[\]]|\*\*|__")


def _format_fraction(value: Fraction) -> str:
    """Canonical string of an exact rational: an integer, a finite decimal, or ``p/q``."""
    if value.denominator == 1:
        return str(value.numerator)
    rest = value.denominator
    for prime in (2, 5):
        while rest % prime == 0:
            rest //= prime
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    with localcontext() as ctx:
        ctx.prec = len(str(abs(value.numerator))) + 4 * len(str(value.denominator)) + 5
        decimal = Decimal(value.numerator) / Decimal(value.denominator)
    return format(decimal.normalize(), "f")


def _number_value(match: re.Match[str]) -> Fraction | None:
    """Exact value of a :data:`_NUMBER` match, or None when it is too long to be a real answer."""
    digits = match.group("num").replace(",", "")
    if len(digits) > _MAX_DIGITS:
        return None
    value = Fraction(digits)
    negative = bool(match.group("sign")) != bool(match.group("sign2"))
    return -value if negative else value


def _unwrap(text: str) -> str:
    """``text`` without LaTeX/markdown wrappers, surrounding ``$``/``.`` and unbalanced closing braces."""
    text = _WRAPPERS.sub("", text).strip(" $.")
    while text.endswith("}") and text.count("}") > text.count("{"):
        text = text[:-1].rstrip(" $.")
    return text


def _fraction_value(text: str) -> Fraction | None:
    """Value of ``text`` when it is exactly one fraction (``\\frac{3}{4}`` or ``3/4``), wrappers aside."""
    match = _FRACTION.match(_unwrap(text))
    if match is None:
        return None
    numerator = match.group("a") or match.group("c")
    denominator = match.group("b") or match.group("d")
    if len(numerator) > _MAX_DIGITS or len(denominator) > _MAX_DIGITS or int(denominator) == 0:
        return None
    value = Fraction(int(numerator), int(denominator))
    return -value if match.group("sign") else value


def _last_number(text: str) -> Fraction | None:
    """The last number in ``text``."""
    for match in reversed(list(_NUMBER.finditer(text))):
        value = _number_value(match)
        if value is not None:
            return value
    return None


def _first_number(text: str) -> Fraction | None:
    """The first number in ``text`` (or the whole of it, when it is one fraction)."""
    fraction = _fraction_value(text)
    if fraction is not None:
        return fraction
    for match in _NUMBER.finditer(text):
        value = _number_value(match)
        if value is not None:
            return value
    return None


def _boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` in ``text`` whose braces close, in order (one linear pass)."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return []
    closing: dict[int, int] = {}
    stack: list[int] = []
    for index in range(starts[0] - 1, len(text)):
        char = text[index]
        if char == "{":
            stack.append(index)
        elif char == "}" and stack:
            closing[stack.pop()] = index
    return [text[start : closing[start - 1]] for start in starts if start - 1 in closing]


def _marked_answer(text: str) -> Fraction | None:
    """The answer that ``text`` marks explicitly: ``#### N``, then ``\\boxed{N}``, then ``The answer is N``."""
    marker = text.rfind("####")
    if marker >= 0:
        tail = text[marker + 4 :].strip().splitlines()
        value = _first_number(tail[0]) if tail else None
        if value is not None:
            return value
    for content in reversed(_boxed_contents(text)[-_MAX_MARKERS:]):
        value = _fraction_value(content)
        if value is None:
            value = _last_number(content)
        if value is not None:
            return value
    for match in reversed(list(_ANSWER_PHRASE.finditer(text))[-_MAX_MARKERS:]):
        window = text[match.end() : match.end() + _PHRASE_WINDOW].split("\n", 1)[0]
        value = _first_number(window)
        if value is not None:
            return value
    return None


def completion_to_text(completion: Any) -> str:
    """Text of one completion: a string as is, or the assistant contents of a conversational message list.

    Handles ``[{"role": "assistant", "content": "..."}]``, single message dicts, multi-turn lists (tool messages are
    skipped) and multimodal content parts (``[{"type": "text", "text": "..."}]``). Anything else gives ``""``.
    """
    try:
        if completion is None:
            return ""
        if isinstance(completion, str):
            return completion
        if isinstance(completion, dict):
            completion = [completion]
        if not isinstance(completion, Sequence):
            return ""
        parts = []
        for message in completion:
            if isinstance(message, str):
                parts.append(message)
                continue
            if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
                continue
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, Sequence):
                parts.extend(
                    part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
        return "\n".join(parts)
    except Exception:  # noqa: BLE001 - a reward function must never raise
        return ""


def _to_value(text: Any) -> Fraction | None:
    """Exact value of the final answer in ``text`` (see :func:`extract_answer`), or None."""
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, int):
        return Fraction(text)
    if isinstance(text, float):
        return Fraction(text).limit_denominator(10**9) if abs(text) < 1e300 and text == text else None
    if not isinstance(text, str):
        text = completion_to_text(text)
    marked = _marked_answer(text)
    if marked is not None:
        return marked
    return _last_number(text)


def extract_answer(text: Any) -> str | None:
    """Extract the final numeric answer from a model completion, as a canonical string.

    Priority: a ``#### 42`` marker (GSM8K), then ``\\boxed{42}``, then phrases such as ``The answer is 42.`` or
    ``answer: $42``, then the last number anywhere in the text. Negative numbers, thousands separators, currency
    signs and trailing units (``"42 apples"``, ``"$5.00"``, ``"12 km"``, ``"50%"``) are handled.

    The result is normalised so that equal numbers give equal strings: ``"1,234"`` -> ``"1234"``, ``"3.50"`` ->
    ``"3.5"``, ``"12.0"`` -> ``"12"``; a non-terminating fraction comes out as ``"p/q"``.

    Args:
        text: The completion text. Conversational message lists are accepted too; ints and floats are
            normalised directly.

    Returns:
        The canonical answer, or None when there is no number (or the input is not text). Never raises.
    """
    try:
        value = _to_value(text)
        return None if value is None else _format_fraction(value)
    except Exception:  # noqa: BLE001 - a reward helper must never raise
        return None


def extract_reference_answer(answer: Any) -> str | None:
    """Canonical answer of a dataset ``answer`` field: a GSM8K solution ending in ``#### 42`` or a bare ``"42"``.

    Returns None when no number can be found. Never raises.
    """
    try:
        if isinstance(answer, str) and "####" in answer:
            tail = answer.rsplit("####", 1)[1].strip().splitlines()
            value = _first_number(tail[0]) if tail else None
            if value is not None:
                return _format_fraction(value)
        return extract_answer(answer)
    except Exception:  # noqa: BLE001
        return None


def _aligned(column: Any, length: int) -> list[Any]:
    """``column`` as a list of exactly ``length`` items (missing ones are None; a scalar is repeated)."""
    if column is None:
        items: list[Any] = []
    elif isinstance(column, (str, bytes, int, float)):
        items = [column] * length
    else:
        try:
            items = list(column)[:length]
        except Exception:  # noqa: BLE001
            items = []
    return items + [None] * (length - len(items))


def correctness_reward(
    prompts: Any = None, completions: Sequence[Any] | None = None, answer: Any = None, **kwargs: Any
) -> list[float]:
    """1.0 for each completion whose final answer equals the reference numerically, else 0.0.

    Args:
        prompts: Unused (part of TRL's reward-function signature).
        completions: Strings or conversational message lists.
        answer: The dataset ``answer`` column, aligned with ``completions``: GSM8K solutions (``... #### 42``) or
            bare numbers. A missing column, or a row without an extractable reference, scores 0.0 (with a warning).
        **kwargs: Other dataset columns and trainer extras, ignored.

    Returns:
        One reward per completion. Never raises.
    """
    try:
        completions = list(completions or [])
    except Exception:  # noqa: BLE001
        return []
    rewards = [0.0] * len(completions)
    try:
        if answer is None:
            logger.warning("correctness_reward got no `answer` column; every completion scores 0.0.")
            return rewards
        references = _aligned(answer, len(completions))
        for index, (completion, reference) in enumerate(zip(completions, references)):
            try:
                expected = extract_reference_answer(reference)
                if expected is None:
                    logger.warning("correctness_reward: no numeric reference in answer %r; scoring 0.0.", reference)
                    continue
                predicted = extract_answer(completion_to_text(completion))
                if predicted is not None and Fraction(predicted) == Fraction(expected):
                    rewards[index] = 1.0
            except Exception:  # noqa: BLE001
                continue
    except Exception:  # noqa: BLE001
        pass
    return rewards


def format_reward(prompts: Any = None, completions: Sequence[Any] | None = None, **kwargs: Any) -> list[float]:
    """:data:`FORMAT_REWARD` (0.5) for each completion with a clearly marked final answer, else 0.0.

    A marked answer is a number after ``####``, inside ``\\boxed{...}``, or after a phrase such as ``The answer is``
    or ``Answer:``. The reward is on a 0.0..0.5 scale so that it stays smaller than :func:`correctness_reward`'s 1.0.
    Correctness is not checked. Never raises.
    """
    try:
        completions = list(completions or [])
    except Exception:  # noqa: BLE001
        return []
    rewards = []
    for completion in completions:
        try:
            marked = _marked_answer(completion_to_text(completion))
        except Exception:  # noqa: BLE001
            marked = None
        rewards.append(FORMAT_REWARD if marked is not None else 0.0)
    return rewards
