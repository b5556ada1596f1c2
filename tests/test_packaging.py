"""What the wheel ships: every file of the package that is not Python is named by the package
data of pyproject.toml (a viewer script or a Metal header left out breaks only an installed
copy), and the package says it is typed. CI builds the wheel and runs the demo from it (.ci/run)."""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]


def _package_data() -> list[str]:
    if tomllib is None:
        pytest.skip("tomllib is Python 3.11's")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["setuptools"]["package-data"]["graphkern"])


def test_the_package_is_typed() -> None:
    assert (ROOT / "graphkern" / "py.typed").is_file()
    assert "py.typed" in _package_data()


def test_every_file_the_package_holds_is_shipped() -> None:
    try:
        tracked = subprocess.run(["git", "ls-files", "graphkern"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    patterns = _package_data()
    data = [path.removeprefix("graphkern/") for path in tracked if not path.endswith(".py")]
    left_out = [path for path in data if not any(fnmatch.fnmatch(path, p) for p in patterns)]
    assert data and not left_out, left_out


def test_ci_builds_the_wheel_and_runs_the_demo_from_it() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("python -m pytest -q") < ci.index("python -m build")
    assert 'graphkern" demo --no-files' in ci and "py.typed" in ci
