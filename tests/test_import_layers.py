"""The gateway's import graph is a DAG in layers: a module imports its own layer or a lower one, never a
higher one; the imports within a layer have no cycle (counting the package `__init__` an import runs
first); and a function-level import exists only for an optional heavy dependency, marked `# lazy: <why>`
on its line or in the comment just above it. Every import counts: module-level, function-level and
under `if TYPE_CHECKING:` (a type-only cycle is still a cycle in the design). The modules are parsed,
not imported, so the test sees what the `import` statements say."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "harmony_gateway"
SOURCE_ROOT = Path(__file__).resolve().parents[1] / "src"

# The layers, highest first: the command line builds the app, the app mounts the ASGI edge, the edge
# routes to the surfaces, the surfaces drive the shared pipeline, the pipeline uses the subsystems, and
# everything may use the leaves. Keys are the first name under `harmony_gateway` (a package or a
# module); the package's own `__init__` is the "" key.
LAYERS: dict[str, int] = {
    "cli": 6,
    "app": 5,
    "api": 4,
    "surfaces": 3,
    "pipeline": 2,
    "routing": 1,
    "engines": 1,
    "harmony": 1,
    "storage": 1,
    "mcp": 1,
    "traffic": 1,
    "asgi": 0,
    "errors": 0,
    "observability": 0,
    "types": 0,
    "principal": 0,
    "settings": 0,
    "netguard": 0,
    "sse": 0,
    "tasks": 0,
    "wire": 0,
    "": 0,
}

# The simulated engine stands outside the layers: it may import anything of the gateway, and only the
# command line (and the simulator itself) may import it.
SIMULATOR = "sim"
MAY_IMPORT_SIMULATOR = {"cli", SIMULATOR}

# Edges allowed to break the order for a while, with why (none today). The last test fails once an
# entry's edge is gone, so the list never outlives its reason.
ALLOWED_UPWARD_EDGES: frozenset[tuple[str, str]] = frozenset({})
# Unmarked function-level imports allowed for a while, as (importing module, imported module).
ALLOWED_UNMARKED_LAZY: frozenset[tuple[str, str]] = frozenset({})

LAZY_MARKER = "# lazy:"


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: Path
    line: int
    end_line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def gateway_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((SOURCE_ROOT / PACKAGE).rglob("*.py"))}


def resolve(importer: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(importer: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))

    def visit(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(
                        importer, alias.name, path, child.lineno, child.end_lineno or child.lineno, inside
                    )
            elif isinstance(child, ast.ImportFrom):
                target = resolve(importer, path, child)
                targets = [target]
                # `from . import sql` imports the submodule, not only the package.
                targets += [
                    f"{target}.{alias.name}" for alias in child.names if f"{target}.{alias.name}" in modules
                ]
                for imported in targets:
                    yield Import(
                        importer, imported, path, child.lineno, child.end_lineno or child.lineno, inside
                    )
            else:
                yield from visit(child, inside)

    yield from visit(tree, False)


def all_imports() -> list[Import]:
    modules = gateway_modules()
    return [found for name, path in modules.items() for found in imports_of(name, path, modules)]


def location(edge: Import) -> str:
    return f"{edge.path.relative_to(SOURCE_ROOT.parent)}:{edge.line}"


def top_level(module: str) -> str | None:
    """The first name under the package (`""` for the package itself), or None outside the gateway."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    return parts[1] if len(parts) > 1 else ""


def internal_edges() -> list[Import]:
    return [found for found in all_imports() if top_level(found.imported) is not None]


def test_every_part_of_the_gateway_has_a_layer() -> None:
    parts = {top_level(name) for name in gateway_modules()}
    assert parts - {SIMULATOR} == set(LAYERS), "give each new package or module a layer in LAYERS"


def test_imports_point_to_the_same_or_a_lower_layer() -> None:
    wrong = []
    for edge in internal_edges():
        source, target = top_level(edge.importer), top_level(edge.imported)
        assert source is not None and target is not None
        if target == SIMULATOR:
            if source not in MAY_IMPORT_SIMULATOR:
                wrong.append(f"{location(edge)}: {edge.importer} -> {edge.imported} (only cli imports sim)")
            continue
        if source == SIMULATOR or (edge.importer, edge.imported) in ALLOWED_UPWARD_EDGES:
            continue
        if LAYERS[target] > LAYERS[source]:
            wrong.append(f"{location(edge)}: {edge.importer} ({source}) -> {edge.imported} ({target})")
    assert not wrong, "imports up the layers:\n" + "\n".join(wrong)


def tangles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module (Tarjan): each is a set
    of modules that import each other, directly or around a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for start in sorted(graph):
        if start not in index:
            connect(start)
    return found


def packages_run_first(importer: str, imported: str, modules: dict[str, Path]) -> list[str]:
    """The packages whose `__init__` importing `imported` runs before the module itself: each package
    above it that is not above `importer` too (those ran before `importer` did). A package that imports
    its own modules eagerly thereby becomes part of every import of one of them."""
    parts = imported.split(".")
    above = [".".join(parts[:end]) for end in range(1, len(parts))]
    return [package for package in above if package in modules and not importer.startswith(package + ".")]


def test_imports_within_a_layer_form_no_cycle() -> None:
    modules = gateway_modules()
    graph: dict[str, set[str]] = {}
    for edge in internal_edges():
        source, target = top_level(edge.importer), top_level(edge.imported)
        if SIMULATOR in (source, target):
            continue
        assert source is not None and target is not None
        if LAYERS[source] == LAYERS[target]:
            for imported in [*packages_run_first(edge.importer, edge.imported, modules), edge.imported]:
                if imported != edge.importer:
                    graph.setdefault(edge.importer, set()).add(imported)
    cycles = tangles(graph)
    assert not cycles, "modules importing each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def says_why_lazy(edge: Import, lines: list[str], import_lines: set[int]) -> bool:
    """A `# lazy:` comment on the import itself or in the comment just above it; a run of consecutive
    imports (several names from one optional dependency) shares the comment above its first line."""
    first = edge.line
    while first - 1 in import_lines:
        first -= 1
    comment = []
    above = first - 1
    while above >= 1 and lines[above - 1].lstrip().startswith("#"):
        comment.append(lines[above - 1])
        above -= 1
    return any(LAZY_MARKER in line for line in [*comment, *lines[edge.line - 1 : edge.end_line]])


def test_function_level_imports_say_why_they_are_lazy() -> None:
    lazy = [edge for edge in all_imports() if edge.in_function and top_level(edge.importer) != SIMULATOR]
    import_lines: dict[Path, set[int]] = {}
    for edge in lazy:
        import_lines.setdefault(edge.path, set()).update(range(edge.line, edge.end_line + 1))
    unmarked = []
    for edge in lazy:
        if (edge.importer, edge.imported) in ALLOWED_UNMARKED_LAZY:
            continue
        if not says_why_lazy(edge, edge.path.read_text().splitlines(), import_lines[edge.path]):
            unmarked.append(f"{location(edge)}: {edge.importer} imports {edge.imported}")
    assert not unmarked, f"function-level imports without a {LAZY_MARKER!r} reason:\n" + "\n".join(unmarked)


def test_the_allow_lists_name_only_edges_that_still_exist() -> None:
    edges = {(edge.importer, edge.imported) for edge in all_imports()}
    assert ALLOWED_UPWARD_EDGES <= edges
    assert ALLOWED_UNMARKED_LAZY <= edges
