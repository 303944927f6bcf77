"""MkDocs hooks (``mkdocs.yml``): the README is the site's home page, and links that leave ``docs/`` still work.

The pages are written to be read on a code host as much as on the site, so they link the repository's files by
relative path (``../benchmarks/README.md``, ``../examples/train_gsm8k.py``, result plots). MkDocs knows only the files
under ``docs_dir`` and would report every such link as missing. Here:

- ``README.md`` at the repository root becomes ``index.md``: its links into ``docs/`` are rewritten to the pages, and
  the pages' links to it to the home page;
- every repository file that a page links outside ``docs/`` is copied into the site under ``repo/`` (as a static
  file, Markdown included) and the link points there;
- a link to a file that does not exist is left as written, so ``mkdocs build --strict`` fails on it, as on a
  broken link between pages (and ``validation.anchors: warn`` on a heading that is not there).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
_FENCE = re.compile(r"^\s*(```|~~~)")
REPO_PREFIX = "repo"


class _RepoFile(File):
    """A repository file outside ``docs/`` copied into the site as it is (a Markdown file is not rendered)."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _source(file: File) -> Path:
    """The real path of a page: ``README.md`` for the home page, else the file in ``docs/``."""
    return Path(file.abs_src_path).resolve()


def _targets(markdown: str):
    """Relative link targets of a Markdown text, outside fenced code, with where they sit in the text."""
    in_fence = False
    offset = 0
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            for match in _LINK.finditer(line):
                target = match.group(2)
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith(("#", "/")):
                    yield offset + match.start(2), offset + match.end(2), target
        offset += len(line)


def _resolve(page_source: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (page_source.parent / path).resolve(), anchor


def on_files(files: Files, config) -> Files:
    root, docs = _root(config), Path(config.docs_dir).resolve()
    readme = root / "README.md"
    files.append(File.generated(config, "index.md", abs_src_path=str(readme)))
    for page in [file for file in files if file.is_documentation_page()]:
        source = _source(page)
        for _, _, target in _targets(source.read_text(encoding="utf-8")):
            path, _ = _resolve(source, target)
            if path.is_file() and path.is_relative_to(root) and not path.is_relative_to(docs) and path != readme:
                src_uri = posixpath.join(REPO_PREFIX, path.relative_to(root).as_posix())
                if files.get_file_from_path(src_uri) is None:
                    files.append(_RepoFile.generated(config, src_uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    root, docs = _root(config), Path(config.docs_dir).resolve()
    source = _source(page.file)
    page_dir = (docs / page.file.src_uri).parent
    pieces, last = [], 0
    for start, end, target in _targets(markdown):
        path, anchor = _resolve(source, target)
        if not path.exists() or not path.is_relative_to(root):
            continue  # left as written: mkdocs reports it
        if path == root / "README.md":
            in_site = docs / "index.md"
        elif path.is_relative_to(docs):
            in_site = path
        else:
            in_site = docs / REPO_PREFIX / path.relative_to(root)
        rewritten = Path(posixpath.relpath(in_site, page_dir)).as_posix() + (f"#{anchor}" if anchor else "")
        pieces += [markdown[last:start], rewritten]
        last = end
    return "".join(pieces) + markdown[last:]
