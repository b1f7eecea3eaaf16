"""Process-wide state a test (or one run of ``trainer.train.main`` in a shared process) may change: take a
snapshot, name what differs from it, put it back.

tests/conftest.py snapshots before each test (and each test module) and fails the one that leaves
something changed, after restoring it, so a test's outcome cannot depend on which tests ran before it.
tests/distributed/worker.py does the same around each of the runs it trains in one process.

Two kinds of change are not failures. What a command's ``main`` sets up for the process it runs in
(console logging, the flight recorder's variables, determinism flags: :data:`ENTRY_POINT_SETTINGS`) is put
back after a test without failing it, since tests call mains in-process on purpose; :func:`entry_point`
puts it back right after the call. What a library sets once per process and keeps (Inductor's default
cache folder, the DataLoader's SIGCHLD handler) is left alone.

What is compared: every signal's handler (the Python one and the one the kernel holds, which
``faulthandler.register`` changes without Python seeing it) and the blocked-signal mask; ``os.environ`` and
the working directory; ``sys.excepthook``, ``threading.excepthook`` (unless pytest's own),
``warnings.showwarning``, faulthandler, automatic GC; the state of every logger (level, handlers other than
pytest's, propagation); with torch imported: deterministic algorithms, the cuDNN/TF32 flags, the default
dtype and device, the thread count, grad and anomaly modes, the default process group, and every value of
torch's config modules that are loaded (serialization, where the checkpoint saver's zip-CRC switch lives,
Inductor and Dynamo).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable

# torch's config modules, read by name so that a test which never loads one does not load it here.
TORCH_CONFIG_MODULES = ("torch.utils.serialization.config", "torch._inductor.config", "torch._dynamo.config")

_UNSET = object()  # an environment variable or a config value that did not exist
# Set by pytest itself for each phase of a test.
IGNORED_ENV = {"PYTEST_CURRENT_TEST"}


@dataclass(frozen=True)
class Entry:
    """One value of the process state and how to put it back."""

    value: Any
    restore: Callable[[Any], None] | None = None


Snapshot = dict[str, Entry]


# -------------------------------------------------------------------------------------------------
# Signals
# -------------------------------------------------------------------------------------------------

class _Sigaction(ctypes.Structure):
    # glibc's struct sigaction starts with the handler; the rest (mask, flags, restorer) is not read.
    _fields_ = [("handler", ctypes.c_void_p), ("rest", ctypes.c_byte * 256)]


def _kernel_handlers() -> Callable[[int], int | None]:
    """The handler address the kernel holds for a signal (Linux/glibc), or None where it cannot be read."""
    if not sys.platform.startswith("linux"):
        return lambda signum: None
    try:
        sigaction = ctypes.CDLL(None, use_errno=True).sigaction
    except (OSError, AttributeError):
        return lambda signum: None

    def read(signum: int) -> int | None:
        action = _Sigaction()
        return action.handler or 0 if sigaction(signum, None, ctypes.byref(action)) == 0 else None

    return read


_kernel_handler = _kernel_handlers()
_SIGNALS = sorted(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _restore_handler(signum: int, value: tuple) -> None:
    handler, kernel = value
    if _kernel_handler(signum) != kernel and hasattr(faulthandler, "unregister"):
        faulthandler.unregister(signum)  # puts back what was there before its register()
    # None: a handler not installed from Python, which Python cannot put back.
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signum, handler)


def _signals(snap: Snapshot) -> None:
    for signum in _SIGNALS:
        handler = signal.getsignal(signum)
        snap[f"signal handler {_signal_name(signum)}"] = Entry(
            (handler, _kernel_handler(signum)), lambda value, s=signum: _restore_handler(s, value))
    if hasattr(signal, "pthread_sigmask"):
        snap["blocked signals"] = Entry(frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                                        lambda value: signal.pthread_sigmask(signal.SIG_SETMASK, value))


# -------------------------------------------------------------------------------------------------
# The interpreter: environment, hooks, logging
# -------------------------------------------------------------------------------------------------

def _torch_default_inductor_cache(value: str) -> bool:
    """Inductor sets TORCHINDUCTOR_CACHE_DIR to its default the first time it locates its cache, once per
    process: not the test's doing (any other value is)."""
    import getpass
    import tempfile

    try:
        return value == os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
    except Exception:
        return False


def _set_env(name: str, value) -> None:
    if value is _UNSET:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _pytest_hook(hook) -> bool:
    """pytest swaps some hooks around each phase of a test (setup, call, teardown): not the test's doing."""
    return type(hook).__module__.startswith("_pytest") or getattr(hook, "__module__", "").startswith("_pytest")


