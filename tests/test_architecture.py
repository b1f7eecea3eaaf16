"""The shape of the tree: no import cycles, the core reaches extensions only through the registry, modules
and functions of a readable size, and no config key that the code never reads."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


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


def test_private_imports_are_found(tmp_path):
    files = {"a/__init__.py": "from a import _mine\n", "a/x.py": "from b.y import _hidden\nfrom a.z import _near\n",
             "a/z.py": "", "b/__init__.py": "", "b/y.py": "from b._impl import f\n", "b/_impl.py": ""}
    mods = {}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
        mods[rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")] = tmp_path / rel
    assert private_imports(mods, packages=("a", "b")) == ["a.x imports b.y._hidden"]


def test_no_private_name_imported_across_packages():
    offenders = private_imports(modules())
    assert not offenders, offenders


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


def test_unresolved_imports_are_found(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "__init__.py").write_text("X = 1\n")
    (tmp_path / "a" / "m.py").write_text("def f():\n    from a import X, Y\n    import a.gone\n")
    mods = {"a": tmp_path / "a" / "__init__.py", "a.m": tmp_path / "a" / "m.py"}
    assert unresolved_imports(mods, packages=("a",)) == ["a.m: a has no Y", "a.m: no module a.gone"]


def test_every_import_of_our_modules_resolves():
    missing = unresolved_imports(modules())
    assert not missing, missing


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
# (trainer/models/config.py and trainer/parallel/config.py are not listed: besides the [model] and
# parallelism sections they hold what the runtime builds from them, the model arguments and the layout.)
CONFIG_MODULES = {"trainer/config/sections.py", "trainer/config/keys.py", "trainer/config/parse.py",
                  "trainer/config/reference.py", "trainer/config/validate.py", "trainer/config/rules.py",
                  "trainer/config/torchtitan.py", "trainer/data/config.py",
                  "trainer/optim/config.py", "trainer/checkpoint/config.py",
                  "trainer/observability/config.py", "torchtitan_ext/config.py", "torchtitan_ext/stability/config.py",
                  "torchtitan_ext/evaluation/config.py"}
# Read by the config machinery itself, by design.
READ_BY_PARSER = {"job.config_file"}
# torchtitan keys accepted only at their default: trainer/compat.py reads each one (by name, from its
# table) and refuses any other value; tests/test_torchtitan_compat.py sets each one and checks the refusal.
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

