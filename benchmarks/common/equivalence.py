"""When a regenerated summary says what the committed one says: numbers within a stated tolerance, not bytes.

Summaries are computed from the committed records with BLAS, SciPy and NumPy, whose last bits depend on the host (CPU
features, kernel choice): the same records give ``0.07053909967435767`` on one machine and ``0.07053909967435758`` on
another. Comparing bytes would make ``python -m benchmarks.regenerate --check`` (and the suite) pass only on the
machine that summarised them. So two files are equivalent when they have the same text around their numbers and:

- JSON: every number agrees within :data:`REL_TOL` relative (:data:`ABS_TOL` absolute near zero); strings compare as
  text, below; keys and list lengths exactly;
- text (Markdown, strings): every number agrees within :data:`REL_TOL`, or, where the summary's own JSON was
  regenerated with host noise (``noisy``), differs by at most one unit in its last shown digit: a value that sits on
  a rounding boundary (``0.0705`` printing as ``0.070`` or ``0.071``) may print either way on another host, and only
  there.

Host noise is ~1e-15 relative; a hand edit of a shown digit is at least 1e-4 of the number (a shown digit is at most
the 4th-5th significant one), so the check names it; a hand edit in the 14th digit of a JSON number passes, as host
noise does. The documents' blocks are written from the committed summaries, so their numbers never carry host
noise and compare exactly.
"""

from __future__ import annotations

import json
import math
import re

#: Relative tolerance between a committed and a regenerated number (host noise is ~1e-15; a shown digit >= 1e-5).
REL_TOL = 1e-9
#: Absolute tolerance, for values that are zero up to rounding (a difference of two equal means: 1e-17 vs -2e-17).
ABS_TOL = 1e-12

#: A number as summaries print it: sign, thousands separators, decimals, exponent.
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


def close(a: float, b: float) -> bool:
    """``a`` and ``b`` agree within the tolerance (NaN agrees with NaN, an infinity with itself)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b or math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def json_differences(committed: str, regenerated: str) -> list[str]:
    """Where two JSON documents disagree beyond the tolerance, each as ``path: committed X regenerated Y``."""
    try:
        old, new = json.loads(committed), json.loads(regenerated)
    except json.JSONDecodeError as error:
        return [f"not JSON: {error}"]
    found: list[str] = []
    _walk(old, new, "$", found)
    return found


def _walk(old, new, path: str, found: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys(), key=str):
            if key not in new or key not in old:
                found.append(f"{path}.{key}: {'only committed' if key in old else 'only regenerated'}")
            else:
                _walk(old[key], new[key], f"{path}.{key}", found)
    elif isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            found.append(f"{path}: committed {len(old)} items, regenerated {len(new)}")
        for i, (a, b) in enumerate(zip(old, new)):
            _walk(a, b, f"{path}[{i}]", found)
    elif _is_number(old) and _is_number(new):
        if not close(old, new):
            found.append(f"{path}: committed {old!r} regenerated {new!r}")
    elif isinstance(old, str) and isinstance(new, str):
        found += [f"{path}: {why}" for why in text_differences(old, new)]
    elif old != new or type(old) is not type(new):
        found.append(f"{path}: committed {old!r} regenerated {new!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def text_differences(committed: str, regenerated: str, noisy: bool = False) -> list[str]:
    """Where two texts disagree: a line whose words differ, or a number beyond the tolerance (with ``noisy``: beyond
    one unit in its last shown digit), each naming the line, the number and both lines."""
    old_lines, new_lines = committed.splitlines(), regenerated.splitlines()
    found = []
    for i, (old, new) in enumerate(zip(old_lines, new_lines)):
        if old == new:
            continue
        why = _line_difference(old, new, noisy)
        if why:
            found.append(f"line {i + 1}: {why}: committed {old!r} regenerated {new!r}")
    if len(old_lines) != len(new_lines):
        line = min(len(old_lines), len(new_lines))
        found.append(
            f"line {line + 1}: committed {old_lines[line : line + 1]} regenerated {new_lines[line : line + 1]} "
            f"({len(old_lines)} lines committed, {len(new_lines)} regenerated)"
        )
    return found


def _line_difference(old: str, new: str, noisy: bool) -> str | None:
    """Why two lines differ beyond the tolerance, or None where they do not."""
    old_words, new_words = NUMBER.split(old), NUMBER.split(new)
    if old_words != new_words:
        return "the text differs"
    for a, b in zip(NUMBER.findall(old), NUMBER.findall(new)):
        if a == b:
            continue
        x, y = _value(a), _value(b)
        if close(x, y):
            continue
        if noisy and abs(x - y) <= max(_last_place(a), _last_place(b)) * (1 + 1e-6):
            continue
        return f"number {a} (regenerated {b})"
    return None


def _value(shown: str) -> float:
    return float(shown.replace(",", ""))


def _last_place(shown: str) -> float:
    """One unit in the last shown digit of ``shown`` (``0.071``: 0.001; ``1.2e-05``: 1e-06; ``1,960``: 1)."""
    mantissa, _, exponent = shown.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (-decimals + (int(exponent) if exponent else 0))


def differences(name: str, committed: str, regenerated: str, noisy: bool = False) -> list[str]:
    """Where a committed file and its regenerated text disagree, by the file's kind (``.json``: as JSON)."""
    if committed == regenerated:
        return []
    if name.endswith(".json"):
        return json_differences(committed, regenerated)
    return text_differences(committed, regenerated, noisy)
