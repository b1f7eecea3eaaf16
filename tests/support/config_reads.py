"""Which config keys the code reads, read from the source (ast), matching whole keys (``section.key``).

A key counts as read when the code spells it whole in an attribute chain: ``config.training.steps``, also
through a local alias (``t = config.training`` or ``d, t = config.data, config.training``, then
``t.steps``), a parameter annotated with the section's class (``cfg: LRScheduler``, then
``cfg.decay_type``), or ``getattr`` with a constant name, or names looped over
(``for name in ("a", "b"): getattr(w, name)``). Code that is handed a section without a type
(``def __init__(self, cfg)``) cannot be followed that far: there, reading the key's own name in the package
that declares the section counts (``cfg.interval`` in trainer/checkpoint/ for ``checkpoint.interval``),
never a namesake elsewhere (``args.limit`` in an unrelated command for ``eval.limit``).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

Chain = tuple[str, ...]


def _annotation_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("|")[0].strip().rpartition(".")[2]
    if isinstance(node, ast.BinOp):  # Section | None
        return _annotation_name(node.left)
    return None


def _loop_constants(scope) -> dict[str, list[str]]:
    """Loop variables that run over a literal list of strings: ``for name in ("a", "b")``."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(scope):
        if (isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name)
                and isinstance(node.iter, (ast.Tuple, ast.List))
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts)):
            out.setdefault(node.target.id, []).extend(e.value for e in node.iter.elts)
    return out


def _chains(node, aliases: dict[str, set[Chain]], loops: dict[str, list[str]]) -> list[Chain]:
    """Every dotted path ``node`` (an attribute chain, maybe through getattr) can stand for."""
    tails: list[list[str]] = [[]]
    while True:
        if isinstance(node, ast.Attribute):
            tails = [[node.attr, *t] for t in tails]
            node = node.value
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
              and len(node.args) > 1):
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                names = [name.value]
            elif isinstance(name, ast.Name) and name.id in loops:
                names = loops[name.id]
            else:
                return []
            tails = [[n, *t] for n in names for t in tails]
            node = node.args[0]
        else:
            break
    bases = aliases.get(node.id, {(node.id,)}) if isinstance(node, ast.Name) else {()}
    return [(*b, *t) for b in bases for t in tails]


def _scope_chains(scope, section_classes: dict[str, set[Chain]], module_aliases: dict[str, set[Chain]]) -> set[Chain]:
    aliases = {k: set(v) for k, v in module_aliases.items()}
    if not isinstance(scope, ast.Module):
        args = scope.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            name = _annotation_name(a.annotation) if a.annotation is not None else None
            if name in section_classes:
                aliases[a.arg] = set(section_classes[name])
    loops = _loop_constants(scope)
    nodes = list(ast.walk(scope))
    assigns = []
    for n in nodes:
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            target, value = n.targets[0], n.value
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                assigns += list(zip(target.elts, value.elts))
            else:
                assigns.append((target, value))
    for _ in range(3):  # aliases of aliases
        for target, value in assigns:
            if isinstance(target, ast.Name) and isinstance(value, (ast.Attribute, ast.Name)):
                found = {c for c in _chains(value, aliases, loops) if c and c != (target.id,)}
                if found:
                    aliases.setdefault(target.id, set()).update(found)
    out: set[Chain] = set()
    for n in nodes:
        if isinstance(n, (ast.Attribute, ast.Call)):
            out.update(_chains(n, aliases, loops))
    return out


def _attribute_names(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


def _contains(chain: Chain, key: Chain) -> bool:
    n = len(key)
    return any(chain[i:i + n] == key for i in range(len(chain) - n + 1))


def unread_keys(keys: dict[str, tuple[type, object]], paths: list[Path]) -> list[str]:
    """The keys (dotted, with their section's class, as ``trainer.config.leaf_keys`` gives them) that no
    module in ``paths`` reads, by the rules above."""
    section_classes: dict[str, set[Chain]] = {}
    for key, (cls, _field) in keys.items():
        section_classes.setdefault(cls.__name__, set()).add(tuple(key.split(".")[:-1]))
    chains: set[Chain] = set()
    names_by_folder: dict[Path, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        module_aliases: dict[str, set[Chain]] = {}
        scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        for scope in [tree, *scopes]:
            chains |= _scope_chains(scope, section_classes, module_aliases)
        names_by_folder.setdefault(path.resolve().parent, set()).update(_attribute_names(tree))
    unread = []
    for key, (cls, _field) in keys.items():
        parts = tuple(key.split("."))
        if any(_contains(c, parts) for c in chains):
            continue
        home = Path(inspect.getsourcefile(cls)).resolve().parent
        if any(parts[-1] in names for folder, names in names_by_folder.items() if folder.is_relative_to(home)):
            continue
        unread.append(key)
    return unread
