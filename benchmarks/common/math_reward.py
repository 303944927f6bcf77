"""A CPU-heavy, pure-Python math reward, standing in for ``math_verify``-style rewards in the reward-workers benchmark.

``math_verify`` parses each completion's answer and the reference into expression trees and checks them for equality
by rewriting; it runs in pure Python and holds the interpreter lock for milliseconds per completion. This reward does
the same kind of work with the standard library only, so that its cost is the same on every machine that runs the
benchmark: each completion's arithmetic expressions and the reference are parsed by a recursive-descent parser into
exact fractions, and the equality is checked against ``rounds`` rewritten forms of the reference (each parsed in
turn), as a verifier checks an answer under several normalisations. The reward is 1.0 where the completion's last
expression equals the reference, else 0.0. ``rounds`` sets the cost (the benchmark records the seconds per batch).
"""

from __future__ import annotations

import os
import re
from fractions import Fraction

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(\S))")
_EXPRESSION = re.compile(r"[\d(][\d\s+\-*/().]*")
DEFAULT_ROUNDS = 25
"""Rewritten forms checked per completion: tens of ms per batch of 8 completions (the benchmark records it)."""
ROUNDS_ENV = "A3PO_MATH_REWARD_ROUNDS"
"""Environment variable that overrides ``DEFAULT_ROUNDS`` (read at each call: reward worker processes inherit it)."""


def tokenize(text: str) -> list[str]:
    """Numbers and single-character operators of ``text``."""
    return [number or symbol for number, symbol in _TOKEN.findall(text)]


def parse(text: str) -> Fraction:
    """The exact value of an arithmetic expression (``+ - * /``, parentheses, unary minus); ``ValueError`` if it is
    not one (or divides by zero)."""
    tokens, position = tokenize(text), 0

    def peek():
        return tokens[position] if position < len(tokens) else None

    def take():
        nonlocal position
        position += 1
        return tokens[position - 1]

    def sum_():
        value = product()
        while peek() in ("+", "-"):
            value = value + product() if take() == "+" else value - product()
        return value

    def product():
        value = unary()
        while peek() in ("*", "/"):
            if take() == "*":
                value *= unary()
            else:
                divisor = unary()
                if divisor == 0:
                    raise ValueError("division by zero")
                value /= divisor
        return value

    def unary():
        if peek() == "-":
            take()
            return -unary()
        token = peek()
        if token == "(":
            take()
            value = sum_()
            if peek() != ")":
                raise ValueError("unbalanced parentheses")
            take()
            return value
        if token is None or not token[0].isdigit():
            raise ValueError(f"expected a number, found {token!r}")
        return Fraction(take())

    value = sum_()
    if position != len(tokens):
        raise ValueError(f"unexpected {tokens[position]!r}")
    return value


def rewritten_forms(reference: str, rounds: int) -> list[str]:
    """``rounds`` expressions equal to ``reference``, each a different rewriting of it."""
    return [
        f"(({reference}) * {k} - ({k} - 1) * ({reference})) / (({k} + 1) / ({k} + 1))" for k in range(1, rounds + 1)
    ]


def verify(candidate: str, reference: str, rounds: int) -> bool:
    """Whether ``candidate`` equals ``reference`` under each of ``rounds`` rewritings of the reference."""
    try:
        value = parse(candidate)
        return all(parse(form) == value for form in rewritten_forms(reference, rounds))
    except ValueError:
        return False


def completion_text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def math_verify_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's last arithmetic expression equals the reference ``answer`` (checked against
    ``A3PO_MATH_REWARD_ROUNDS`` rewritten forms of it, default ``DEFAULT_ROUNDS``), else 0.0. Module-level, so that
    reward worker processes can import it."""
    rounds = int(os.environ.get(ROUNDS_ENV, DEFAULT_ROUNDS))
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        expressions = [e.strip() for e in _EXPRESSION.findall(completion_text(completion)) if e.strip()]
        candidate = expressions[-1] if expressions else str(reference)  # a missing answer still costs its check
        correct = verify(candidate, str(reference), rounds)
        rewards.append(1.0 if correct and expressions else 0.0)
    return rewards
