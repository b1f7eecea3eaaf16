"""Rules the test suite keeps, read from its source (ast): every process a test starts goes through
tests/support/processes.py (which makes it die with the session), and test modules never import each other
(what two of them share lives in tests/support/). tests/unit/test_architecture.py holds the suite to them."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.imports import attribute_chain

TESTS = Path(__file__).resolve().parents[1]
PROCESSES = TESTS / "support" / "processes.py"
TIERS = ("tests.unit", "tests.distributed", "tests.e2e")

# What starts a process, by module: a call of one of these, or importing one by name.
STARTERS = {
    "subprocess": {"Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnl", "spawnle", "spawnlp",
           "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "execv", "execve", "execl", "execle",
           "execlp", "execlpe", "execvp", "execvpe"},
    "multiprocessing": {"Process", "Pool", "get_context", "set_start_method"},
    "torch.multiprocessing": {"Process", "Pool", "get_context", "set_start_method", "spawn", "start_processes"},
    "concurrent.futures": {"ProcessPoolExecutor"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "pty": {"spawn", "fork"},
}


def suite_files(root: Path = TESTS) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def process_starts(paths: list[Path], allowed: Path = PROCESSES) -> list[str]:
    """``file:line: what`` for each place outside ``allowed`` that starts a process itself."""
    found = []
    for path in paths:
        if path == allowed:
            continue
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # local name -> module, for `import subprocess as sp`
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in STARTERS:
                        aliases[a.asname or a.name] = a.name
                    elif a.asname is None and a.name.split(".")[0] in STARTERS:
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module in STARTERS:
                found += [f"{path.name}:{node.lineno}: from {node.module} import {a.name}"
                          for a in node.names if a.name in STARTERS[node.module]]
        for node in ast.walk(tree):  # calls only: `subprocess.Popen` as a type annotation starts nothing
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr in _all_starters():
                module = _dotted(func.value, aliases)
                if module in STARTERS and func.attr in STARTERS[module]:
                    found.append(f"{path.name}:{node.lineno}: {module}.{func.attr}")
    return found


def _all_starters() -> set[str]:
    return set().union(*STARTERS.values())


def _dotted(node, aliases: dict[str, str]) -> str | None:
    chain = attribute_chain(node)
    return None if chain is None else ".".join([aliases.get(chain[0], chain[0]), *chain[1:]])


def cross_test_imports(paths: list[Path], root: Path = TESTS) -> list[str]:
    """``module imports other`` for each test module (any module under a tier's folder) that imports another
    test module."""
    tiers = tuple(".".join([root.name, *t.split(".")[1:]]) for t in TIERS)
    found = []
    for path in paths:
        name = _module_name(path, root)
        if not name.startswith(tiers):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for target in targets:
                if target.startswith(tiers) and target not in tiers and not target.startswith(name):
                    found.append(f"{name} imports {target}")
                    break
    return sorted(set(found))