def _managed_handler(handler) -> bool:
    """A handler that pytest (per phase of a test) or torch's logging (its lazy trace handler, replaced on
    first use) adds and removes by itself."""
    return _pytest_hook(handler) or type(handler).__module__.startswith("torch._logging")


def _interpreter(snap: Snapshot) -> None:
    for name, value in os.environ.items():
        if name in IGNORED_ENV:
            continue
        snap[f"environment variable {name}"] = Entry(value, lambda v, n=name: _set_env(n, v))
    snap["working directory"] = Entry(os.getcwd(), os.chdir)
    snap["sys.excepthook"] = Entry(sys.excepthook, lambda v: setattr(sys, "excepthook", v))
    if not _pytest_hook(threading.excepthook):
        snap["threading.excepthook"] = Entry(threading.excepthook, lambda v: setattr(threading, "excepthook", v))
    snap["warnings.showwarning"] = Entry(warnings.showwarning, lambda v: setattr(warnings, "showwarning", v))
    snap["faulthandler enabled"] = Entry(faulthandler.is_enabled(),
                                         lambda v: faulthandler.enable() if v else faulthandler.disable())
    snap["automatic garbage collection"] = Entry(gc.isenabled(), lambda v: gc.enable() if v else gc.disable())
    snap["logging.disable level"] = Entry(logging.root.manager.disable, logging.disable)


_DEFAULT_LOGGER = (logging.NOTSET, (), True, False)
# A logger that appears during a test is compared only if it is one of ours: libraries set up their own
# loggers when first imported, which is not the test's doing.
PROJECT_LOGGERS = ("trainer", "torchtitan_ext", "tokenizer", "tests")


def _ours(logger_entry_name: str) -> bool:
    name = logger_entry_name.removeprefix("logger ").strip("'\"")
    return any(name == p or name.startswith(p + ".") for p in PROJECT_LOGGERS)


def _logger_state(logger: logging.Logger) -> tuple:
    handlers = tuple(h for h in logger.handlers if not _managed_handler(h))
    return logger.level, handlers, logger.propagate, logger.disabled


def _restore_logger(logger: logging.Logger, state: tuple) -> None:
    level, handlers, propagate, disabled = state
    ours = [h for h in logger.handlers if _managed_handler(h)]  # pytest's and torch's own stay where they are
    logger.handlers[:] = [*handlers, *ours]
    logger.setLevel(level)
    logger.propagate = propagate
    logger.disabled = disabled


def _loggers(snap: Snapshot) -> None:
    loggers = [logging.root, *(lg for lg in list(logging.root.manager.loggerDict.values())
                               if isinstance(lg, logging.Logger))]
    for logger in loggers:
        state = _logger_state(logger)
        snap[f"logger {logger.name!r}"] = Entry(state, lambda v, lg=logger: _restore_logger(lg, v))


# -------------------------------------------------------------------------------------------------
# torch
# -------------------------------------------------------------------------------------------------

def _torch(snap: Snapshot) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_default_dtype"):  # not loaded, or being loaded right now
        return
    backends = torch.backends

    def flag(name: str, owner, attr: str) -> None:
        snap[name] = Entry(getattr(owner, attr), lambda v: setattr(owner, attr, v))

    snap["torch deterministic algorithms"] = Entry(
        (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]))
    for attr in ("enabled", "benchmark", "deterministic", "allow_tf32"):
        flag(f"torch.backends.cudnn.{attr}", backends.cudnn, attr)
    flag("torch.backends.cuda.matmul.allow_tf32", backends.cuda.matmul, "allow_tf32")
    snap["torch float32 matmul precision"] = Entry(torch.get_float32_matmul_precision(),
                                                   torch.set_float32_matmul_precision)
    snap["torch default dtype"] = Entry(torch.get_default_dtype(), torch.set_default_dtype)
    snap["torch default device"] = Entry(torch.get_default_device(), torch.set_default_device)
    snap["torch threads"] = Entry(torch.get_num_threads(), torch.set_num_threads)
    snap["torch grad mode"] = Entry(torch.is_grad_enabled(), torch.set_grad_enabled)
    snap["torch anomaly detection"] = Entry(torch.is_anomaly_enabled(), torch.set_anomaly_enabled)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available():
        # Not restorable: a group left behind is destroyed, one destroyed cannot come back.
        snap["torch.distributed default process group"] = Entry(
            dist.is_initialized(), lambda v: None if v or not dist.is_initialized() else dist.destroy_process_group())
    for module_name in TORCH_CONFIG_MODULES:
        module = sys.modules.get(module_name)
        if module is None or not hasattr(module, "get_config_copy"):
            continue
        for key, value in module.get_config_copy().items():
            if not key.startswith("_"):
                snap[f"{module_name}.{key}"] = Entry(value, lambda v, m=module, k=key: _set_config(m, k, v))


