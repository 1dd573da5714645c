"""The project's documents stay true: links resolve inside the repository, docs/architecture.md names
only tests that exist, and its layer table is the one tests/test_layering.py enforces."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_layering import LAYERS

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_readme_links_the_architecture_document():
    assert "](docs/architecture.md)" in (ROOT / "README.md").read_text()


def test_markdown_links_resolve_to_files_inside_the_repository():
    bad = []
    for doc in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{doc.name}: {target}")
    assert not bad, f"links outside the repository or to nothing: {bad}"


def test_the_architecture_names_only_tests_that_exist():
    text, missing, current = ARCHITECTURE.read_text(), [], None
    for file, name in re.findall(r"`(?:(test_\w+)\.py)?(?:::(test_\w+))?`", text):
        current = file or current
        if file and not (ROOT / "tests" / f"{file}.py").is_file():
            missing.append(f"tests/{file}.py")
        if name and f"def {name}(" not in (ROOT / "tests" / f"{current}.py").read_text():
            missing.append(f"{current}.py::{name}")
    bare = set(re.findall(r"`(test_\w+)`", text))
    defined = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    missing += sorted(name for name in bare if f"def {name}(" not in defined)
    assert not missing, f"docs/architecture.md names tests that do not exist: {missing}"


def test_the_architecture_layer_table_is_the_one_the_layering_test_enforces():
    text = ARCHITECTURE.read_text()
    rows = text.split("| group | modules | may import |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    documented = {}
    for row in rows:
        group, _, may = (cell.strip() for cell in row.strip("|").split("|"))
        may = re.sub(r"\([^)]*\)", "", may)
        documented[group.replace(" ", "_")] = (frozenset({"*"}) if may == "anything" else frozenset()
                                               if may.startswith("nothing") else
                                               frozenset(m.strip().replace(" ", "_") for m in may.split(",")))
    assert documented == {group: may for group, (_, may) in LAYERS.items()}


def test_the_readme_layout_names_every_module_and_package_of_cairn():
    layout = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n```\n", 2)[1]
    named = set(re.findall(r"\b(\w+\.py)\b", layout)) | set(re.findall(r"^  (\w+)/", layout, re.M))
    modules = {p.name for p in (ROOT / "cairn").glob("*.py") if p.name != "__init__.py"}
    packages = {p.name for p in (ROOT / "cairn").iterdir() if (p / "__init__.py").is_file()}
    assert not (modules | packages) - named, f"README.md's layout leaves out: {sorted((modules | packages) - named)}"
