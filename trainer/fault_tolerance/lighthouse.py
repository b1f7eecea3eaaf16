"""``trainer lighthouse [--port P] [--min_replicas N] [torchft_lighthouse options]``: start torchft's
lighthouse (the quorum server the replica groups of a fault-tolerant job talk to) in the foreground.

It prints the ``export TORCHFT_LIGHTHOUSE=http://<host>:<port>`` line the replica groups' launches need,
then becomes torchft's ``torchft_lighthouse`` process (same pid: a scheduler's signal reaches it). The
defaults suit training: a quorum of one group is enough (the others may be down), a dead group is dropped
after 5 s without heartbeat, and a quorum waits at most 10 s for stragglers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys

from trainer.fault_tolerance.config import INSTALL_HINT

DEFAULT_PORT = 29510  # torchft's default


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="trainer lighthouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (default 29510)")
    parser.add_argument("--min_replicas", type=int, default=1, help="replica groups a quorum needs (default 1)")
    parser.add_argument("--join_timeout_ms", type=int, default=10000,
                        help="how long a quorum waits for groups that are starting (default 10000)")
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=5000,
                        help="a group silent this long is dropped from the next quorum (default 5000)")
    parser.add_argument("--quorum_tick_ms", type=int, default=100, help="quorum check period (default 100)")
    args = parser.parse_args(argv)
    binary = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(binary):
        print(f"config error: `trainer lighthouse` needs torchft's torchft_lighthouse, which is not installed: "
              f"{INSTALL_HINT}", file=sys.stderr)
        return 2
    print(f"export TORCHFT_LIGHTHOUSE=http://{socket.getfqdn()}:{args.port}", flush=True)
    os.execv(binary, [binary, "--bind", f"[::]:{args.port}", "--min_replicas", str(args.min_replicas),
                      "--join_timeout_ms", str(args.join_timeout_ms), "--heartbeat_timeout_ms",
                      str(args.heartbeat_timeout_ms), "--quorum_tick_ms", str(args.quorum_tick_ms)])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
