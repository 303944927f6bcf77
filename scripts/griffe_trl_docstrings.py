"""Griffe extension for the API reference (``mkdocs.yml``): reads the package's docstrings as written.

- TRL's docstring style (``AsyncA3POConfig``): a ``Parameters:`` section whose parameters are grouped under
  ``> Parameters that control ...`` header lines, with a paragraph of prose in a group here and there. Griffe's
  Google-style parser takes those lines for malformed parameters; here each group becomes a ``Parameters:`` section
  titled with its header, and its prose a text section after its table; each parameter's TRL-style type
  (``(`str`, *optional*, defaults to `"x"`)``) gives way to the annotation and default of the signature. The
  docstring itself stays as it is: ``a3po-trl grpo --help`` reads the same text (``a3po_trl/cli/arguments.py``).
- Several parameters described together (``epsilon_low, epsilon_high: ...``, ``vespo_*: ...``, as in
  ``decoupled_ppo_loss``): one entry per parameter of the signature, each with the shared description.
- Cross-references written for Sphinx (``:class:`~a3po_trl.AsyncA3POConfig```) or for Hugging Face's doc-builder
  (``[`~trl.GRPOConfig`]``) become code spans (``AsyncA3POConfig``, ``GRPOConfig``) instead of literal roles and
  brackets.

Only the text that griffe parses changes; nothing under ``a3po_trl/`` is imported or edited.
"""

from __future__ import annotations

import fnmatch
import re

import griffe

_SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|obj|data|exc):`~?([^`]+)`")
_HF_REFERENCE = re.compile(r"\[`(~?)([\w.]+)`\](?![(\[])")
_PARAMETER = re.compile(r"^[\w*]+ \(.*\):")
_ARGUMENT_SECTIONS = ("Args:", "Arguments:", "Parameters:", "Params:")
_SHARED_ENTRY = re.compile(r"^    ([\w*]+(?:, [\w*]+)+|\w*\*\w*)( \([^)]*\))?:(.*)$")


def _code_span(match: re.Match, short: bool) -> str:
    target = match.group(match.lastindex)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _sphinx_role(match: re.Match) -> str:
    return _code_span(match, short=match.group(0).split("`", 1)[1].startswith("~"))


def _hf_reference(match: re.Match) -> str:
    return _code_span(match, short=match.group(1) == "~")


def split_parameter_groups(text: str) -> str:
    """A ``Parameters:`` section with ``> header`` lines, as one titled ``Parameters:`` section per group."""
    lines = text.split("\n")
    try:
        start = lines.index("Parameters:")
    except ValueError:
        return text
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
        end += 1
    block = lines[start + 1 : end]
    if not any(line.startswith("    > ") for line in block):
        return text

    groups: list[tuple[str | None, list[str], list[str]]] = [(None, [], [])]  # (header, parameter lines, prose)
    in_parameter = False
    for line in block:
        if line.startswith("    > "):
            groups.append((line[len("    > ") :].strip().replace("`", ""), [], []))
            in_parameter = False
        elif not line.strip():
            groups[-1][1 if in_parameter else 2].append("")
            in_parameter = False
        elif line.startswith("        ") and in_parameter:
            groups[-1][1].append(line)
        elif _PARAMETER.match(line[4:]):
            # TRL's "(`str`, *optional*, defaults to `x`)": the reference shows the annotation and default instead
            name, _, description = line[4:].partition(" (")
            groups[-1][1].append(f"    {name}:{description.split('):', 1)[1]}")
            in_parameter = True
        else:  # prose of the group, at the parameters' indentation
            groups[-1][2].append(line[4:])
            in_parameter = False

    out = lines[:start]
    for header, parameters, prose in groups:
        parameters = [line for line in parameters if line.strip()]
        if parameters:
            out += [f"Parameters: {header}" if header else "Parameters:", *parameters, ""]
        prose_text = "\n".join(prose).strip()
        if prose_text:
            out += [prose_text, ""]
    return "\n".join(out + lines[end:]).rstrip() + "\n"


def split_shared_entries(text: str, signature: list[str]) -> str:
    """``a, b: text`` and ``prefix_*: text`` in an arguments section, as one entry per parameter of ``signature``."""
    out: list[str] = []
    lines = text.split("\n")
    in_section = False
    index = 0
    while index < len(lines):
        line = lines[index]
        if line in _ARGUMENT_SECTIONS:
            in_section = True
        elif line.strip() and not line.startswith(" "):
            in_section = False
        match = _SHARED_ENTRY.match(line) if in_section else None
        if match is None:
            out.append(line)
            index += 1
            continue
        continuation = []
        index += 1
        while index < len(lines) and lines[index].startswith("        "):
            continuation.append(lines[index])
            index += 1
        names = []
        for pattern in match.group(1).split(", "):
            names += fnmatch.filter(signature, pattern) if "*" in pattern else [pattern]
        for name in names or [match.group(1)]:  # nothing matched: left for griffe to report
            out += [f"    {name}{match.group(2) or ''}:{match.group(3)}", *continuation]
    return "\n".join(out)


def adapt(text: str, signature: list[str] | None = None) -> str:
    text = _SPHINX_ROLE.sub(_sphinx_role, text)
    text = _HF_REFERENCE.sub(_hf_reference, text)
    if signature is not None:
        text = split_shared_entries(text, signature)
    return split_parameter_groups(text)


class TRLDocstrings(griffe.Extension):
    """Adapts every docstring of the package as the module docstring says, before griffe parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            signature = [p.name for p in obj.parameters] if isinstance(obj, griffe.Function) else None
            obj.docstring.value = adapt(obj.docstring.value, signature)