def _set_config(module, key: str, value) -> None:
    *path, last = key.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, last, value)


# -------------------------------------------------------------------------------------------------
# Snapshot, compare, restore
# -------------------------------------------------------------------------------------------------

def snapshot() -> Snapshot:
    """The process state this module compares, as it is now."""
    snap: Snapshot = {}
    _signals(snap)
    _interpreter(snap)
    _loggers(snap)
    _torch(snap)
    return snap


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors in a config value: compare identity
        return a is b


def _library_setup(name: str, value) -> bool:
    """A value a library sets once per process, lazily, and relies on keeping: not a test's doing, and not to
    be undone (torch would not set it again)."""
    if name == "environment variable TORCHINDUCTOR_CACHE_DIR":
        return _torch_default_inductor_cache(value)  # Inductor's default, set when it first locates its cache
    if name.startswith("environment variable _TORCHINDUCTOR"):
        return True  # Inductor's private variables for its compile workers, set on first compile
    if name == "environment variable KMP_DUPLICATE_LIB_OK":
        return value == "True"  # scikit-learn's import sets it (lm-eval loads it), as Inductor's C++ builder does
    if name == "signal handler SIGCHLD":  # the DataLoader's, installed with its first worker process
        return getattr(value[0], "__module__", "") == "torch.utils.data._utils.signal_handling"
    return False


def _differs(name: str, before: Entry, after: Entry | None) -> bool:
    if after is None:
        # Only environment variables vanish; a logger or config module never does.
        return name.startswith("environment variable ")
    return not _same(before.value, after.value) and not _library_setup(name, after.value)


def _diff(before: Snapshot, after: Snapshot) -> dict[str, str]:
    """name -> what happened to it, for each entry that differs."""
    out = {name: f"{name} changed ({_short(entry.value)} -> {_short(after[name].value) if name in after else 'unset'})"
           for name, entry in before.items() if _differs(name, entry, after.get(name))}
    for name, entry in after.items():
        if name in before or _library_setup(name, entry.value):
            continue
        if name.startswith("environment variable "):
            out[name] = f"{name} set ({_short(entry.value)})"
        elif name.startswith("logger ") and _ours(name) and entry.value != _DEFAULT_LOGGER:
            out[name] = f"{name} configured ({_short(entry.value)})"  # a logger made during the test and set up
    return out


def changes(before: Snapshot, after: Snapshot | None = None) -> list[str]:
    """What differs between ``before`` and ``after`` (default: now), one phrase each, sorted."""
    return sorted(_diff(before, snapshot() if after is None else after).values())


def restore(before: Snapshot, after: Snapshot | None = None) -> None:
    """Put back every value that differs from ``before``; remove variables and reset loggers that appeared."""
    after = snapshot() if after is None else after
    for name in _diff(before, after):
        if name in before:
            if before[name].restore is not None:
                before[name].restore(before[name].value)
        elif name.startswith("environment variable "):
            after[name].restore(_UNSET)
        else:
            after[name].restore(_DEFAULT_LOGGER)


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Leak(AssertionError):
    """Something a test or a run changed in the process and left changed."""


def check(before: Snapshot, what: str, ignore: frozenset[str] = frozenset(), entry_points: bool = False) -> None:
    """Restore what differs from ``before``; then, if anything did, raise :class:`Leak` naming each.
    ``ignore``: entries that may change (by name), left as they are. ``entry_points``: what a command's
    main sets up for its process (:data:`ENTRY_POINT_SETTINGS`) is restored without failing."""
    __tracebackhide__ = True
    found = restore_changes(before, ignore, entry_points)
    if found:
        raise Leak(f"{what} left process-wide state changed (restored now; restore it where it is changed):\n  "
                   + "\n  ".join(found))


def restore_changes(before: Snapshot, ignore: frozenset[str] = frozenset(), entry_points: bool = False) -> list[str]:
    """Restore what differs from ``before`` (except ``ignore``) and say what it was, leaving out what a
    command's main sets up for its process when ``entry_points``."""
    after = {n: e for n, e in snapshot().items() if n not in ignore}
    before = {n: e for n, e in before.items() if n not in ignore}
    found = _diff(before, after)
    if found:
        restore(before, after)
    return sorted(text for name, text in found.items()
                  if not (entry_points and is_entry_point_setting(name, after.get(name))))


