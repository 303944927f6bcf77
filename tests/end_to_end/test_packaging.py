"""The package as a packager builds it: the sdist and the wheel from setuptools' PEP 517 backend (what ``python -m
build`` calls, here without its isolated environment, so offline), with the license as an SPDX expression, no
setuptools deprecation warning, and the sdist carrying the tests, the docs and the license."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

pytestmark = pytest.mark.slow  # two builds: about 30 s

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BUILD = """
import sys, warnings
from setuptools import build_meta
warnings.simplefilter("always")
print(getattr(build_meta, sys.argv[1])(sys.argv[2]))
"""


def _source_tree(destination) -> str:
    """The files of the repository a fresh clone has (tracked, and new files not ignored), copied to
    ``destination``: a build must not see local leftovers (virtual environments, outputs, egg-info)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the source tree to build cannot be told from local leftovers")
    for relative in filter(None, listed.stdout.split("\0")):
        source = os.path.join(ROOT, relative)
        if os.path.isfile(source):
            target = os.path.join(destination, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)
    return str(destination)


def _build(kind: str, source: str, out: str) -> tuple[str, str]:
    """``build_meta.build_<kind>(out)`` in ``source``; the built file's path and the backend's output."""
    result = subprocess.run(
        [sys.executable, "-c", _BUILD, f"build_{kind}", out],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "always"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return os.path.join(out, result.stdout.strip().splitlines()[-1]), output


def test_the_sdist_and_the_wheel_build_with_an_spdx_license_and_the_sdist_holds_tests_and_docs(tmp_path):
    source = _source_tree(tmp_path / "source")
    out = str(tmp_path / "dist")
    os.makedirs(out)
    sdist, sdist_output = _build("sdist", source, out)
    wheel, wheel_output = _build("wheel", source, out)
    for output in (sdist_output, wheel_output):  # e.g. license = { text = ... }: "SetuptoolsDeprecationWarning"
        assert "deprecat" not in output.lower(), output

    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        metadata = archive.extractfile(f"{os.path.basename(sdist)[: -len('.tar.gz')]}/PKG-INFO").read().decode()
    for expected in (
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "MANIFEST.in",
        "mkdocs.yml",
        "a3po_trl/trainer.py",
        "docs/RELIABILITY.md",
        "docs/reference/trainer.md",
        "tests/conftest.py",
        "tests/tiny.py",
        "tests/helpers.py",
        "tests/unit/test_functional.py",
        "tests/integration/test_trainer.py",
        "tests/scripts/resume_agreement.py",
        "benchmarks/__init__.py",
        "examples/accelerate_configs/fsdp2.yaml",
    ):
        assert expected in names, expected
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert "Apache License" in archive_text(wheel, ".dist-info/licenses/LICENSE")
    assert not [name for name in names if name.startswith(("tests/", "docs/", "benchmarks/"))]  # the package only
    assert any(name == "a3po_trl/cli/grpo.py" for name in names)
    entry_points = archive_text(wheel, ".dist-info/entry_points.txt")
    assert "a3po-trl = a3po_trl.cli:main" in entry_points


def archive_text(wheel: str, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(next(name for name in archive.namelist() if name.endswith(suffix))).decode()
