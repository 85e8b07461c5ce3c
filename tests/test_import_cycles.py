"""The import graph of ``moe_ft`` has no cycle, and every import inside a function says why it is there.

The graph is read from the source (``ast``), so it counts every import statement a module can execute:
those at the top, inside functions and inside ``try`` blocks. Only ``if TYPE_CHECKING:`` blocks are left
out: they never run. ``from moe_ft.x import y`` is an edge to ``moe_ft.x.y`` when that is a module,
else to ``moe_ft.x``; importing a package runs its ``__init__``, so an edge to a package is an edge to its
``__init__.py``. Importing ``moe_ft.a.b`` first runs the ``__init__`` of ``moe_ft.a``, so the importer also
has an edge to every package above its target, except the packages that contain the importer itself (those
are already being initialised when it runs: a package whose ``__init__`` re-exports its own submodules is
not a cycle).

An import inside a function hides a dependency unless there is a reason. The accepted reasons are a
comment, on the import's line or on the line right above it (or above the block of consecutive imports it
belongs to), that contains one of
``optional dependency`` (the module may be absent: Triton, Transformer Engine, matplotlib),
``start-up time`` (kept out of commands that must start fast, e.g. Megatron out of ``moe-ft simulate``) or
``import cycle`` (followed by the modules involved).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moe_ft",)
CHECKED_FOR_REASONS = (ROOT / "moe_ft", ROOT / "megatron" / "training")
REASONS = ("optional dependency", "start-up time", "import cycle")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Python modules, and the C extensions built from the packages' ``.c`` sources (setup.py): leaves that
    import nothing of ``moe_ft``."""
    return {_module_name(p): p for pkg in PACKAGES for ext in ("*.py", "*.c") for p in (ROOT / pkg).rglob(ext)}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, package: str):
    """Every import statement outside ``if TYPE_CHECKING:`` blocks, with the names it imports."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield child, alias.name, None
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative import
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for alias in child.names:
                    yield child, base, alias.name
            stack.append(child)


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for _, base, attr in _imports(ast.parse(path.read_text()), package):
            target = f"{base}.{attr}" if attr and f"{base}.{attr}" in modules else base
            while target and target not in modules:
                target = target.rpartition(".")[0]  # ``import moe_ft.x.y`` of a name: its module
            if target and target != name:
                graph[name].add(target)
                graph[name].update(p for p in _ancestors(target) if not name.startswith(p + "."))
    return graph


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_no_import_cycle_in_moe_ft():
    graph = import_graph()
    cycles = strongly_connected(graph)
    detail = []
    for comp in cycles:
        members = set(comp)
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in members]
        detail.append("cycle among " + ", ".join(comp) + ":\n    " + "\n    ".join(edges))
    assert not cycles, "\n".join(detail)


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def _function_imports_without_reason(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    bad = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node, _, _ in _imports(func, ""):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            here = lines[node.lineno - 1]
            j = node.lineno - 2  # the comment may head a block of consecutive imports
            while j >= 0 and (not lines[j].strip() or lines[j].strip().startswith(("import ", "from "))):
                j -= 1
            above = lines[j] if j >= 0 else ""
            if not any(reason in here or (above.strip().startswith("#") and reason in above) for reason in REASONS):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {here.strip()}")
    return sorted(set(bad))


def test_imports_inside_functions_give_their_reason():
    bad = [line for root in CHECKED_FOR_REASONS for p in sorted(root.rglob("*.py"))
           for line in _function_imports_without_reason(p)]
    assert not bad, (f"{len(bad)} imports inside functions without a reason comment ({' / '.join(REASONS)}); "
                     "move them to the top of the module or say why they stay:\n" + "\n".join(bad))
