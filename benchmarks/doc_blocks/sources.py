"""What the blocks read (the summaries and reports under ``benchmarks/results/``, the package's pinned versions) and
how they print numbers."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Summaries:
    """The JSON summaries and reports under one results folder (the committed one, or a scratch copy of it)."""

    def __init__(self, results: Path):
        self.results = Path(results)
        self._loaded: dict[str, dict] = {}

    def json(self, name: str) -> dict:
        """``results/<name>`` parsed; a missing file is an error naming it and the command that writes it."""
        if name not in self._loaded:
            path = self.results / name
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} is missing: a block of README.md or docs/BENCHMARKS.md is written from it "
                    "(python -m benchmarks.regenerate writes the summaries from the committed runs)"
                )
            self._loaded[name] = json.loads(path.read_text())
        return self._loaded[name]

    def text(self, name: str) -> str:
        path = self.results / name
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing (python -m benchmarks.regenerate writes it)")
        return path.read_text()

    def table(self, name: str, index: int = 0) -> str:
        """The ``index``-th Markdown table of ``results/<name>`` (a study's ``summary.md``), as it is written there."""
        tables, current = [], []
        for line in self.text(name).splitlines():
            if line.startswith("|"):
                current.append(line)
            elif current:
                tables.append(current)
                current = []
        if current:
            tables.append(current)
        return "\n".join(tables[index])


@cache
def pinned_versions() -> list[str]:
    """The Hugging Face libraries' version windows, as ``pyproject.toml``'s ``[project] dependencies`` declare them."""
    text = (ROOT / "pyproject.toml").read_text()
    listing = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    return [spec for spec in re.findall(r'"([^"]+)"', listing) if not spec.startswith("torch")]


# ---- printing ---------------------------------------------------------------------------------------------------
def signed(value: float, digits: int = 3, scale: float = 1.0) -> str:
    return f"{value * scale:+.{digits}f}"


def interval(row: dict, digits: int = 3, scale: float = 1.0, low: str = "low", high: str = "high") -> str:
    """``+m [+l, +h]`` from a row's mean and interval (``scale``: 100 for points of accuracy)."""
    mean, low_end, high_end = (signed(row[key], digits, scale) for key in ("mean", low, high))
    return f"{mean} [{low_end}, {high_end}]"


def percent(value: float, digits: int = 1) -> str:
    return f"{value * 100:.{digits}f}%"


def span(values, form: str = ".2f", unit: str = "") -> str:
    """``low-high`` of ``values`` (one value when they print alike)."""
    low, high = format(min(values), form), format(max(values), form)
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def seconds(value: float) -> str:
    """A duration from micro-seconds to seconds, in the unit that reads it."""
    return f"{value * 1e6:.0f} us" if value < 1e-3 else f"{value * 1e3:.1f} ms" if value < 1.0 else f"{value:.2f} s"
