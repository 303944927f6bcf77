"""The offline generator of GSM8K-style word problems behind :func:`a3po_trl.tasks.generate_arithmetic_problems`:
difficulty levels, the word lists and templates (shopping, stock changes, production rates, sharing, ages, travel,
discounts), and the step-by-step solutions written as GSM8K calculator annotations (``a * b = <<a*b=c>>c``)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

# --------------------------------------------------------------------------------------------------------------
# Difficulty levels
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DifficultySpec:
    """Number ranges and solution length of one difficulty level.

    Attributes:
        level: 0 (basic), 1 (easy), 2 (medium), 3 (hard), 4 or 5.
        name: ``"basic"``, ``"easy"``, ``"medium"``, ``"hard"``, ``"level-4"`` or ``"level-5"``.
        min_steps: Fewest arithmetic steps in a solution.
        max_steps: Most arithmetic steps in a solution.
        count_range: Inclusive range of small counts (quantities, people, days).
        amount_range: Inclusive range of amounts (prices, stock, speeds).
    """

    level: int
    name: str
    min_steps: int
    max_steps: int
    count_range: tuple[int, int]
    amount_range: tuple[int, int]


_LEVELS = {
    0: DifficultySpec(0, "basic", 1, 1, (2, 6), (2, 20)),
    1: DifficultySpec(1, "easy", 1, 2, (2, 6), (2, 20)),
    2: DifficultySpec(2, "medium", 2, 3, (2, 12), (10, 100)),
    3: DifficultySpec(3, "hard", 3, 5, (3, 25), (50, 1000)),
    4: DifficultySpec(4, "level-4", 4, 6, (5, 50), (200, 10_000)),
    5: DifficultySpec(5, "level-5", 5, 8, (10, 100), (1000, 100_000)),
}
_NAMES = {spec.name: spec for spec in _LEVELS.values()}


def difficulty_spec(difficulty: str | int) -> DifficultySpec:
    """The :class:`DifficultySpec` of ``"basic"``, ``"easy"``, ``"medium"``, ``"hard"`` or an integer level 0-5."""
    if isinstance(difficulty, str) and difficulty.strip().lower() in _NAMES:
        return _NAMES[difficulty.strip().lower()]
    if isinstance(difficulty, int) and not isinstance(difficulty, bool) and difficulty in _LEVELS:
        return _LEVELS[difficulty]
    raise ValueError(
        f"Unknown difficulty {difficulty!r}: use 'basic', 'easy', 'medium', 'hard' or an integer level 0-5."
    )


# --------------------------------------------------------------------------------------------------------------
# Problem templates
# --------------------------------------------------------------------------------------------------------------

_PEOPLE = [
    ("Maya", "she", "her"),
    ("Liam", "he", "his"),
    ("Sofia", "she", "her"),
    ("Noah", "he", "his"),
    ("Aisha", "she", "her"),
    ("Mateo", "he", "his"),
    ("Chloe", "she", "her"),
    ("Ethan", "he", "his"),
    ("Priya", "she", "her"),
    ("Lucas", "he", "his"),
    ("Hana", "she", "her"),
    ("Omar", "he", "his"),
    ("Elena", "she", "her"),
    ("Kenji", "he", "his"),
    ("Zoe", "she", "her"),
    ("Diego", "he", "his"),
    ("Amara", "she", "her"),
    ("Felix", "he", "his"),
    ("Ingrid", "she", "her"),
    ("Tariq", "he", "his"),
]
_PRODUCTS = [
    "notebooks",
    "pens",
    "apples",
    "sandwiches",
    "comic books",
    "bags of rice",
    "flower pots",
    "T-shirts",
    "board games",
    "tickets",
    "candles",
    "jars of honey",
]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_INVENTORIES = [
    ("The city library", "books", "receives {n} new books", "lends out {n} books", "{k} boxes with {b} books"),
    ("A bakery", "cupcakes", "bakes {n} more cupcakes", "sells {n} cupcakes", "{k} trays of {b} cupcakes"),
    ("A farm stand", "apples", "picks {n} more apples", "sells {n} apples", "{k} crates of {b} apples"),
    ("A toy store", "toy cars", "orders {n} more toy cars", "sells {n} toy cars", "{k} cartons of {b} toy cars"),
    ("A school", "pencils", "buys {n} more pencils", "hands out {n} pencils", "{k} packs of {b} pencils"),
    ("A warehouse", "parcels", "takes in {n} parcels", "ships {n} parcels", "{k} pallets of {b} parcels"),
]
_MACHINES = [
    ("A factory machine", "toys", "hour", 12),
    ("A printer", "pages", "minute", 60),
    ("A bottling line", "bottles", "minute", 60),
    ("A bakery oven", "loaves of bread", "hour", 12),
]
_TREATS = ["stickers", "marbles", "cookies", "trading cards", "candies", "seashells"]
_SALE_ITEMS = ["jacket", "bicycle", "lamp", "backpack", "pair of shoes", "video game"]
_PERCENTS = [5, 10, 15, 20, 25, 30, 40, 50, 60, 75]


class _Solution:
    """Builds a GSM8K-style solution, one calculator-annotated step per line."""

    _OPS: dict[str, Callable[[Fraction, Fraction], Fraction]] = {
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "*": lambda a, b: a * b,
        "/": lambda a, b: a / b,
    }

    def __init__(self) -> None:
        self.lines: list[str] = []

    def step(self, sentence: str, *tokens: int | str) -> int:
        """Evaluate ``a op b [op c ...]`` left to right, append ``sentence`` with the worked step, return the result.

        Only expressions whose left-to-right value matches the usual precedence are allowed (all of ``+ -`` or
        all of ``* /``), and every intermediate value must be a non-negative integer.
        """
        ops = tokens[1::2]
        if {"+", "-"} & set(ops) and {"*", "/"} & set(ops):
            raise ValueError(f"mixed precedence in {tokens}")
        value = Fraction(tokens[0])
        for op, operand in zip(ops, tokens[2::2]):
            value = self._OPS[op](value, Fraction(operand))
            if value.denominator != 1 or value < 0:
                raise ValueError(f"non-integer or negative step in {tokens}")
        result = int(value)
        spaced = " ".join(str(token) for token in tokens)
        compact = "".join(str(token) for token in tokens)
        self.lines.append(sentence.format(calc=f"{spaced} = <<{compact}={result}>>{result}"))
        return result

    def text(self, answer: int) -> str:
        """The full solution, ending in ``#### answer``."""
        return "\n".join([*self.lines, f"#### {answer}"])


