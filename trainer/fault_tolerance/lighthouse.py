"""``trainer lighthouse [--port P] [--min_replicas N] [torchft_lighthouse options]``: start torchft's
lighthouse (the quorum server the replica groups of a fault-tolerant job talk to) in the foreground.

It prints the ``export TORCHFT_LIGHTHOUSE=http://<host>:<port>`` line the replica groups' launches need,
with an address other nodes can reach (this node's host name when it resolves to a routable address, else
the address of its outward interface; ``--host`` to choose) and a line saying which it is, then becomes
torchft's ``torchft_lighthouse`` process (same pid: a scheduler's signal reaches it). A port in use is one
line (exit 2) before anything is printed. The defaults suit training: a quorum of one group is enough (the
others may be down), a dead group is dropped after 5 s without heartbeat, and a quorum waits at most 10 s
for stragglers.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import ipaddress
import os
import shutil
import socket
import struct
import sys

from trainer.fault_tolerance.config import INSTALL_HINT

DEFAULT_PORT = 29510  # torchft's default
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _routable(ip: str) -> bool:
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return not (address.is_loopback or address.is_unspecified or address.is_link_local)


def _interfaces() -> dict[str, str]:
    """IPv4 address -> interface name, for the interfaces that have one (Linux; empty elsewhere)."""
    found = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for name in names:
                try:
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
                except OSError:
                    continue  # no IPv4 address
                found[socket.inet_ntoa(packed[20:24])] = name
    except (OSError, AttributeError):
        pass
    return found


def _outward_ip() -> str | None:
    """The address this node's traffic to other hosts leaves from (the default route's); nothing is sent."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, only looked up in the route table
            return s.getsockname()[0]
    except OSError:
        return None


def reachable_host(explicit: str | None = None) -> tuple[str, str]:
    """The host part of the address to print, and one line saying what it is."""
    if explicit:
        return explicit, f"# {explicit}: as given by --host"
    name = socket.gethostname()
    try:
        resolved = socket.gethostbyname(name)
    except OSError:
        resolved = None
    interfaces = _interfaces()
    if resolved is not None and _routable(resolved):
        where = f", interface {interfaces[resolved]}" if resolved in interfaces else ""
        return name, f"# {name}: this node's host name ({resolved}{where}); other nodes must resolve it to reach " \
                     "the lighthouse (--host to print another name or address)"
    ip = _outward_ip() or next((a for a in interfaces if _routable(a)), None)
    if ip is None:
        return name, (f"# {name}: this node's host name, which resolves to {resolved or 'nothing'} here and no "
                      "interface has a routable address: other nodes may not reach it (--host to print another)")
    where = f"interface {interfaces[ip]}" if ip in interfaces else "the interface of the default route"
    return ip, (f"# {ip}: the address of {where}; the host name {name} resolves to {resolved or 'nothing'} here, "
                "which other nodes cannot use (--host to print another name or address)")


def port_in_use(port: int) -> OSError | None:
    """Whether the lighthouse could listen on ``port`` (on every address, as it binds [::]:port)."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the lighthouse does: TIME_WAIT is fine
                s.bind((address, port))
            return None
        except OSError as e:
            if e.errno == errno.EADDRINUSE or family == socket.AF_INET:
                return e
    return None


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
    parser.add_argument("--host", default=None,
                        help="the host name or address to print for the other nodes (default: this node's host "
                             "name if it resolves to a routable address, else its outward interface's address)")
    args = parser.parse_args(argv)
    binary = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(binary):
        print(f"config error: `trainer lighthouse` needs torchft's torchft_lighthouse, which is not installed: "
              f"{INSTALL_HINT}", file=sys.stderr)
        return 2
    busy = port_in_use(args.port)
    if busy is not None:
        print(f"config error: `trainer lighthouse` cannot listen on port {args.port} ({busy.strerror or busy}): "
              "another lighthouse or program has it; pass --port with a free port", file=sys.stderr)
        return 2
    host, which = reachable_host(args.host)
    print(f"export TORCHFT_LIGHTHOUSE=http://{host}:{args.port}", flush=True)
    print(which, flush=True)
    os.execv(binary, [binary, "--bind", f"[::]:{args.port}", "--min_replicas", str(args.min_replicas),
                      "--join_timeout_ms", str(args.join_timeout_ms), "--heartbeat_timeout_ms",
                      str(args.heartbeat_timeout_ms), "--quorum_tick_ms", str(args.quorum_tick_ms)])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
