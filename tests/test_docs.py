"""The project's documents stay true: links resolve inside the repository, docs/architecture.md names
only tests that exist, and its layer table is the one tests/test_layering.py enforces; docs/flags.md is the
commands' --help, and the hub download command the documents give is the installed one's."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _map_text_per_folder() -> dict[str, str]:
    """docs/architecture.md's map of cairn/: for each folder ("cairn", "cairn.cache.disk", ...) the text of its own
    rows (a folder row is `name/` indented two spaces per level; the rows below it, until the next folder row at its
    level or above, are its own)."""
    block = ARCHITECTURE.read_text().split("\n```\ncairn/\n", 1)[1].split("\n```", 1)[0]
    own, stack = {"cairn": []}, []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        folder = re.match(r"^ +([a-z_]+)/(\s|$)", line)
        if folder and indent % 2 == 0 and indent >= 2:
            stack = stack[: indent // 2 - 1] + [folder.group(1)]
            own[".".join(["cairn", *stack])] = [line[folder.end():]]
        else:
            if indent == 2:
                stack = []  # a top-level module's row
            own[".".join(["cairn", *stack])].append(line)
    return {folder: " ".join(rows) for folder, rows in own.items()}


def test_the_architecture_map_names_every_folder_and_module_of_cairn():
    """The map in docs/architecture.md is `ls -R cairn` explained: each folder has its row, and each module (and C++
    source) is named in its own folder's rows."""
    rows, missing = _map_text_per_folder(), []
    for path in sorted((ROOT / "cairn").rglob("*")):
        rel = path.relative_to(ROOT)
        if "__pycache__" in rel.parts or path.name == "__init__.py":
            continue
        if path.is_dir():
            missing += [] if ".".join(rel.parts) in rows else [f"{rel}/"]
        elif path.suffix in (".py", ".cpp", ".h"):
            words = set(re.findall(r"[\w.]+", rows.get(".".join(rel.parent.parts), "")))
            missing += [] if path.name in words or path.stem in words else [str(rel)]
    assert not missing, f"docs/architecture.md's map of cairn/ leaves out: {missing}"


def test_every_package_of_cairn_says_what_it_holds():
    silent = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "cairn").rglob("__init__.py"))
              if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert not silent, f"packages whose __init__.py has no docstring: {silent}"


def test_the_testing_map_names_every_test_file():
    """docs/testing.md's map places every tests/test_*.py under the package folder whose behaviour it checks."""
    text = (ROOT / "docs" / "testing.md").read_text()
    table = text.split("## Where a behaviour's test lives", 1)[1].split("\n## ", 1)[0]
    named = {re.sub(r"\s*\(.*\)", "", cell).strip() for row in table.splitlines() if row.startswith("| `") or
             row.startswith("| the ") for cell in row.split("|")[2].split(",")}
    files = {p.stem.removeprefix("test_") for p in (ROOT / "tests").glob("test_*.py")}
    assert not files - named, f"test files docs/testing.md's map leaves out: {sorted(files - named)}"
    assert not named - files, f"docs/testing.md's map names test files that do not exist: {sorted(named - files)}"


def test_the_flag_reference_is_the_commands_help():
    from cairn.cli import help_reference

    assert (ROOT / "docs" / "flags.md").read_text() == help_reference(), \
        "docs/flags.md is not the commands' --help: regenerate it with scripts/flags-reference"


def test_the_hub_download_command_the_documents_give_is_the_installed_hubs():
    """README.md, docs/ and the refusal of a hub id as --model say to run `hf download REPO --local-dir DIR`: the
    installed huggingface_hub ships that command (its `hf` script beside this interpreter), with that option. No
    network: `--help` only, offline, with the hub's update check off."""
    from cairn.preflight import UserError, check_model

    with pytest.raises(UserError) as refusal:
        check_model("Qwen/Qwen3.5-0.8B")
    texts = {doc.name: doc.read_text() for doc in DOCUMENTS} | {"the hub id's refusal": str(refusal.value)}
    assert not [name for name, text in texts.items() if "huggingface-cli" in text]
    commands = {name: re.findall(r"\bhf download (\S+) --local-dir (\S+)", text) for name, text in texts.items()}
    assert commands["README.md"] and commands["the hub id's refusal"], commands
    assert not [name for name, text in texts.items() if text.count("hf download") != len(commands[name])], \
        "an `hf download` that is not `hf download REPO --local-dir DIR`"
    hf = Path(sys.executable).with_name("hf")
    assert hf.is_file(), f"no {hf}: the installed huggingface_hub does not ship the `hf` command"
    out = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"})
    assert out.returncode == 0, out.stderr
    assert "--local-dir" in out.stdout, out.stdout