@dataclass(frozen=True)
class _Template:
    """One problem family: ``build(rng, spec, steps) -> (question, solution)`` for ``min_steps..max_steps``."""

    name: str
    min_steps: int
    max_steps: int
    build: Callable[[random.Random, DifficultySpec, int], tuple[str, str]]


def _count(rng: random.Random, spec: DifficultySpec, cap: int | None = None) -> int:
    low, high = spec.count_range
    return rng.randint(low, max(low, min(high, cap))) if cap else rng.randint(low, high)


def _amount(rng: random.Random, spec: DifficultySpec) -> int:
    return rng.randint(*spec.amount_range)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _shopping(rng: random.Random, spec: DifficultySpec, steps: int) -> tuple[str, str]:
    """Buy k kinds of items (2k - 1 steps), optionally paying from a budget (one more step)."""
    name, _, _ = rng.choice(_PEOPLE)
    with_change = steps % 2 == 0
    kinds = steps // 2 if with_change else (steps + 1) // 2
    products = rng.sample(_PRODUCTS, kinds)
    items = [(product, _count(rng, spec), _amount(rng, spec)) for product in products]
    solution = _Solution()
    total = 0
    for index, (product, quantity, price) in enumerate(items):
        cost = solution.step(f"The {product} cost {{calc}} dollars.", quantity, "*", price)
        total = cost if index == 0 else solution.step("Together that is {calc} dollars.", total, "+", cost)
    bought = _join([f"{quantity} {product} for ${price} each" for product, quantity, price in items])
    if with_change:
        budget = total + _amount(rng, spec)
        question = f"{name} has ${budget} and buys {bought}. How many dollars does {name} have left?"
        answer = solution.step(f"{name} has {{calc}} dollars left.", budget, "-", total)
    else:
        question = f"{name} buys {bought}. How many dollars does {name} spend in total?"
        answer = total
    return question, solution.text(answer)


def _inventory(rng: random.Random, spec: DifficultySpec, steps: int) -> tuple[str, str]:
    """A stock that changes over several days: +n and -n events (1 step), deliveries of k x b (2 steps)."""
    place, unit, add, remove, boxes = rng.choice(_INVENTORIES)
    stock = _amount(rng, spec) + spec.count_range[1]
    solution = _Solution()
    events = [f"{place} has {stock} {unit}."]
    remaining, day = steps, 0
    while remaining:
        when = f"On {_DAYS[day]}" if day < len(_DAYS) else f"On day {day + 1}"
        kind = rng.random()
        if remaining >= 2 and kind < 0.35:
            count, size = _count(rng, spec), _count(rng, spec)
            events.append(f"{when} it gets {boxes.format(k=count, b=size)} in each.")
            delivered = solution.step(f"The delivery brings {{calc}} {unit}.", count, "*", size)
            stock = solution.step(f"After that there are {{calc}} {unit}.", stock, "+", delivered)
            remaining -= 2
        elif kind < 0.65 and stock >= 2:
            amount = rng.randint(1, min(spec.amount_range[1], stock - 1))
            events.append(f"{when} it {remove.format(n=amount)}.")
            stock = solution.step(f"After that there are {{calc}} {unit}.", stock, "-", amount)
            remaining -= 1
        else:
            amount = _amount(rng, spec)
            events.append(f"{when} it {add.format(n=amount)}.")
            stock = solution.step(f"After that there are {{calc}} {unit}.", stock, "+", amount)
            remaining -= 1
        day += 1
    question = " ".join(events) + f" How many {unit} are there at the end?"
    return question, solution.text(stock)


