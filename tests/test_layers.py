"""The layer table of docs/architecture.md is what the imports do: every import of every module
of tidal (inside functions too) goes to a package listed before its own, and no modules import
each other in a cycle."""

import ast
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

# Edges against the order, each named under the table in docs/architecture.md with its reason.
EXCEPTIONS = {("tidal.rollout", "tidal.workers")}


def layer_order() -> list[str]:
    """The packages of the table in docs/architecture.md, in order (a row's left to right)."""
    section = DOC.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `tidal")]
    return [name for row in rows for name in re.findall(r"`(tidal\.\w+)`", row.split("|")[1])]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "tidal").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def parse(path: Path, tries: int = 3) -> ast.Module:
    """``ast.parse`` of a file. CPython 3.11 keeps the AST converter's recursion depth per
    interpreter, not per thread, so a parse racing another thread's (a reward thread left by an
    earlier test of this worker, e.g. sympy's parser) can fail with "AST constructor recursion
    depth mismatch"; that race, and only it, is retried."""
    for attempt in range(tries):
        try:
            return ast.parse(path.read_text())
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def imported_names(module: str, path: Path) -> set[str]:
    """Every name an ``import`` in the module brings in, as a dotted path; ``from a import b``
    gives ``a`` and ``a.b`` (``b`` may be a submodule)."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "tidal" or n.startswith("tidal.")}


def import_graph() -> nx.DiGraph:
    """Module -> each tidal module it imports (a name resolved to its longest module prefix)."""
    mods, graph = modules(), nx.DiGraph()
    graph.add_nodes_from(mods)
    for module, path in mods.items():
        for name in imported_names(module, path):
            while name not in mods:
                name = name.rpartition(".")[0]
            if name != module:
                graph.add_edge(module, name)
    return graph


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_package_is_in_the_table_once():
    order = layer_order()
    assert len(order) == len(set(order)), f"a package is listed twice: {order}"
    packages = {package(m) for m in modules()} - {"tidal"}
    assert packages == set(order), (
        f"not in the table: {sorted(packages - set(order))}; "
        f"in the table but not in tidal/: {sorted(set(order) - packages)}"
    )


def test_each_package_imports_only_packages_listed_before_it():
    order = layer_order()
    rank = {name: i for i, name in enumerate(order)}
    edges = {
        (package(a), package(b)): (a, b)
        for a, b in import_graph().edges
        if package(a) != package(b) and "tidal" not in (package(a), package(b))
    }
    wrong = sorted(
        f"{a} imports {b} ({edges[a, b][0]} -> {edges[a, b][1]})"
        for a, b in edges
        if rank[b] > rank[a] and (a, b) not in EXCEPTIONS
    )
    assert not wrong, "imports against the layer table:\n" + "\n".join(wrong)
    stale = sorted(f"{a} -> {b}" for a, b in EXCEPTIONS if (a, b) not in edges)
    assert not stale, f"exceptions no import needs any more (remove them): {stale}"
    text = DOC.read_text()
    for a, b in EXCEPTIONS:
        assert f"`{a}` → `{b}`" in text, f"docs/architecture.md does not name the edge {a} -> {b}"


def test_config_imports_nothing_of_tidal_but_the_registry_and_the_extras():
    graph = import_graph()
    outside = {
        (a, b)
        for a, b in graph.edges
        if package(a) == "tidal.config"
        and package(b) not in ("tidal.config", "tidal.registry", "tidal.extras")
    }
    assert not outside, f"tidal.config reaches out of the schema: {sorted(outside)}"


def test_no_worker_module_imports_another():
    """Workers are glue, each read and changed alone: what two of them share lives below them
    (the actors' base in tidal.trainer, routes in tidal.data.routes, records in tidal.envs)."""
    inside = sorted(
        f"{a} -> {b}"
        for a, b in import_graph().edges
        if a.startswith("tidal.workers.") and package(b) == "tidal.workers"
    )
    assert not inside, "worker modules importing each other:\n" + "\n".join(inside)


WORKER_LINES = 250


def test_every_worker_module_is_short():
    """Thin glue: logic that is not goes to the layers below (envs, data, algorithms)."""
    long = {
        path.name: n
        for path in sorted((ROOT / "tidal" / "workers").glob("*.py"))
        if (n := len(path.read_text().splitlines())) > WORKER_LINES
    }
    assert not long, f"worker modules over {WORKER_LINES} lines: {long}"


def test_no_modules_import_each_other_in_a_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_the_import_graph_sees_imports_inside_functions():
    """The checker itself: an import inside a function is an edge, as is `from package import
    submodule`."""
    graph = import_graph()
    # tidal.cli imports the run loop only inside its train command
    assert graph.has_edge("tidal.cli", "tidal.runners.loop")
    assert graph.has_edge("tidal.runtime.backends.ray_routed", "tidal.runtime.backends.ray_pipe")
