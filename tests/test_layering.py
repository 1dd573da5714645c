"""The import rules of docs/architecture.md, checked on the import graph of cairn/.

Every module of cairn/ is parsed with ast (nothing is imported). Every import statement is an edge,
at module level or inside a function (a lazy import is a dependency all the same), and so is a cairn
module named by a string passed to an importing call (`importlib.import_module("cairn.x")`, cairn.cli's
`_lazy("cairn.bench.cli")`: IMPORTING_CALLS). `from cairn.a import b` is an edge to cairn.a.b when that is a module,
else to cairn.a. Imports under `if TYPE_CHECKING:` count for the layer rules (a type is knowledge of
its module too) but not for circles (they never run).

The rules: no import circle; each group of modules imports only the groups LAYERS lets it (read the
table top to bottom: every arrow points down); and the specific rules below it. There is no list of
tolerated exceptions: every edge of the package follows them.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cairn"

# group -> (its modules: names or package prefixes; the groups it may import directly). The longest
# matching prefix places a module; a module that matches nothing fails test_every_module_has_a_layer.
LAYERS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    # the entry points: the public API's lazy re-exports, `cairn ...`, `python -m cairn.bench`
    "entry": (("cairn", "cairn.cli", "cairn.bench.__main__"), frozenset({"*"})),
    # the trained demo model's corpus and training (transformers' classes; never imported when serving)
    "demo": (("cairn.demo",), frozenset({"request", "leaf"})),
    # the router in front of several servers (cairn/router/): it reads what each can resume
    "router": (("cairn.router",), frozenset({"server", "command_line", "cache", "request", "leaf"})),
    # `cairn bench`: a client of the engine (in-process) or of a server (over HTTP)
    "bench": (("cairn.bench",), frozenset({"command_line", "engine", "scheduler", "request", "leaf"})),
    # the OpenAI-compatible server: HTTP, the asyncio <-> engine bridge, metrics
    "server": (("cairn.server",), frozenset({"engine", "request", "leaf"})),
    # flags generated from the config dataclasses; the one-line checks before anything slow
    "command_line": (("cairn.flags", "cairn.preflight"), frozenset({"model", "leaf"})),
    # the engine builds everything at start-up and steps the scheduler and the runner; its outputs and logs
    "engine": (("cairn.engine",),
               frozenset({"scheduler", "runner", "cache", "memory", "model", "ops", "request", "leaf"})),
    # the model runner: one forward pass for a scheduled batch
    "runner": (("cairn.runner", "cairn.decode_graphs"), frozenset({"scheduler", "model", "memory", "leaf"})),
    # continuous batching and admission; the request's state (Sequence)
    "scheduler": (("cairn.scheduler", "cairn.sequence"), frozenset({"cache", "memory", "request", "leaf"})),
    # the prefix cache: radix tree, policies, tiers, disk store
    "cache": (("cairn.cache",), frozenset({"memory", "leaf"})),
    # one file per model family over a shared hybrid stack; the loader
    "model": (("cairn.model",), frozenset({"layers", "ops", "memory", "leaf"})),
    # mixers, attention, MLP / MoE, norms, rotary
    "layers": (("cairn.layers",), frozenset({"ops", "memory", "leaf"})),
    # reference kernels and their optional fast twins
    "ops": (("cairn.ops",), frozenset({"leaf"})),
    # the paged KV pool, page bookkeeping, recurrent-state slots
    "memory": (("cairn.memory",), frozenset({"leaf"})),
    # what a request is made of: tokenizer and chat template, prompt, sampling parameters and the sampler,
    # logits processors, grammars
    "request": (("cairn.request",), frozenset({"leaf"})),
    # imported from anywhere, import nothing of cairn: frozen config, shared exceptions, log formatting,
    # the forward batch (what one model step computes) and the typed stats the cache publishes
    "leaf": (("cairn.config", "cairn.errors", "cairn.logs", "cairn.forward_batch", "cairn.cache.stats"), frozenset()),
}

# (importer prefix, imported prefixes, why): rules beside the layer table. "torch" and "benchmarks" /
# "tests" are not cairn modules: those rules look at third-party and top-level imports as well.
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("cairn.cache", ("cairn.model", "cairn.layers", "cairn.server", "cairn.scheduler", "cairn.sequence",
                     "cairn.engine", "cairn.runner"), "cache/ knows nothing of models, HTTP or the scheduler"),
    ("cairn.cache.tiers", ("cairn.scheduler", "cairn.sequence"), "tiers know nothing of the scheduler"),
    ("cairn.cache.tree", ("cairn.cache.policy",), "the tree knows no policy: its builder hands it the retention key"),
    ("cairn.cache.segments", ("cairn.cache.disk", "cairn.cache.remote"),
     "segments/ is what every segment store shares: it knows none of them"),
    ("cairn.cache.disk", ("cairn.cache.remote",), "the disk store knows nothing of the Redis store"),
    ("cairn.cache.remote", ("cairn.cache.disk",), "the Redis store knows nothing of the disk store"),
    ("cairn.layers", ("cairn.model",), "layers/ sits below model/"),
    ("cairn", ("benchmarks", "tests"), "the package stands alone: nothing from a source checkout"),
]
# the server's own layers, top to bottom (names under cairn.server): each row imports only the rows below it, so
# no API's package reaches back up to prepare or the routes, and the shared parts below know no API
SERVER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("main",), ("app",), ("probe", "tokenize"), ("prepare",), ("anthropic",), ("openai",), ("options", "serving"),
    ("chat", "engine_io", "http", "metrics"), ("errors",))


def _server_rules() -> list[tuple[str, tuple[str, ...], str]]:
    """One rule per name of SERVER_LAYERS: it imports none of the names on its row or the rows above."""
    rules, upper = [], ()
    for row in SERVER_LAYERS:
        upper += row
        rules += [(f"cairn.server.{name}", tuple(f"cairn.server.{other}" for other in upper if other != name),
                   f"cairn.server.{name} imports only the server layers below its row (SERVER_LAYERS)") for name in row]
    return rules


RULES += _server_rules()
# torch-free, and so is all they import (policy/speeds.py times real copies: not here)
TORCH_FREE = ("cairn.cache.tree", "cairn.cache.policy.planner", "cairn.cache.policy.placement",
              "cairn.cache.policy.retention", "cairn.memory.pages")
ONLY_IMPORTS = {"cairn.server.errors": ("cairn.errors",)}  # the HTTP error mapping knows only the exceptions



def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def _targets(importer: str, node: ast.AST) -> list[str]:
    """The modules (cairn's, or a third-party top-level name) one node imports."""
    mods = modules()
    if isinstance(node, ast.Import):
        return [_known(a.name) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = importer.split(".") if mods[importer].name == "__init__.py" else importer.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        if not base.startswith("cairn"):
            return [base]
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else _known(base) for a in node.names]
    if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in IMPORTING_CALLS:
        return [a.value for a in node.args if isinstance(a, ast.Constant) and a.value in mods]
    return []


def _known(name: str) -> str:
    """The deepest cairn module that `name` names (itself for a third-party module)."""
    while name.startswith("cairn.") and name not in modules():
        name = name.rsplit(".", 1)[0]
    return name


@cache
def import_graph() -> dict[str, dict[str, bool]]:
    """importer -> {imported: True when only under TYPE_CHECKING}, third-party imports by top-level name."""
    graph: dict[str, dict[str, bool]] = {}
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _type_checking_nodes(tree)
        edges: dict[str, bool] = {}
        for node in ast.walk(tree):
            for target in _targets(name, node):
                target = target if target.startswith("cairn") else target.split(".")[0]
                if target != name:
                    edges[target] = edges.get(target, True) and id(node) in typing_only
        graph[name] = edges
    return graph


def cairn_edges(runtime_only: bool = False) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in import_graph().items() for b, typing_only in targets.items()
            if b in modules() and not (runtime_only and typing_only)}


def layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for group, (prefixes, _) in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = group, len(prefix)
    return best


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations() -> dict[tuple[str, str], str]:
    """Every edge that breaks a rule, with the rule it breaks."""
    found: dict[tuple[str, str], str] = {}
    for a, b in cairn_edges():
        group_a, group_b = layer_of(a), layer_of(b)
        allowed = LAYERS[group_a][1] if group_a else frozenset()
        if group_a != group_b and "*" not in allowed and group_b not in allowed:
            found[(a, b)] = f"{group_a} may not import {group_b}"
    for a, targets in import_graph().items():
        for b in targets:
            for importer, imported, why in RULES:
                if _under(a, importer) and any(_under(b, p) for p in imported):
                    found[(a, b)] = why
            if a in ONLY_IMPORTS and b.startswith("cairn") and b not in ONLY_IMPORTS[a]:
                found[(a, b)] = f"{a} imports only {', '.join(ONLY_IMPORTS[a])}"
    return found


def _reachable(starts: list[str]) -> set[str]:
    edges = cairn_edges()
    seen, todo = set(starts), list(starts)
    while todo:
        current = todo.pop()
        for a, b in edges:
            if a == current and b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def circles() -> list[list[str]]:
    """One circle per strongly connected group of modules (runtime imports only)."""
    edges = cairn_edges(runtime_only=True)
    out = {m: sorted(b for a, b in edges if a == m) for m in modules()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(m: str) -> None:  # Tarjan's algorithm
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in out[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(modules()):
        if m not in index:
            visit(m)
    return found


def _listing(edges) -> str:
    return "\n".join(f"  {a} -> {b}" + (f"   ({why})" if why else "") for (a, b), why in sorted(edges))


IMPORTING_CALLS = {"import_module", "__import__", "_lazy"}  # calls whose string argument is a module to import


# ---- the tests -----------------------------------------------------------------------------------

def test_the_graph_sees_lazy_and_string_named_imports():
    edges = cairn_edges()
    assert ("cairn.engine.llm", "cairn.engine.engine") in edges  # module level
    assert ("cairn.cli", "cairn.server.main") in edges  # inside run_serve
    assert ("cairn.cli", "cairn.bench.cli") in edges  # _lazy("cairn.bench.cli")
    assert ("cairn.ops", "cairn.ops.gdn") in edges  # `from cairn.ops import gdn` in the package itself
    assert import_graph()["cairn.cache.policy.retention"]["cairn.cache.tree.nodes"] is True  # only under TYPE_CHECKING


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"


def test_the_server_layers_place_every_server_module():
    placed = {f"cairn.server.{name}" for row in SERVER_LAYERS for name in row}
    unplaced = sorted(m for m in modules() if _under(m, "cairn.server") and m != "cairn.server"
                      and not any(_under(m, p) for p in placed))
    assert not unplaced, f"place these modules in SERVER_LAYERS: {unplaced}"


def test_the_layer_table_points_down():
    """The allowed imports between groups form no circle, so the table is a layering."""
    allowed = {g: {h for h in may if h != "*"} for g, (_, may) in LAYERS.items()}
    assert all(h in LAYERS for may in allowed.values() for h in may)
    placed: list[str] = []
    while len(placed) < len(allowed):
        ready = [g for g in allowed if g not in placed and allowed[g] <= set(placed)]
        assert ready, f"the allowed imports between {sorted(set(allowed) - set(placed))} form a circle"
        placed += ready


def test_no_import_circle():
    found = circles()
    edges = cairn_edges(runtime_only=True)
    inside = [((a, b), f"circle {i + 1}") for i, c in enumerate(found) for a, b in sorted(edges) if a in c and b in c]
    assert not found, f"{len(found)} import circle(s); the edges among their modules:\n" + _listing(inside)


def test_imports_follow_the_layers():
    unexpected = violations()
    assert not unexpected, "imports against the layering (see docs/architecture.md):\n" + _listing(unexpected.items())


def test_the_radix_tree_and_the_policies_know_nothing_of_torch():
    starts = [m for m in modules() if any(_under(m, p) for p in TORCH_FREE)]
    with_torch = sorted(m for m in _reachable(starts) if "torch" in import_graph()[m])
    assert starts and not with_torch, f"{TORCH_FREE} (and all they import) must not import torch: {with_torch}"


def test_the_core_imports_neither_bench_nor_server():
    """No path leads from the core to bench/ or server/: no edge leaves the core for them, the router or the
    entry points."""
    top = ("entry", "router", "bench", "server")
    upward = {(a, b) for a, b in cairn_edges() if layer_of(a) not in top and layer_of(b) in top}
    assert not upward, "the core imports bench/, server/, the router or an entry point:\n" + _listing(
        (e, "") for e in upward)


def test_the_server_asks_the_engine_not_its_cache():
    """server/ reaches the prefix cache only through the Engine's methods for it (prefetch, probe, cache_stats,
    num_cached_pages): no `<...>engine.cache` attribute anywhere in its code."""
    reached = sorted(f"{name}: {ast.unparse(node)}" for name, path in modules().items() if _under(name, "cairn.server")
                     for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Attribute) and node.attr == "cache"
                     and ast.unparse(node.value).split(".")[-1] == "engine")
    assert not reached, f"the server reaches engine.cache (call the Engine's methods instead): {reached}"


def test_the_package_never_edits_sys_path():
    edits = sorted(name for name, path in modules().items() for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("sys.path."))
    assert not edits, f"these modules change sys.path: {edits}"
