"""What a replica group learns from the lighthouse before and around its first step: whether the lighthouse
answers at all, whether another live group already trains under this group's ``replica_id``, and when the
job's other groups are up.

All of it comes from the lighthouse's status page (``GET <TORCHFT_LIGHTHOUSE>/status``, the page torchft's
dashboard polls), which lists every replica group's Manager by the name it heartbeats with
(``replica_<id>:<uuid>``: torchft adds a fresh uuid per start) and how long ago it was last heard. The
lighthouse is the one thing every group of a job reaches, on any node, so this needs no shared folder.
Torch-free: plain HTTP.
"""

from __future__ import annotations

import logging
import re
import socket
import time
import urllib.request

from trainer.errors import ConfigError, PeerLost
from trainer.fault_tolerance.config import LIGHTHOUSE_ENV

logger = logging.getLogger("trainer")

# "replica_0:6f1c...: seen 0.315258399s ago" (Rust's Duration formatting: ns, µs, ms or s).
_HEARTBEAT = re.compile(r"^\s*(\S+): seen ([0-9.]+)(ns|µs|us|ms|s) ago\s*$", re.MULTILINE)
_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
# A Manager heartbeats every 100 ms (torchft's default); one not heard for this long between two reads of
# the status page is dead (its entry stays on the page, ageing).
LIVENESS_WINDOW_S = 1.0
# A group heard within this long counts as up while waiting for the job's groups at start.
UP_WINDOW_S = 2.0


class QuorumLost(PeerLost):
    """No quorum of the job's replica groups could be formed: the group saves what it may and stops."""


class LighthouseLost(QuorumLost):
    """The lighthouse at TORCHFT_LIGHTHOUSE does not answer (never started, wrong address, or it died)."""


def unreachable(address: str, cause: object, *, during: str) -> LighthouseLost:
    """The one line for a lighthouse that does not answer ``during`` something, naming the variable."""
    return LighthouseLost(f"the fault-tolerance lighthouse at {LIGHTHOUSE_ENV}={address} does not answer {during} "
                          f"({cause}): start it (`trainer lighthouse`) or export the address it prints, then run "
                          "the same command again")


def no_quorum(address: str, timeout_ms: int, during: str, timeout_s: float) -> QuorumLost:
    """The one line for a quorum that timed out while the lighthouse answers: the groups it hears from."""
    try:
        beats = read_heartbeats(address, timeout_s) or {}
    except (OSError, socket.timeout, ValueError):
        beats = {}
    up = sorted({name.split(":")[0] for name, age in beats.items() if age <= UP_WINDOW_S})
    return QuorumLost(f"no quorum of the job's replica groups formed {during} within fault_tolerance."
                      f"quorum_timeout_ms = {timeout_ms} (the lighthouse at {LIGHTHOUSE_ENV}={address} hears "
                      f"from {', '.join(up) or 'no group'}; it waits for its --min_replicas): start the missing "
                      "groups (a group that stopped has the cause on its console), or raise the timeout")


def read_heartbeats(address: str, timeout_s: float) -> dict[str, float] | None:
    """Every Manager the lighthouse lists and the seconds since it was heard; None when the page has no
    heartbeat list this code can read (another lighthouse version). Raises OSError if nothing answers."""
    with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout_s) as response:
        page = response.read().decode("utf-8", errors="replace")
    if "Heartbeats" not in page:
        return None
    return {name: float(value) * _UNITS[unit] for name, value, unit in _HEARTBEAT.findall(page)}


def reachable(address: str, timeout_s: float) -> str | None:
    """None when the lighthouse answers; otherwise why not (for the one line)."""
    try:
        read_heartbeats(address, timeout_s)
    except (OSError, socket.timeout, ValueError) as e:
        return str(getattr(e, "reason", None) or e)
    return None


def _of_group(beats: dict[str, float], replica_id: int) -> dict[str, float]:
    prefix = f"replica_{replica_id}:"
    return {name: age for name, age in beats.items() if name.startswith(prefix)}


class StatusReader:
    """Reads the lighthouse's status page for one group; a failure to answer is :class:`LighthouseLost`."""

    def __init__(self, address: str, connect_timeout_s: float):
        self.address, self.timeout_s = address, connect_timeout_s
        self.readable = True
        self.listed: set[str] = set()  # every Manager name read so far

    def read(self, during: str) -> dict[str, float]:
        try:
            beats = read_heartbeats(self.address, self.timeout_s)
        except (OSError, socket.timeout, ValueError) as e:
            raise unreachable(self.address, getattr(e, "reason", None) or e, during=during) from None
        if beats is None:
            if self.readable:
                logger.warning("fault tolerance: the lighthouse at %s lists no heartbeats this trainer can read "
                               "(another torchft version?): replica ids are not checked for duplicates and the "
                               "groups do not wait for each other at start", self.address)
            self.readable = False
            return {}
        self.listed.update(beats)
        return beats

    def live_of_group(self, replica_id: int, during: str, *, more_than: int) -> bool:
        """Whether more than ``more_than`` live Managers heartbeat under ``replica_<replica_id>``. An entry
        not heard for 10 x LIVENESS_WINDOW_S is dead; otherwise the page is read again LIVENESS_WINDOW_S
        later, and only entries heard in between are live (a dead group's entry stays on the page, ageing;
        a live one's age starts again from 0)."""
        recent = [age for age in _of_group(self.read(during), replica_id).values() if age < 10 * LIVENESS_WINDOW_S]
        if len(recent) <= more_than:
            return False
        t0 = time.monotonic()
        time.sleep(LIVENESS_WINDOW_S)
        second = _of_group(self.read(during), replica_id)
        waited = time.monotonic() - t0
        return sum(1 for age in second.values() if age < waited) > more_than


def check_id_free(reader: StatusReader, replica_id: int, *, own: int) -> None:
    """ConfigError when more live Managers than ``own`` (0 before this group's Manager exists, 1 after)
    heartbeat under this group's replica id: another group of the job was launched with the same id.
    Checked before the Manager starts (a group already training is found, and nothing of it is touched),
    and again once this group's own Manager is listed (two groups started at the same moment both find
    the other, and both stop)."""
    if own and reader.readable:
        before = set(reader.listed)
        deadline = time.monotonic() + 10 * LIVENESS_WINDOW_S
        while not set(_of_group(reader.read("at start"), replica_id)) - before and time.monotonic() < deadline:
            time.sleep(0.05)
    if reader.live_of_group(replica_id, "at start", more_than=own):
        raise ConfigError(f"fault_tolerance.replica_id {replica_id} is taken: another replica group with that id "
                          f"is training with the lighthouse {reader.address} (its {reader.address}/status lists "
                          f"replica_{replica_id}:...); give each group its own replica_id in 0 .. group_size - 1")


def wait_for_groups(reader: StatusReader, group_size: int, timeout_s: float) -> list[int]:
    """Wait until every replica group 0 .. group_size - 1 heartbeats to the lighthouse, up to
    ``timeout_s``; returns the groups still missing (empty: all are up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        beats = reader.read("while waiting for the job's replica groups")
        up = {g for g in range(group_size) if any(age < UP_WINDOW_S for age in _of_group(beats, g).values())}
        missing = [g for g in range(group_size) if g not in up]
        if not missing or not reader.readable or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)
