"""The shape of the tree: no import cycles, the core reaches extensions only through the registry, modules
and functions of a readable size, and no config key that the code never reads."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.config_reads import unread_keys
from tests.support.imports import (
    PACKAGES,
    REGISTRY,
    ROOT,
    find_cycle,
    import_graph,
    imported_names,
    modules,
    private_imports,
    unresolved_imports,
)
from tests.support.suite_rules import cross_test_imports, process_starts, suite_files

MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
LENGTH_REASON = "# long:"  # a function over the limit says why in a comment of this form near its top



def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)



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


# The entry points and the commands beside training: no layer below them imports them.
ENTRY_POINTS = ("trainer.train", "trainer.cli", "trainer.tools")
LAYERS = ("trainer.models", "trainer.parallel", "trainer.data", "trainer.checkpoint", "trainer.optim",
          "trainer.observability", "trainer.fault_tolerance", "trainer.config", "trainer.errors", "trainer.step",
          "trainer.setup", "trainer.callbacks", "trainer.metrics", "trainer.torch_compat")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_lower_layers_never_import_the_entry_points():
    """The layers (and the step, setup and callbacks the loop uses) import neither trainer.train, the
    console script nor the tools: those sit on top and call down (deferred imports counted too)."""
    graph = import_graph()
    offenders = sorted(f"{name} -> {dep}" for name, deps in graph.items() if _within(name, LAYERS)
                       for dep in deps if _within(dep, ENTRY_POINTS))
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
# table) and refuses any other value; tests/unit/test_torchtitan_compat.py sets each one and checks the refusal.
from trainer.compat import CONVERTER_MODULES, REFUSED  # noqa: E402

READ_BY_PARSER |= set(REFUSED)
# The module lists of the refused converters: trainer/compat.py reads each one (by name) into the refusal.
READ_BY_PARSER |= set(CONVERTER_MODULES.values())


def one_value_keys(keys) -> set[str]:
    """Keys whose type allows one value (``optimizer.name: Literal["AdamW"]``): the parser refuses any
    other, which is all such a key does until a second value exists."""
    import typing

    from trainer.config.keys import field_types

    return {k for k, (cls, f) in keys.items()
            if typing.get_origin(t := field_types(cls)[f.name]) is typing.Literal and len(typing.get_args(t)) == 1}


def code_paths() -> list[Path]:
    return [p for p in modules().values() if str(p.relative_to(ROOT)) not in CONFIG_MODULES]


def test_every_config_key_is_read_by_the_code():
    """Each key is read whole (``section.key``, tests/support/config_reads.py) somewhere outside the config
    modules (a key nothing reads is a promise the code does not keep)."""
    from trainer.config import leaf_keys

    keys = leaf_keys()
    unread = [k for k in unread_keys(keys, code_paths()) if k not in READ_BY_PARSER | one_value_keys(keys)]
    assert unread == []


def test_a_key_is_matched_whole(tmp_path):
    """A namesake in another section, or in code that is not handed the config, is no read."""
    from trainer.config import leaf_keys

    keys = {k: v for k, v in leaf_keys().items() if k in ("training.steps", "checkpoint.interval", "eval.limit")}
    code = tmp_path / "code.py"
    code.write_text("def f(config, args, cfg):\n    s = config.training\n    return s.steps, args.limit, cfg.interval\n")
    assert unread_keys(keys, [code]) == ["checkpoint.interval", "eval.limit"]
    code.write_text("def f(config):\n    for name in ('interval', 'x'):\n        getattr(config.checkpoint, name)\n")
    assert unread_keys(keys, [code]) == ["training.steps", "eval.limit"]


def test_suite_rules_see_what_they_forbid(tmp_path):
    root = tmp_path / "tests"
    files = {"unit/test_a.py": "import subprocess as sp\nfrom tests.unit import test_b\nsp.run(['true'])\n",
             "unit/test_b.py": "import os, torch.multiprocessing as mp\nfrom tests.support import helper\n"
                               "os.fork()\nmp.start_processes(f)\nos.path.join('a')\n",
             "distributed/test_c.py": "from concurrent.futures import ProcessPoolExecutor\nimport tests.e2e.test_d\n",
             "support/processes.py": "import subprocess\nsubprocess.Popen(['true'])\n", "support/helper.py": ""}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    paths = suite_files(root)
    assert process_starts(paths, allowed=root / "support" / "processes.py") == [
        "test_c.py:1: from concurrent.futures import ProcessPoolExecutor", "test_a.py:3: subprocess.run",
        "test_b.py:3: os.fork", "test_b.py:4: torch.multiprocessing.start_processes"]
    assert cross_test_imports(paths, root) == ["tests.distributed.test_c imports tests.e2e.test_d",
                                               "tests.unit.test_a imports tests.unit.test_b"]


def test_every_process_a_test_starts_goes_through_processes_py():
    """So that it dies with the session whatever ends it (tests/support/processes.py)."""
    assert process_starts(suite_files()) == []


def test_test_modules_never_import_each_other():
    """What two test modules share lives in tests/support/."""
    assert cross_test_imports(suite_files()) == []
