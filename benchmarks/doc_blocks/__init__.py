"""The numbers README.md, docs/BENCHMARKS.md and docs/USAGE.md quote, written from the regenerated summaries, never
by hand.

A document marks each block of quoted numbers::

    <!-- regenerate:NAME -->
    ...
    <!-- /regenerate:NAME -->

and ``python -m benchmarks.regenerate`` replaces what lies between the two markers with what ``NAME``'s generator
(:data:`GENERATORS`: :mod:`.readme` for the README's blocks, :mod:`.benchmarks_page` for docs/BENCHMARKS.md's,
:mod:`.usage` for docs/USAGE.md's) writes
from the summaries and reports under ``benchmarks/results/``; ``--check`` (and ``tests/end_to_end/test_regenerate.py``)
fails where a committed document differs from what it would write. The text around the blocks is the documents' own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from .benchmarks_page import BLOCKS as BENCHMARKS_PAGE_BLOCKS
from .readme import BLOCKS as README_BLOCKS
from .sources import Summaries
from .usage import BLOCKS as USAGE_BLOCKS

#: Every block's generator: name -> function of the results' summaries returning the block's Markdown.
GENERATORS: dict[str, Callable[[Summaries], str]] = {**README_BLOCKS, **BENCHMARKS_PAGE_BLOCKS, **USAGE_BLOCKS}

_OPENING = re.compile(r"<!-- regenerate:(?P<name>[\w-]+) -->")
_BLOCK = re.compile(r"(<!-- regenerate:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /regenerate:(?P=name) -->)", re.S)


def rewrite(text: str, results: Path, document: str = "the document") -> str:
    """``text`` with every marked block rewritten from the summaries under ``results``. Raises ``ValueError`` naming
    the block for a name without a generator or an opening marker without its closing one."""
    opened = [m.group("name") for m in _OPENING.finditer(text)]
    closed = [m.group("name") for m in _BLOCK.finditer(text)]
    for name in opened:
        if name not in GENERATORS:
            raise ValueError(
                f"{document}: block {name!r} has no generator; the names are {', '.join(sorted(GENERATORS))} "
                "(benchmarks/doc_blocks)"
            )
    unclosed = [name for name in opened if name not in closed]
    if unclosed:
        raise ValueError(
            f"{document}: block {unclosed[0]!r} opens with <!-- regenerate:{unclosed[0]} --> on a line of its own "
            f"but has no <!-- /regenerate:{unclosed[0]} --> after it"
        )
    summaries = Summaries(results)

    def block(match: re.Match) -> str:
        body = GENERATORS[match.group("name")](summaries).rstrip("\n") + "\n"
        return match.group(1) + body + match.group(4)

    return _BLOCK.sub(block, text)


def blocks_in(text: str) -> list[str]:
    """The names of the marked blocks in ``text``, in order."""
    return [m.group("name") for m in _BLOCK.finditer(text)]
