"""Imported at start-up by every Python process a test starts (tests/support/processes.py puts this folder
first on its PYTHONPATH): SIGUSR1 makes the process write all its threads' stacks to
``$TEST_STACKS_DIR/<pid>.txt``, which tests/support/timeouts.py asks for when a test runs past its limit."""

import faulthandler
import os
import signal

_folder = os.environ.get("TEST_STACKS_DIR")
if _folder and hasattr(faulthandler, "register"):
    try:
        _file = open(os.path.join(_folder, f"{os.getpid()}.txt"), "w")  # noqa: SIM115 - open for the process's life
    except OSError:  # the session's folder is gone: nothing to dump into, and nobody asking
        pass
    else:
        faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True)
