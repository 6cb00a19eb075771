"""The house rules of the product code (distanom/), checked from its source text: no
module over 600 lines, no import circle, a docstring on every module and on every public
definition, no test double shipped in the package, and every module named in
docs/design.md's module map."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "distanom"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The package's modules that one import statement loads (a name imported from a
    package counts as its submodule when one of that name exists)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                yield alias.name
        return
    if not isinstance(node, ast.ImportFrom):
        return
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base]) if base else ".".join(anchor)
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            yield f"{base}.{alias.name}"
        elif base in known:
            yield base


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            for target in _imported(node, name, is_package, known):
                # lazy imports count: a package's __init__ that imports a submodule inside
                # a function still closes a circle with a submodule importing the package
                if target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_product_modules() -> None:
    assert _cycles(_import_graph()) == []


def test_no_product_module_over_600_lines() -> None:
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
        for path in _modules().values()
    }
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def _public_definitions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if isinstance(node, defs) and not node.name.startswith("_"):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, defs) and not member.name.startswith("_"):
                        if any(
                            isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")
                            for d in member.decorator_list
                        ):
                            continue  # the property's getter carries the docstring
                        yield f"{node.name}.{member.name}", member


def test_every_module_and_public_definition_has_a_docstring() -> None:
    missing = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if path.stat().st_size and ast.get_docstring(tree) is None:
            missing.append(name)
        for what, node in _public_definitions(tree):
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if ast.get_docstring(node) is None:
                missing.append(f"{name}.{what}")
    assert missing == []


def test_no_test_double_ships_in_the_package() -> None:
    doubles = [p.name for p in PACKAGE.rglob("*.py") if "synth" in p.stem or "fake" in p.stem]
    assert doubles == []


def _named_in_module_map() -> set[str]:
    """The names in backticks in docs/design.md's "Modules" section, each also as its
    last path part and without ".py"."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for token in section.split("`")[1::2]:
        last = token.rstrip("/").rsplit("/", 1)[-1]
        names.update({token, last, last.removesuffix(".py")})
    return names


def test_every_module_is_in_the_design_module_map() -> None:
    named = _named_in_module_map()
    unnamed = [
        str(path.relative_to(PACKAGE))
        for path in _modules().values()
        if path.name != "__init__.py" and path.stem not in named
    ]
    assert unnamed == [], "add them to docs/design.md's Modules table"
