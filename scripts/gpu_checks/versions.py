"""The version gate of the GPU check: the installed libraries against the windows ``pyproject.toml`` declares.

The device recipe runs the check from the repository (``PYTHONPATH=.``), not from an installed package, so pip never
compared the machine's transformers, TRL or accelerate with the project's requirements; the generator relies on
transformers' internals and the trainer on TRL's, so a version outside its window is refused before anything trains.
The windows are read from ``pyproject.toml`` at run time (``[project] dependencies``), never copied here."""

from __future__ import annotations

import importlib.metadata
import os

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: The repository's ``pyproject.toml`` (this file is ``scripts/gpu_checks/versions.py``).
PYPROJECT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pyproject.toml"
)


def installed_version(package: str) -> str | None:
    """The installed version of distribution ``package`` (None when it is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def declared_windows(pyproject: str = PYPROJECT) -> dict[str, str]:
    """Package -> version window (a PEP 440 specifier such as ``>=5.19.0,<=5.25.0``) of every requirement in
    ``[project] dependencies`` of ``pyproject``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError as error:
            raise RuntimeError(
                "reading pyproject.toml needs Python 3.11+ (tomllib) or the tomli package (pip install tomli)"
            ) from error
    with open(pyproject, "rb") as file:
        dependencies = tomllib.load(file)["project"]["dependencies"]
    windows = {}
    for line in dependencies:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate():
            lower_first = sorted(
                requirement.specifier, key=lambda spec: (not spec.operator.startswith((">", "=", "~")),)
            )
            windows[requirement.name] = ",".join(str(spec) for spec in lower_first)
    return windows


def outside_windows(installed: dict[str, str | None] | None = None, pyproject: str = PYPROJECT) -> list[str]:
    """One sentence per declared dependency whose installed version is missing or outside its window (empty when
    all are inside). ``installed``: package -> version, for the packages it names (the others are looked up)."""
    installed = installed or {}
    problems = []
    for package, window in declared_windows(pyproject).items():
        version = installed[package] if package in installed else installed_version(package)
        where = f"the window pyproject.toml declares ({package}{window})"
        if version is None:
            problems.append(f"{package} is not installed: {where}")
            continue
        try:
            inside = SpecifierSet(window, prereleases=True).contains(Version(version))
        except InvalidVersion:
            inside = False
        if not inside:
            problems.append(
                f"{package} {version} is installed, outside {where}: install a version inside it "
                f"(pip install '{package}{window}')"
            )
    return problems
