"""The shape of the tree: no import cycles, the core reaches extensions only through the registry, modules
and functions of a readable size, and no config key that the code never reads."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "torchtitan_ext", "tokenizer")
REGISTRY = "trainer.extensions"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
LENGTH_REASON = "# long:"  # a function over the limit says why in a comment of this form near its top


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def runtime_nodes(node: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never imported at run time)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield other
                yield from runtime_nodes(other)
            continue
        yield child
        yield from runtime_nodes(child)


def imported_names(name: str, path: Path) -> set[str]:
    """Dotted names a module imports at run time (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
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


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_reaches_extensions_only_through_the_registry():
    offenders = []
    for name, path in modules().items():
        if not name.startswith("trainer") or name == REGISTRY:
            continue
        if any(d == "torchtitan_ext" or d.startswith("torchtitan_ext.") for d in imported_names(name, path)):
            offenders.append(name)
        elif "torchtitan_ext" in path.read_text():
            offenders.append(f"{name} (names torchtitan_ext)")
    assert not offenders, offenders


def test_module_and_function_sizes():
    too_long = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                head = "\n".join(lines[node.lineno - 1: node.lineno + 8])
                if length > MAX_FUNCTION_LINES and LENGTH_REASON not in head:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert not too_long, too_long


# Modules that declare, parse, document or validate config keys: a key read only here does nothing.
CONFIG_MODULES = {"trainer/config/sections.py", "trainer/config/keys.py", "trainer/config/parse.py",
                  "trainer/config/reference.py", "trainer/config/validate.py", "trainer/data/config.py",
                  "torchtitan_ext/stability/config.py"}
# Read by the config machinery itself, by design.
READ_BY_PARSER = {"job.config_file"}
# torchtitan keys accepted only at their default: trainer/compat.py reads each one (by name, from its
# table) and refuses any other value; tests/unit/test_torchtitan_compat.py sets each one and checks the refusal.
from trainer.compat import REFUSED  # noqa: E402

READ_BY_PARSER |= set(REFUSED)


def attribute_reads(exclude: set[str]) -> set[str]:
    names = set()
    for path in modules().values():
        if str(path.relative_to(ROOT)) in exclude:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return names


def unread_keys(keys, names: set[str]) -> list[str]:
    return [k for k in keys if k not in READ_BY_PARSER and k.rsplit(".", 1)[1] not in names]


def test_every_config_key_is_read_by_the_code():
    """Each key's name is read as an attribute somewhere outside the config modules (a key nothing reads
    is a promise the code does not keep)."""
    from trainer.config import leaf_keys

    names = attribute_reads(CONFIG_MODULES)
    assert unread_keys(["compile.no_such_key_anywhere"], names) == ["compile.no_such_key_anywhere"]
    assert unread_keys(leaf_keys(), names) == []

