"""Packaging: every third-party package cairn imports is declared in pyproject.toml, and the CPU ops' C++ ships."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"cairn", "benchmarks"}  # this repository's own top-level packages


def imported_top_levels(files) -> set[str]:
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in LOCAL}


def declared(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def distributions(modules: set[str]) -> set[str]:
    by_module = importlib.metadata.packages_distributions()
    return {by_module[m][0].lower().replace("_", "-") for m in modules}


def test_every_imported_package_is_declared():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    runtime = declared(project["dependencies"])
    bench = runtime | declared(project["optional-dependencies"]["bench"])
    demo = runtime | declared(project["optional-dependencies"]["demo"])
    package = [p for p in (REPO_ROOT / "cairn").rglob("*.py") if not {"bench", "demo"} & set(p.parts)]
    bench_files = list((REPO_ROOT / "cairn" / "bench").rglob("*.py"))
    demo_files = list((REPO_ROOT / "cairn" / "demo").rglob("*.py"))
    assert not distributions(imported_top_levels(package)) - runtime
    assert not distributions(imported_top_levels(bench_files)) - bench  # `cairn bench` needs the bench extra
    assert not distributions(imported_top_levels(demo_files)) - demo  # the demo model's training, the demo extra



def test_the_cpu_ops_cpp_sources_ship_as_package_data():
    """cairn/ops/csrc/ is no Python package: its .cpp and .h files reach a wheel or an sdist only as package data
    ([tool.setuptools.package-data]), and an installed cairn compiles its CPU ops from them on first use."""
    patterns = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    ops = REPO_ROOT / "cairn" / "ops"
    files = [p.relative_to(ops).as_posix() for p in (ops / "csrc").iterdir()]
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns["cairn.ops"]) for f in files)


def test_every_folder_of_python_modules_is_a_package_the_wheel_finds():
    """[tool.setuptools.packages.find] finds only folders with an __init__.py: one without (cairn/model/ had none, a
    namespace package the editable install imports all the same) is left out of a wheel, and `pip install .` gives
    a cairn whose every model import fails."""
    from setuptools import find_packages

    found = set(find_packages(str(REPO_ROOT), include=["cairn*"]))
    folders = {".".join(p.parent.relative_to(REPO_ROOT).parts) for p in (REPO_ROOT / "cairn").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders <= found, f"folders of modules a wheel leaves out (no __init__.py): {sorted(folders - found)}"