def _rates(rng: random.Random, spec: DifficultySpec, steps: int) -> tuple[str, str]:
    """Rate x time (1 step), x days (2 steps), packed into boxes (3 steps)."""
    machine, unit, period, max_periods = rng.choice(_MACHINES)
    box = _count(rng, spec)
    rate = box * rng.randint(1, max(1, spec.amount_range[1] // box)) if steps >= 3 else _amount(rng, spec)
    periods = _count(rng, spec, cap=max_periods)
    solution = _Solution()
    question = f"{machine} makes {rate} {unit} per {period}."
    if steps == 1:
        question += f" How many {unit} does it make in {periods} {period}s?"
        return question, solution.text(solution.step(f"In total it makes {{calc}} {unit}.", rate, "*", periods))
    days = _count(rng, spec)
    question += f" It runs for {periods} {period}s every day."
    daily = solution.step(f"Each day it makes {{calc}} {unit}.", rate, "*", periods)
    total = solution.step(f"In {days} days it makes {{calc}} {unit}.", daily, "*", days)
    if steps == 2:
        return question + f" How many {unit} does it make in {days} days?", solution.text(total)
    question += f" The {unit} made in {days} days are packed {box} to a box. How many boxes are filled?"
    return question, solution.text(solution.step("That fills {calc} boxes.", total, "/", box))


def _sharing(rng: random.Random, spec: DifficultySpec, steps: int) -> tuple[str, str]:
    """Equal sharing: divide (1 step), packs x size first (2 steps), then some get used (3 steps)."""
    name, _, _ = rng.choice(_PEOPLE)
    treat = rng.choice(_TREATS)
    friends = _count(rng, spec)
    solution = _Solution()
    if steps == 1:
        total = friends * _amount(rng, spec)
        question = f"{name} has {total} {treat} and shares them equally among {friends} friends."
        question += " How many does each friend get?"
        return question, solution.text(solution.step(f"Each friend gets {{calc}} {treat}.", total, "/", friends))
    packs, size = _count(rng, spec), _count(rng, spec)
    if rng.random() < 0.5:
        packs *= friends
    else:
        size *= friends
    question = f"{name} buys {packs} packs of {treat} with {size} in each pack and shares them equally among"
    question += f" {friends} friends."
    total = solution.step(f"{name} has {{calc}} {treat}.", packs, "*", size)
    each = solution.step(f"Each friend gets {{calc}} {treat}.", total, "/", friends)
    if steps == 2:
        return question + " How many does each friend get?", solution.text(each)
    used = rng.randint(1, each - 1)
    question += f" Each friend then gives away {used} of them. How many {treat} does each friend have left?"
    return question, solution.text(solution.step(f"Each friend has {{calc}} {treat} left.", each, "-", used))


def _ages(rng: random.Random, spec: DifficultySpec, steps: int) -> tuple[str, str]:
    """Ages: older/younger sibling (1 step), in y years (2 steps), a multiple of it first (3 steps)."""
    (name, _, possessive), (sibling, _, _) = rng.sample(_PEOPLE, 2)
    age, gap = rng.randint(8, 15), rng.randint(1, 7)
    solution = _Solution()
    if rng.random() < 0.5:
        question = f"{name} is {age} years old. {possessive.capitalize()} cousin {sibling} is {gap} years older."
        cousin = solution.step(f"{sibling} is {{calc}} years old.", age, "+", gap)
    else:
        question = f"{name} is {age} years old. {possessive.capitalize()} cousin {sibling} is {gap} years younger."
        cousin = solution.step(f"{sibling} is {{calc}} years old.", age, "-", gap)
    if steps == 1:
        return question + f" How old is {sibling}?", solution.text(cousin)
    years = rng.randint(2, max(2, min(30, spec.amount_range[1])))
    if steps == 2:
        question += f" How old will {sibling} be in {years} years?"
        return question, solution.text(
            solution.step(f"In {years} years {sibling} will be {{calc}}.", cousin, "+", years)
        )
    factor = rng.choice([2, 3]) if cousin <= 20 else 2
    question += f" Their aunt is {factor} times as old as {sibling}. How old will the aunt be in {years} years?"
    aunt = solution.step("The aunt is {calc} years old.", factor, "*", cousin)
    return question, solution.text(solution.step(f"In {years} years she will be {{calc}}.", aunt, "+", years))


def _travel(rng: random.Random, spec: DifficultySpec, steps: int) -> tuple[str, str]:
    """Distance over k legs (2k - 1 steps), optionally the distance left of a longer trip (one more step)."""
    name, pronoun, _ = rng.choice(_PEOPLE)
    with_rest = steps % 2 == 0
    legs = [
        (_amount(rng, spec), _count(rng, spec, cap=10)) for _ in range(steps // 2 if with_rest else (steps + 1) // 2)
    ]
    solution = _Solution()
    total = 0
    for index, (speed, hours) in enumerate(legs):
        part = solution.step(f"Part {index + 1} covers {{calc}} km.", speed, "*", hours)
        total = part if index == 0 else solution.step("So far that is {calc} km.", total, "+", part)
    driven = _join([f"{speed} km per hour for {hours} hours" for speed, hours in legs])
    if len(legs) > 1:
        driven = driven.replace(", ", ", then ").replace(" and ", " and then ")
    if with_rest:
        trip = total + _amount(rng, spec)
        question = f"{name} is on a {trip} km trip. So far {pronoun} has traveled {driven}. How many km are left?"
        answer = solution.step("There are {calc} km left.", trip, "-", total)
    else:
        question = f"{name} travels {driven}. How many km does {pronoun} travel in total?"
        answer = total
    return question, solution.text(answer)


def _discount(rng: random.Random, spec: DifficultySpec, steps: int) -> tuple[str, str]:
    """A percentage discount (1 step), the sale price (2), buying n (3), change from a budget (4)."""
    name, _, _ = rng.choice(_PEOPLE)
    item = rng.choice(_SALE_ITEMS)
    percent = rng.choice(_PERCENTS if spec.level > 1 else [10, 20, 25, 50])
    unit = 100 // math.gcd(percent, 100)
    price = unit * rng.randint(max(1, spec.amount_range[0] // unit), max(1, spec.amount_range[1] // unit))
    solution = _Solution()
    question = f"A {item} costs ${price}. It is on sale for {percent}% off."
    discount = solution.step("The discount is {calc} dollars.", price, "*", percent, "/", 100)
    if steps == 1:
        return question + " How many dollars is the discount?", solution.text(discount)
    sale = solution.step("The sale price is {calc} dollars.", price, "-", discount)
    if steps == 2:
        return question + " What is the sale price in dollars?", solution.text(sale)
    count = _count(rng, spec)
    cost = solution.step(f"{count} of them cost {{calc}} dollars.", count, "*", sale)
    if steps == 3:
        return question + f" How many dollars do {count} of them cost at the sale price?", solution.text(cost)
    budget = cost + _amount(rng, spec)
    question += f" {name} has ${budget} and buys {count} of them at the sale price. How many dollars are left?"
    return question, solution.text(solution.step(f"{name} has {{calc}} dollars left.", budget, "-", cost))


_TEMPLATES = [
    _Template("shopping", 1, 99, _shopping),
    _Template("inventory", 1, 99, _inventory),
    _Template("rates", 1, 3, _rates),
    _Template("sharing", 1, 3, _sharing),
    _Template("ages", 1, 3, _ages),
    _Template("travel", 1, 99, _travel),
    _Template("discount", 1, 4, _discount),
]


# --------------------------------------------------------------------------------------------------------------
# Generated datasets
# --------------------------------------------------------------------------------------------------------------


def generate_problem_texts(
    n: int, spec: DifficultySpec, rng: random.Random, exclude: set[str]
) -> tuple[list[str], list[str]]:
    """``n`` distinct (question, solution) pairs whose questions are not in ``exclude``."""
    templates = [t for t in _TEMPLATES if t.min_steps <= spec.max_steps and t.max_steps >= spec.min_steps]
    questions: list[str] = []
    solutions: list[str] = []
    seen = set(exclude)
    attempts = 0
    while len(questions) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(
                f"Could not generate {n} distinct {spec.name} problems; ask for fewer or use a harder difficulty."
            )
        template = rng.choice(templates)
        steps = rng.randint(max(spec.min_steps, template.min_steps), min(spec.max_steps, template.max_steps))
        question, solution = template.build(rng, spec, steps)
        if question in seen:
            continue
        seen.add(question)
        questions.append(question)
        solutions.append(solution)
    return questions, solutions
