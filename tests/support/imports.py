"""The import graph of the project's packages, read from the source (ast): every import a module makes, at
module level, deferred inside functions or type-only, resolved; cycles, private names imported across
packages and imports that name nothing. tests/unit/test_architecture.py holds the tree to it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "torchtitan_ext", "tokenizer")
REGISTRY = "trainer.extensions"


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imported(name: str, path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every import a module makes: at module level, inside functions
    (deferred) and under ``if TYPE_CHECKING:`` (type-only) alike, since each is a dependency a reader and a
    type checker follow. Relative imports are resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(base, alias.name) for alias in node.names]
    return out


def imported_names(name: str, path: Path) -> set[str]:
    """Dotted names a module imports (see :func:`imported`)."""
    out = set()
    for module, member in imported(name, path):
        out.add(module)
        if member is not None:
            out.add(f"{module}.{member}")
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, path in mods.items():
        graph[name] = {o for d in imported_names(name, path) if (o := owner(d)) and o != name}
    # The registry loads the extension packages by name (importlib): an edge like any import.
    from trainer.extensions import EXTENSION_PACKAGES

    graph[REGISTRY] |= set(EXTENSION_PACKAGES)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_of(module: str, mods: dict[str, Path]) -> str:
    return module if mods[module].name == "__init__.py" else module.rpartition(".")[0]


def private_imports(mods: dict[str, Path], packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Imports of a private name (``_x``, a module or a member) of one of our packages from outside that
    package (a subpackage counts as outside its parent, and the parent as outside it)."""
    offenders = []
    for name, path in mods.items():
        mine = package_of(name, mods)
        for module, member in imported(name, path):
            if module.split(".")[0] not in packages:
                continue
            dotted = f"{module}.{member}" if member else module
            parts = dotted.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = ".".join(parts[:i])
                    owner_package = package_of(owner, mods) if owner in mods else owner
                    if owner_package != mine:
                        offenders.append(f"{name} imports {dotted}")
                    break
    return offenders


def defined_names(path: Path) -> set[str]:
    """Names a module binds at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        nodes = [node]
        if isinstance(node, (ast.If, ast.Try)):  # e.g. a version-dependent import
            nodes = [n for n in ast.walk(node) if isinstance(n, ast.stmt)]
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in n.names}
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    return names


def unresolved_imports(mods: dict[str, Path], packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Imports of our own modules (at module level, deferred inside functions or type-only) that name a
    module or a member that does not exist: found here, not when that line first runs."""
    missing = []
    for name, path in mods.items():
        for module, member in imported(name, path):
            if module.split(".")[0] not in packages:
                continue
            if module not in mods:
                missing.append(f"{name}: no module {module}")
            elif member is not None and f"{module}.{member}" not in mods and member not in defined_names(mods[module]):
                missing.append(f"{name}: {module} has no {member}")
    return missing


def attribute_chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None when the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]