@contextlib.contextmanager
def checked(what: str):
    """Fail ``what`` (raise :class:`Leak`) when the block leaves the process state changed; what a command's
    main sets up for its process on purpose is put back without failing (tests call mains in-process)."""
    __tracebackhide__ = True
    before = snapshot()
    yield before
    check(before, what, entry_points=True)


# What ``trainer.train.main`` (and the other commands' mains) set up for the process they run in, on purpose:
# in a real run the process ends with the command. A test (or tests/distributed/worker.py) that calls one
# in-process puts these back after it (:func:`entry_point`); anything else a command leaves changed is a leak.
ENTRY_POINT_SETTINGS = {
    "logger 'trainer'",  # trainer.logs.setup: the console handler on this process's stdout
    "logger 'lm_eval'",  # trainer eval: lm-eval's console handler (tests/conftest.py resets lm-eval's flag for it)
    "logger 'torch.distributed'",  # trainer simulate: torch's warnings about its fake process groups, silenced
    "logger 'torch.distributed.elastic'",  # trainer eval: the agent's start-up lines, silenced
    "warnings.showwarning",  # trainer.logs.setup: warnings as one log line
    "sys.excepthook",  # torch's init_process_group installs one that names the rank; destroying the group keeps it
    "automatic garbage collection",  # the training loop turns it off for the process's life
    "torch deterministic algorithms", "torch.backends.cudnn.deterministic", "torch.backends.cudnn.benchmark",
    "torch.backends.cudnn.allow_tf32", "torch.backends.cuda.matmul.allow_tf32",  # debug.deterministic, CUDA's TF32
}
ENTRY_POINT_ENV = {
    "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",  # the flight recorder, before init
    "CUBLAS_WORKSPACE_CONFIG",  # debug.deterministic
    "TORCHINDUCTOR_CACHE_DIR",  # compile.cache_dir
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",  # a default process group of one, outside torchrun
    "HF_XET_HIGH_PERFORMANCE",  # importing lm_eval sets it (evaluation: trainer eval, [eval]), once per process
    "RUST_LOG",  # a fault-tolerant run quiets torchft's own logs
}


def is_entry_point_setting(name: str, entry: Entry | None = None) -> bool:
    """Whether ``name`` is one of the entries a command's main sets up (and, given its new ``entry``, to the
    value main gives it, where that is known)."""
    if name == "sys.excepthook" and entry is not None:
        # trainer.interrupt's Ctrl-C hook, or the one torch's init_process_group installs
        return getattr(entry.value, "__qualname__", "").endswith(("quiet_keyboard_interrupt.<locals>.hook",
                                                                   "_distributed_excepthook"))
    if name == "warnings.showwarning" and entry is not None:
        return getattr(entry.value, "__module__", "") == "trainer.logs"
    return name in ENTRY_POINT_SETTINGS or (
        name.startswith("environment variable ") and name.removeprefix("environment variable ") in ENTRY_POINT_ENV)


@contextlib.contextmanager
def entry_point():
    """Around an in-process call of a command's ``main``: afterwards, put back what the command sets up for
    its process on purpose (:data:`ENTRY_POINT_SETTINGS`, :data:`ENTRY_POINT_ENV`), so that the test is
    checked for the rest."""
    before = {n: e for n, e in snapshot().items() if is_entry_point_setting(n)}
    try:
        yield
    finally:
        after = {n: e for n, e in snapshot().items() if is_entry_point_setting(n)}
        restore(before, after)


# -------------------------------------------------------------------------------------------------
# Per test module (tests/conftest.py)
# -------------------------------------------------------------------------------------------------

_module_snapshots: dict[str, Snapshot] = {}


def module_started(module_id: str) -> None:
    """Called from a module-scoped autouse fixture: after the session's fixtures, before the module's."""
    _module_snapshots[module_id] = snapshot()


def module_ended(module_id: str, next_module_id: str | None) -> None:
    """Called after a test's teardown: when the next test is in another module, the module's fixtures have
    been torn down, and the state must be what it was before them."""
    __tracebackhide__ = True
    if next_module_id == module_id or module_id not in _module_snapshots:
        return
    check(_module_snapshots.pop(module_id), f"test module {module_id} (its module-scoped fixtures)",
          entry_points=True)
