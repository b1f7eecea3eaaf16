"""torch's private APIs are named only in trainer/torch_compat.py, and each of its functions runs on the
installed torch (so a torch upgrade that breaks one fails here, not in the middle of a run).

"Private" means: a module path under torch with a segment that starts with ``_`` (``torch._C``,
``torch.utils._pytree``), a private name imported from torch, an attribute chain from torch through such a
segment, and, on any object, a private attribute that none of our own modules defines (``schedule._loss_fn``,
``getattr(pg, "_x")``): code cannot tell a torch object by its name, but a private name we do not define is
another library's, and here that means torch's.
"""

from __future__ import annotations

import ast
import gc
import json
import re
from datetime import timedelta
from pathlib import Path

import pytest

from tests.support import children
from tests.support.imports import ROOT, attribute_chain, modules
from tests.support.processes import free_port

COMPAT_MODULES = {"trainer/torch_compat.py"}

# Underscored names that are public by documentation: os._exit, sys._current_frames, and a namedtuple's API.
DOCUMENTED_UNDERSCORE = {"_exit", "_current_frames", "_fields", "_asdict", "_replace", "_make"}

# torch.ops.<namespace>.<op> names an operator by its registered schema name (aten::_scaled_dot_product_...,
# _c10d_functional::reduce_scatter_tensor): an operator, not a Python module or attribute of torch's (ATen's
# leading underscore marks an op users do not call directly). The activation-checkpointing save list names
# them as torchtitan's does; all five are registered in 2.11.0-2.14.1 (parallelize imports them at once).
OP_HANDLES = "torch.ops."

PRIVATE_MODULE_STRING = re.compile(r"torch(\.\w+)*\._\w+(\.\w+)*")  # "torch.utils._pytree" as a string


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names(paths) -> set[str]:
    """Names our code defines, so that reading them is not reading another library's private state: its
    modules, functions, classes, module- and class-level names, and attributes set on ``self``/``cls``."""
    names = set()
    for path in paths:
        names.add(path.stem)
        tree = ast.parse(path.read_text())
        scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for scope in scopes:
            for stmt in scope.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                names |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return names


def torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch module or object it is bound to (``dist`` -> ``torch.distributed``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                (node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def private_torch_uses(source: str, own: set[str]) -> list[tuple[int, str]]:
    """(line, private name) for each private torch name ``source`` uses (see the module docstring)."""
    tree = ast.parse(source)
    aliases = torch_aliases(tree)
    found = set()

    def private_path(path: str) -> str | None:  # up to its last private segment
        parts = path.split(".")
        last = max((i for i, part in enumerate(parts) if i and is_private(part)), default=None)
        return None if last is None else ".".join(parts[: last + 1])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.") and (hit := private_path(a.name)):
                    found.add((node.lineno, hit))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                (node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                if hit := private_path(f"{node.module}.{a.name}"):
                    found.add((node.lineno, hit))
        elif isinstance(node, ast.Attribute):
            chain = attribute_chain(node)
            if chain and chain[0] in aliases:
                path = ".".join([aliases[chain[0]]] + chain[1:])
                if not path.startswith(OP_HANDLES) and (hit := private_path(path)):
                    found.add((node.lineno, hit))
            elif is_private(node.attr) and node.attr not in own and node.attr not in DOCUMENTED_UNDERSCORE:
                found.add((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
            chain = attribute_chain(node.args[0])
            from_torch = bool(chain and chain[0] in aliases)
            if is_private(name) and (from_torch or (name not in own and name not in DOCUMENTED_UNDERSCORE)):
                found.add((node.lineno, name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                PRIVATE_MODULE_STRING.fullmatch(node.value):
            found.add((node.lineno, node.value))
    # torch._C._distributed_c10d is one use, not two: keep the longest name found on each line per prefix
    return sorted((line, name) for line, name in found
                  if not any(l2 == line and n2 != name and n2.startswith(name + ".") for l2, n2 in found))


def tree_uses(mods: dict[str, Path], own: set[str] | None = None) -> list[str]:
    """Private torch uses outside the compatibility module (``own``: the names our code defines, when known)."""
    own = own_names(mods.values()) if own is None else own
    offenders = []
    for name, path in mods.items():
        rel = name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
        if rel in COMPAT_MODULES:
            continue
        offenders += [f"{rel}:{line}: {name}" for line, name in private_torch_uses(path.read_text(), own)]
    return offenders



FLAGGED = {
    "import torch._dynamo\n": "torch._dynamo",
    "import torch.utils._pytree as pytree\n": "torch.utils._pytree",
    "from torch.utils._pytree import tree_map\n": "torch.utils._pytree",
    "from torch.distributed.distributed_c10d import _world\n": "torch.distributed.distributed_c10d._world",
    "from torch import _utils\n": "torch._utils",
    "import torch\ntorch.cuda.memory._dump_snapshot('x')\n": "torch.cuda.memory._dump_snapshot",
    "import torch\nc10d = torch._C._distributed_c10d\n": "torch._C._distributed_c10d",
    "import torch.distributed as dist\ndist.distributed_c10d._set_pg_timeout(1)\n":
        "torch.distributed.distributed_c10d._set_pg_timeout",
    "from torch.distributed import distributed_c10d as c10d\nc10d._world.pg_map\n":
        "torch.distributed.distributed_c10d._world",
    "import torch\ntorch._inductor.config.x = 1\n": "torch._inductor",
    "import torch\ngetattr(torch._C, 'x')\n": "torch._C",
    "import torch.distributed as dist\ngetattr(dist.group, '_mine')\n": "_mine",  # ours elsewhere, torch's here
    "def f(schedule):\n    return schedule._loss_fn\n": "_loss_fn",
    "def f(schedule):\n    schedule._loss_fn = None\n": "_loss_fn",
    "def f(opt):\n    return getattr(opt, '_step_supports_amp_scaling', False)\n": "_step_supports_amp_scaling",
    "NOISE = ('torchao', 'torch.utils._pytree')\n": "torch.utils._pytree",
}
NOT_FLAGGED = [
    "import torch\nops = {torch.ops.aten._scaled_dot_product_flash_attention.default}\n",
    "import torch\nops = {torch.ops._c10d_functional.reduce_scatter_tensor.default}\n",
    "import torch\nv = torch.__version__\n",
    "import os, sys\nos._exit(1)\nsys._current_frames()\n",
    "class A:\n    def f(self, other):\n        return other._mine\n",  # defined by our code (own)
    "def f(x):\n    return getattr(x, '_mine', None)\n",
    "import torch.distributed as dist\ndist.group.WORLD.set_timeout(1)\n",
    "'''Mentions torch.utils._pytree in a sentence.'''\n",
]


@pytest.mark.parametrize("source", list(FLAGGED))
def test_a_private_torch_use_is_found(source):
    assert [name for _, name in private_torch_uses(source, own={"_mine"})] == [FLAGGED[source]]


@pytest.mark.parametrize("source", NOT_FLAGGED)
def test_public_names_and_our_own_are_not_flagged(source):
    assert private_torch_uses(source, own={"_mine"}) == []


def test_own_names_are_what_our_code_defines(tmp_path):
    """A private name is ours when our code defines it; setting another object's attribute does not."""
    path = tmp_path / "m.py"
    path.write_text("class A:\n    _k = 1\n\n    def __init__(self):\n        self._mine = 1\n\n\n"
                    "def _f(schedule):\n    schedule._loss_fn = None\n")
    names = own_names([path])
    assert {"m", "A", "_k", "_mine", "_f"} <= names and "_loss_fn" not in names


def test_private_torch_names_only_in_the_compat_module(tmp_path):
    """None in the tree outside trainer/torch_compat.py; and the same check over the tree plus one module with
    a private torch use reports that use only (the check can fail)."""
    added = tmp_path / "new_module.py"
    added.write_text("import torch\n\n\ndef f():\n    torch._dynamo.reset()\n")
    tree = modules()
    own = own_names(tree.values())
    offenders = tree_uses(tree, own)
    assert not offenders, ("private torch names outside trainer/torch_compat.py (put each behind a function "
                           "there, saying why and which versions were checked): " + "; ".join(offenders))
    offenders = tree_uses({"trainer.tools.new_module": added}, own | own_names([added]))
    assert offenders == ["trainer/tools/new_module.py:5: torch._dynamo"]


def test_the_compat_module_has_no_import_time_effects():
    """Functions, constants and type-only imports: importing it imports no torch and changes nothing."""
    tree = ast.parse((ROOT / "trainer" / "torch_compat.py").read_text())
    for stmt in tree.body:
        if isinstance(stmt, ast.If):
            assert ast.unparse(stmt.test) == "TYPE_CHECKING", ast.unparse(stmt)
            continue
        assert isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.ImportFrom, ast.Import, ast.Assign, ast.Expr)), \
            ast.unparse(stmt)[:80]
        if isinstance(stmt, ast.ClassDef):  # a plain class of methods: defining it runs nothing
            assert not stmt.bases and not stmt.decorator_list, ast.unparse(stmt)[:80]
            assert all(isinstance(s, (ast.FunctionDef, ast.Expr)) for s in stmt.body), ast.unparse(stmt)[:80]
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            assert not ast.unparse(stmt).split()[1].startswith("torch"), ast.unparse(stmt)
        if isinstance(stmt, ast.Assign):
            assert isinstance(stmt.value, ast.Constant), ast.unparse(stmt)
        if isinstance(stmt, ast.Expr):
            assert isinstance(stmt.value, ast.Constant), ast.unparse(stmt)  # the docstring


def test_every_compat_function_is_used():
    import trainer.torch_compat as compat

    names = {n for n, v in vars(compat).items()
             if callable(v) and getattr(v, "__module__", "") == compat.__name__ and not n.startswith("_")}
    used = set()
    for path in modules().values():
        if str(path.relative_to(ROOT)) in COMPAT_MODULES:
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Name):
                used.add(n.id)
            elif isinstance(n, ast.ImportFrom):
                used |= {a.name for a in n.names}
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "torch_compat":
                used.add(n.attr)  # torch_compat.name(...)
    assert names and not names - used, sorted(names - used)


# --------------------------------------------------------------------------------------------------
# Each function on the installed torch
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group(monkeypatch):
    """A one-rank gloo process group in this process, with the flight recorder on."""
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_process_groups_and_the_flight_recorder(one_rank_group):
    import pickle

    import torch
    import torch.distributed as dist

    from trainer.torch_compat import flight_recorder_dump, process_groups

    extra = dist.new_group([0])
    assert process_groups() == [one_rank_group, extra]
    dist.all_reduce(torch.ones(1))
    entries = json.loads(flight_recorder_dump("generic", as_json=True)())["entries"]
    assert entries[-1]["profiling_name"] == "gloo:all_reduce"
    assert entries[-1]["process_group"][0] == one_rank_group.group_name
    assert pickle.loads(flight_recorder_dump("generic")())["entries"]
    if torch.version.cuda is None:  # NCCL's recorder comes with CUDA builds only
        assert flight_recorder_dump("nccl") is None and flight_recorder_dump("nccl", as_json=True) is None


def test_process_group_timeout_is_public(one_rank_group):
    """What trainer/setup.py uses instead of the private _set_pg_timeout (gloo: the same effect)."""
    one_rank_group.set_timeout(timedelta(seconds=5))


def test_profiler_step(tmp_path):
    import torch
    from torch.profiler import ProfilerAction, schedule

    from trainer.torch_compat import set_profiler_step

    every_4th = schedule(wait=1, warmup=1, active=2)  # steps 4k+2, 4k+3 recorded; 0 waits, 7 saves
    traces = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=every_4th,
                                  on_trace_ready=lambda p: traces.append(p.step_num))
    set_profiler_step(prof, 7, every_4th(7))
    with prof:
        for _ in range(4):
            torch.ones(2).sum()
            prof.step()
    assert prof.step_num == 11 and traces == [8, 11]  # the window of step 7, then the one cut short at 11
    # The profiler's own record of where the schedule stands agrees: stopping leaves step 7's action
    # (torch >= 2.13 resets it from a private copy, which would otherwise still hold step 0's).
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=every_4th)
    set_profiler_step(prof, 7, every_4th(7))
    with prof:
        pass
    assert prof.current_action == ProfilerAction.RECORD_AND_SAVE


def test_cuda_memory_functions():
    import torch

    from trainer.torch_compat import dump_cuda_memory_snapshot, start_cuda_memory_history, stop_cuda_memory_history

    if not torch.cuda.is_available():
        pytest.skip("CUDA memory history needs a GPU")
    start_cuda_memory_history(100)
    stop_cuda_memory_history()
    dump_cuda_memory_snapshot("/dev/null")


def test_tensor_cycle_warnings():
    import torch

    from trainer.torch_compat import stop_cuda_memory_history, warn_on_tensor_cycles

    if not torch.cuda.is_available():
        pytest.skip("torch reports cycles holding CUDA tensors only")
    before = list(gc.callbacks)
    try:
        warn_on_tensor_cycles()
        assert len(gc.callbacks) == len(before) + 1
    finally:
        gc.callbacks[:] = before
        stop_cuda_memory_history()


def test_gc_debug_on_cpu_says_what_it_does_not_do(tmp_path, monkeypatch, caplog):
    """training.gc_debug on a CPU run trains, collecting every step, and says that no cycle is reported
    (torch's cycle reports need CUDA; they ended such a run with a traceback before)."""
    import torch

    from tests.support.launch import train_in_process

    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    rc, out = train_in_process(tmp_path, "--training.gc_debug", "--training.steps", "2", monkeypatch=monkeypatch)
    assert rc == 0, out[-3000:]
    assert "reported only when they hold CUDA tensors" in out + caplog.text, out[-3000:]


def test_mesh_and_shards(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from trainer.torch_compat import flatten_mesh, local_shape_and_offset

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    flat = flatten_mesh(mesh["a", "b"], "ab")
    assert flat.mesh_dim_names == ("ab",) and flat.size() == 1
    assert local_shape_and_offset((4, 6), flat, [Shard(1)]) == ((4, 6), (0, 0))


def test_async_tensor_parallel_flag(monkeypatch):
    import torch._inductor.config as inductor

    from trainer.torch_compat import enable_async_tensor_parallel

    monkeypatch.setattr(inductor, "_micro_pipeline_tp", False)  # restored after the test
    enable_async_tensor_parallel()
    assert inductor._micro_pipeline_tp is True


def _sequence_number_stderr(_rank) -> tuple[str, str]:
    """(stderr of a gloo backend's _set_sequence_number_for_group after quiet_torchft_sequence_numbers, then
    of torch's own method), in a fresh interpreter: torch's C++ warning is printed once per process."""
    import os
    import tempfile

    from torch._C import _distributed_c10d as c10d

    from trainer.torch_compat import quiet_torchft_sequence_numbers

    backend = c10d.ProcessGroupGloo(c10d.HashStore(), 0, 1, timedelta(seconds=10))

    def stderr_of_the_call() -> str:
        with tempfile.TemporaryFile() as err:
            saved = os.dup(2)
            os.dup2(err.fileno(), 2)
            try:
                backend._set_sequence_number_for_group()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            err.seek(0)
            return err.read().decode()

    original = c10d.Backend._set_sequence_number_for_group
    quiet_torchft_sequence_numbers()
    quiet = stderr_of_the_call()
    c10d.Backend._set_sequence_number_for_group = original
    return quiet, stderr_of_the_call()


def test_torchft_sequence_number_call_is_silent_where_torch_made_it_a_no_op():
    """torchft calls it at each replica group's (re)configuration; torch 2.14 made it a no-op that warns on
    stderr, which put a line of torch's on every group's console. Replaced, it says nothing; torch's own
    warns on 2.14 and later (so the check can fail) and is left alone before."""
    import torch

    [(quiet, own)] = children.call(_sequence_number_stderr)
    assert "setSequenceNumberForGroup" not in quiet, quiet
    new_torch = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
    assert ("setSequenceNumberForGroup" in own) == new_torch, own


def test_checkpoint_wrapper_keeps_state_dict_keys():
    import torch

    from trainer.torch_compat import checkpoint_wrapper

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    keys = list(block.state_dict())
    x = torch.randn(3, 4)
    expected = block(x)
    wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
    assert list(wrapped.state_dict()) == keys
    out = wrapped(x)
    out.sum().backward()
    assert torch.equal(out, expected) and block[0].weight.grad is not None


def test_pipeline_eval_without_its_loss(one_rank_group):
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from trainer.torch_compat import pipeline_loss_disabled

    calls = []

    def loss_fn(output, target):
        calls.append(target)
        return output.sum()

    stage = PipelineStage(torch.nn.Linear(4, 4), 0, 1, torch.device("cpu"), group=one_rank_group)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    x = torch.randn(4, 4)
    with pipeline_loss_disabled(schedule):
        out = schedule.eval(x)
    assert out.shape == (4, 4) and calls == []
    schedule.step(x, target=torch.zeros(4, 4))
    assert calls  # the loss is back for training's steps


def test_cpu_as_the_device_type(monkeypatch):
    import torch._utils

    from trainer.torch_compat import report_cpu_as_the_device_type

    monkeypatch.setattr(torch._utils, "_get_available_device_type", torch._utils._get_available_device_type)
    report_cpu_as_the_device_type()
    assert torch._utils._get_available_device_type() == "cpu"


def test_pytree_logger_is_torchs_module():
    import importlib
    import logging

    from trainer.torch_compat import PYTREE_LOGGER

    module = importlib.import_module(PYTREE_LOGGER)
    assert getattr(module, "log", logging.getLogger(PYTREE_LOGGER)).name == PYTREE_LOGGER


def test_grouped_mm_and_its_operator():
    """Row blocks of x times their group's matrix, and the operator a dispatch mode sees for it."""
    import torch

    from trainer.torch_compat import grouped_mm, grouped_mm_op

    mm = grouped_mm()
    assert mm is not None  # every torch this project claims has it
    x, w = torch.randn(10, 16), torch.randn(3, 16, 8)
    got = mm(x, w, offs=torch.tensor([3, 3, 10], dtype=torch.int32))
    torch.testing.assert_close(got, torch.cat([x[:3] @ w[0], x[3:] @ w[2]]))
    seen = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    with Ops():
        mm(x, w, offs=torch.tensor([3, 3, 10], dtype=torch.int32))
    assert grouped_mm_op() in seen
