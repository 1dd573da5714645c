"""What the demo corpus takes from this machine: Python's standard library and Debian's documentation.

Three kinds of material, each read in a sorted, fixed order so that a seed gives the same corpus on
the same machine:
- `stdlib_sources()`: the .py files of the running Python's standard library (PSF licence);
- `english_texts()`: the licence texts in /usr/share/common-licenses and the README and copyright
  files in /usr/share/doc (each under its package's licence, as the copyright file beside it says);
- `api_docs()`: for a fixed list of standard modules, each public function's signature and the
  first paragraph of its docstring, what the generated conversations talk about;
- `code_snippets()`: short top-level functions of the standard library, for the file-editing turns.

Every list is split by a stable hash of its item's name into training and held-out parts
(`held_out(name)`), so the evaluation reads text the model never saw.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib
import inspect
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_PERCENT = 5
MAX_FILE_BYTES = 200_000  # larger sources (generated tables, test data) are skipped
DOC_DIRS = (Path("/usr/share/common-licenses"), Path("/usr/share/doc"))
# The modules the conversations talk about: pure-Python, imported without side effects.
API_MODULES = (
    "base64", "bisect", "calendar", "collections", "copy", "csv", "dataclasses", "datetime", "difflib", "enum",
    "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html", "itertools", "json", "math",
    "operator", "os", "os.path", "pathlib", "pprint", "random", "re", "secrets", "shlex", "shutil", "statistics",
    "string", "struct", "tempfile", "textwrap", "time", "typing", "urllib.parse", "uuid", "zlib",
)


def held_out(name: str) -> bool:
    """Whether `name` belongs to the held-out part (a stable hash, the same on every machine)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100 < HELD_OUT_PERCENT


@dataclass(frozen=True)
class ApiDoc:
    module: str
    name: str
    signature: str  # "dumps(obj, *, skipkeys=False, ...)"
    summary: str  # the docstring's first paragraph, on one line


@dataclass(frozen=True)
class Snippet:
    name: str  # "module.function"
    source: str  # the function's source, dedented


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's .py files, tests and site-packages left out."""
    root = stdlib_dir()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/idle_test/", "lib2to3/tests/")) or "/tests/" in rel:
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append((rel, text))
    return out


def english_texts() -> list[tuple[str, str]]:
    """(path, text) of licence texts and package documentation in plain (or gzipped) English text."""
    out: dict[str, str] = {}
    for root in DOC_DIRS:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            name = path.name.lower()
            if not path.is_file() or path.is_symlink():
                continue
            plain = name.removesuffix(".gz")
            if root.name == "doc" and not (plain == "copyright" or plain.startswith("readme")):
                continue
            try:
                data = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
            except (OSError, EOFError, gzip.BadGzipFile):
                continue
            if len(data) > MAX_FILE_BYTES or b"\0" in data:
                continue
            text = data.decode("utf-8", errors="replace")
            if text not in out.values():
                out[path.as_posix()] = text
    return sorted(out.items())


def _first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split())


def api_docs() -> list[ApiDoc]:
    """The public functions of API_MODULES with a docstring, in a fixed order."""
    docs = []
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            if getattr(obj, "__module__", None) not in (module.__name__, module_name) and module_name != "os.path":
                continue
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            summary = _first_paragraph(doc)
            if not 20 <= len(summary) <= 300:
                continue
            try:
                signature = f"{name}{inspect.signature(obj)}"
            except (TypeError, ValueError):
                signature = f"{name}(...)"
            if len(signature) > 120:
                continue
            docs.append(ApiDoc(module_name, name, signature, summary))
    return docs


def code_snippets(max_lines: int = 14) -> list[Snippet]:
    """Top-level functions of the standard library of 4 to `max_lines` lines, with no decorator."""
    out = []
    for rel, text in stdlib_sources():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.decorator_list and node.end_lineno:
                n = node.end_lineno - node.lineno + 1
                if 4 <= n <= max_lines:
                    source = "\n".join(lines[node.lineno - 1:node.end_lineno])
                    if source.isascii() and "\t" not in source:
                        out.append(Snippet(f"{rel[:-3].replace('/', '.')}.{node.name}", source))
    return out
