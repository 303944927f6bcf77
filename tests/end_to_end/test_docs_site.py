"""The documentation site (``mkdocs.yml``) builds with warnings as errors, and its API reference covers the public API.

``mkdocs build --strict`` fails on a public name the reference no longer finds (a rename), a docstring griffe cannot
parse, a documented parameter that is not in the signature, and a link from the README or a page in ``docs/`` to a
page, heading or repository file that is not there. This test is how CI runs it (``scripts/test.sh`` runs the suite),
and it checks what the build alone does not: that ``AsyncA3POConfig``'s every field is in a parameter table, and that
every name the package exports has its entry in the reference.
"""

import ast
import dataclasses
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE = os.path.join(ROOT, "docs", "reference")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": ROOT}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (
        "mkdocs build --strict failed (the docs tools come with the dev extra: pip install -e '.[dev]'):\n"
        + result.stdout[-4000:]
        + result.stderr[-8000:]
    )
    return site_dir


def _documented_parameters(html: str) -> list[str]:
    return re.findall(r'<tr class="doc-section-item">\s*<td>\s*<code>(\w+)</code>', html)


def test_every_config_field_is_in_a_parameter_table(site):
    from trl import GRPOConfig

    from a3po_trl import AsyncA3POConfig

    grpo_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    own = [
        f.name
        for f in dataclasses.fields(AsyncA3POConfig)
        if f.name not in grpo_defaults or f.name in AsyncA3POConfig.__annotations__
    ]
    assert "max_staleness" in own and "disable_dropout" in own  # added, and changed (default True)
    documented = _documented_parameters((site / "reference" / "config.html").read_text(encoding="utf-8"))
    missing = [name for name in own if name not in documented]
    assert not missing, f"AsyncA3POConfig fields without an entry in the reference: {missing}"
    # the groups of the TRL-style docstring became titled tables
    html = (site / "reference" / "config.html").read_text(encoding="utf-8")
    assert "Parameters that control asynchronous generation</span>" in html
    assert "&gt; Parameters" not in html


def _reference_directives() -> set[str]:
    names = set()
    for page in os.listdir(REFERENCE):
        text = open(os.path.join(REFERENCE, page), encoding="utf-8").read()
        names |= set(re.findall(r"^::: ([\w.]+)$", text, re.M))
    return names


def _exported(module_path: str) -> list[str]:
    tree = ast.parse(open(os.path.join(ROOT, module_path), encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module_path} has no __all__")


@pytest.mark.parametrize(
    "package, init", [("a3po_trl", "a3po_trl/__init__.py"), ("a3po_trl.tasks", "a3po_trl/tasks/__init__.py")]
)
def test_every_exported_name_has_a_reference_entry(package, init):
    directives = _reference_directives()
    missing = [name for name in _exported(init) if f"{package}.{name}" not in directives]
    assert not missing, f"add `::: {package}.<name>` for {missing} to a page in docs/reference/"
    internal = sorted(d for d in directives if not re.fullmatch(r"a3po_trl(\.tasks)?\.\w+", d))
    assert not internal, f"the reference names internal module paths (use the public ones): {internal}"


def test_the_home_page_is_the_readme(site):
    html = (site / "index.html").read_text(encoding="utf-8")
    assert "Two commands on a fresh machine" in html
    assert 'href="BENCHMARKS.html' in html  # docs/BENCHMARKS.md, as a link between pages of the site
