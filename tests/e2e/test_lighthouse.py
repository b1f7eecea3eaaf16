"""A fault-tolerant job's lighthouse as users meet it, through `trainer lighthouse` and run_train.sh, with
one real lighthouse and real replica groups (one process each) shared by every assertion of one job:

- group 0 starts and, once its Manager is listed at the lighthouse, waits for the job's other group
  (fault_tolerance.join_timeout_ms);
- a copy of group 0's command (the same replica_id) stops in one line, exit 2, before it writes anything,
  and group 0 is unaffected; group 1 starts meanwhile, and both take step 1 together (group 0 recovers
  from nobody and missed no step);
- group 1's process dies inside step 3 (the crash drill) and torchrun starts it again (MAX_RESTARTS):
  group 0's step 3 is not committed and is repeated, not counted as skipped; group 1 recovers from group 0
  and says at which step it joins, as its summary does, and counts none of group 0's uncommitted steps;
- the lighthouse is killed mid-run: both groups stop within fault_tolerance.quorum_timeout_ms in one line
  naming TORCHFT_LIGHTHOUSE and its address (exit 7), the job's checkpoint of the last step saved.

`trainer lighthouse` on a port in use, and the address it prints, are checked here too (no job)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.launch import FAST, ROOT, train_env, train_in_process
from tests.support.processes import QUICK_S, free_port, kill_tree, popen, run, wait_for
from trainer.checkpoint.layout import scan_folder

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

STEPS = 400  # more than the job gets through before the lighthouse is killed
TIMEOUTS = ("--fault_tolerance.quorum_timeout_ms", "3000", "--fault_tolerance.connect_timeout_ms", "2000",
            "--fault_tolerance.process_group_timeout_ms", "3000")


CRASH_STEP = 3


def start_group(dump: Path, replica_id: int, address: str, name: str, *args: str,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """One replica group (run_train.sh, one process): stdout to <name>.out, stderr (the launcher's one
    line) to <name>.err."""
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), *FAST, "--training.steps", str(STEPS),
           "--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id",
           str(replica_id), "--fault_tolerance.join_timeout_ms", "240000", *TIMEOUTS, "--checkpoint.enable",
           "--checkpoint.interval", "1000", *args]
    with open(dump.parent / f"{name}.out", "w") as out, open(dump.parent / f"{name}.err", "w") as err:
        return popen(cmd, cwd=ROOT, env=train_env(1, env={"TORCHFT_LIGHTHOUSE": address, **(env or {})}),
                     stdout=out, stderr=err)


def status_page(address: str) -> str:
    """The lighthouse's status page, which lists each group's Manager (replica_<id>:<uuid>) once it is up."""
    with urllib.request.urlopen(f"{address}/status", timeout=10) as page:
        return page.read().decode()


def records(dump: Path, replica_id: int) -> list[dict]:
    path = dump / f"replica_{replica_id}" / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip().endswith("}")]


def before_the_kill(rows: list[dict]) -> list[dict]:
    """A group's records without the step the lighthouse's death may have left uncommitted (the kill can land
    inside a step; that step is not applied, and the group stops at the step before it)."""
    return rows[:-1] if rows and not rows[-1]["committed"] else rows


def last_applied(dump: Path, replica_id: int) -> int:
    return [r["step"] for r in records(dump, replica_id) if r["committed"]][-1]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's run; returns its folder, the lighthouse's address and the groups' exit codes."""
    folder = tmp_path_factory.mktemp("ft_job")
    dump = folder / "job"
    port = free_port()
    lighthouse = popen([sys.executable, "-m", "trainer.cli", "lighthouse", "--port", str(port), "--min_replicas",
                        "1", "--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "2000"],
                       stdout=open(folder / "lighthouse.out", "w"), stderr=subprocess.STDOUT)
    address = f"http://localhost:{port}"
    procs: dict[str, subprocess.Popen] = {}
    try:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, "the lighthouse to listen", timeout=QUICK_S, proc=lighthouse, log=folder / "lighthouse.out")
        procs["group0"] = start_group(dump, 0, address, "group0")
        wait_for(lambda: "replica_0:" in status_page(address), "group 0's Manager at the lighthouse",
                 proc=procs["group0"], log=folder / "group0.out")
        procs["copy"] = start_group(dump, 0, address, "copy")  # a copied job script: replica_id 0 again
        procs["group1"] = start_group(dump, 1, address, "group1", "--debug.crash_at_step", str(CRASH_STEP),
                                      env={"MAX_RESTARTS": "1"})
        copy_rc = procs["copy"].wait(timeout=300)
        # Group 1 started again, recovered from group 0, and stepping with it.
        wait_for(lambda: (dump / "replica_1" / "summary.json").exists() or any(
            r["replica_groups"] == 2 and r["step"] > CRASH_STEP + 1 for r in records(dump, 1)),
            "group 1 stepping with group 0 again", proc=procs["group1"], log=folder / "group1.out")
        kill_tree(lighthouse)
        rcs = {g: procs[f"group{g}"].wait(timeout=300) for g in (0, 1)}
    finally:
        for proc in [lighthouse, *procs.values()]:
            kill_tree(proc)
    return {"folder": folder, "dump": dump, "address": address, "copy_rc": copy_rc, "rcs": rcs}


def test_a_group_with_a_taken_replica_id_stops_before_it_trains(job):
    err = (job["folder"] / "copy.err").read_text()
    assert job["copy_rc"] == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "fault_tolerance.replica_id 0 is taken" in lines[0] and job["address"] in lines[0], err
    # Group 0 went on untouched: one committed record per step, and no step it failed but the one group 1
    # crashed in (below).
    rows = before_the_kill(records(job["dump"], 0))
    steps = [r["step"] for r in rows if r["committed"]]
    assert steps == list(range(1, len(steps) + 1)), steps
    assert {r["step"] for r in rows if not r["committed"]} == {CRASH_STEP}, rows[:6]


def summary(job, g: int) -> dict:
    return json.loads((job["dump"] / f"replica_{g}" / "summary.json").read_text())


def test_groups_launched_together_take_step_one_together(job):
    first = records(job["dump"], 0)[0]
    assert first["step"] == 1 and first["replica_groups"] == 2, first
    ft = summary(job, 0)["fault_tolerance"]
    assert ft["recoveries"] == [] and ft["steps_missed"] == 0, ft
    # Group 1's first attempt (its records set aside when it started again) took step 1 with group 0.
    (before_crash,) = (job["dump"] / "replica_1" / "previous_runs").glob("*/metrics.jsonl")
    theirs = json.loads(before_crash.read_text().splitlines()[0])
    assert theirs["step"] == 1 and theirs["replica_groups"] == 2 and theirs["loss"] == first["loss"], theirs


def test_a_step_a_group_failed_in_is_repeated_and_the_recovery_is_reported_once(job):
    out0 = (job["folder"] / "group0.out").read_text()
    assert "skipped (None)" not in out0
    repeated = [r for r in before_the_kill(records(job["dump"], 0)) if not r["committed"]]
    assert repeated and all(r["step"] == CRASH_STEP for r in repeated), repeated
    assert "skipped (not committed: a replica group failed during it; repeated)" in out0
    s0, s1 = summary(job, 0), summary(job, 1)
    assert s0["fault_tolerance"]["uncommitted_steps"] == len([r for r in records(job["dump"], 0) if not r["committed"]])
    assert s0["skipped_steps"] == s1["skipped_steps"] == 0, (s0["skipped_steps"], s1["skipped_steps"])
    (recovery,) = s1["fault_tolerance"]["recoveries"]
    out1 = (job["folder"] / "group1.out").read_text()
    assert f"it joins at step {recovery['step']} " in out1, out1[-3000:]
    errs = [(job["folder"] / f"group{g}.err").read_text() for g in (0, 1)]
    for text in (out0, out1, *errs):
        assert "buffer is not writable" not in text and "Unable to reset NCCL flight recorder" not in text
        assert "GET /checkpoint/" not in text


def test_a_lighthouse_killed_mid_run_stops_both_groups_in_one_line_with_a_checkpoint(job):
    assert job["rcs"] == {0: 7, 1: 7}, job["rcs"]
    last = {g: last_applied(job["dump"], g) for g in (0, 1)}  # and saved: the same step in both groups
    assert last[0] == last[1], last
    for g in (0, 1):
        err = (job["folder"] / f"group{g}.err").read_text()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert f"TORCHFT_LIGHTHOUSE={job['address']} does not answer" in lines[0], err
        assert "quorum_timeout_ms = 3000" in lines[0] and f"checkpoint step-{last[g]} saved" in lines[0], err
    ckpt = job["dump"] / "checkpoint"
    assert [c.step for c in scan_folder(ckpt) if c.complete and c.kind == "full"] == [last[0]]
    for g in (0, 1):
        assert [c.step for c in scan_folder(ckpt / f"replica_{g}") if c.complete] == [last[0]]


def test_an_unreachable_lighthouse_at_start_is_one_line(tmp_path, monkeypatch):
    """A port where nothing listens: exit 7 at once (not torchft's 60 s connect timeout), nothing written."""
    address = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
    rc, out = train_in_process(tmp_path / "job", "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                               "--fault_tolerance.replica_id", "1", monkeypatch=monkeypatch)
    assert rc == 7, out[-3000:]
    assert f"the fault-tolerance lighthouse at TORCHFT_LIGHTHOUSE={address} does not answer at start" in out, out
    assert "Traceback" not in out and not (tmp_path / "job" / "replica_1" / "config.toml").exists()


def test_a_quorum_the_other_groups_never_join_is_one_line(tmp_path, monkeypatch):
    """The lighthouse answers but wants two groups and only this one comes (the other crashed at start):
    after fault_tolerance.quorum_timeout_ms, exit 7 in one line naming the key and the groups it hears from,
    instead of torchft's TimeoutError traceback."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", server.address())
        rc, out = train_in_process(tmp_path / "job", *FAST, "--fault_tolerance.enable", "--fault_tolerance.group_size",
                                   "2", "--fault_tolerance.replica_id", "0", "--fault_tolerance.join_timeout_ms", "300",
                                   "--fault_tolerance.quorum_timeout_ms", "1500", monkeypatch=monkeypatch)
    finally:
        server.shutdown()
    assert rc == 7, out[-3000:]
    assert ("no quorum of the job's replica groups formed for the quorum of step 1 within "
            "fault_tolerance.quorum_timeout_ms = 1500") in out and "hears from replica_0" in out, out[-3000:]
    assert out.rstrip().endswith("checkpoint.enable is false: nothing saved") and "Traceback" not in out, out[-3000:]


def test_trainer_lighthouse_on_a_port_in_use_is_one_line_before_the_address():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run([sys.executable, "-m", "trainer.cli", "lighthouse", "--port", str(port)], cwd=ROOT, timeout=QUICK_S)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on port {port}" in lines[0] and "--port" in lines[0], out.stderr


def test_trainer_lighthouse_prints_an_address_other_nodes_can_reach(tmp_path):
    """The export line names this node by a name or address that is not loopback, and the next line says
    which it is (host name, or interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # a route out of this machine (nothing is sent)
        except OSError:
            pytest.skip("this machine has no route to other nodes")
    port = free_port()
    log = tmp_path / "lighthouse.out"
    proc = popen([sys.executable, "-m", "trainer.cli", "lighthouse", "--port", str(port)], stdout=open(log, "w"),
                 stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(log.read_text().splitlines()) >= 2, "the lighthouse's address", timeout=QUICK_S, proc=proc,
                 log=log)
    finally:
        kill_tree(proc)
    export, which = log.read_text().splitlines()[:2]
    host = export.removeprefix("export TORCHFT_LIGHTHOUSE=http://").rsplit(":", 1)[0]
    assert export == f"export TORCHFT_LIGHTHOUSE=http://{host}:{port}", export
    assert which.startswith(f"# {host}: ") and ("host name" in which or "interface" in which), which
    resolved = socket.gethostbyname(host)  # a name that resolves here, or an address of this node
    assert not resolved.startswith("127.") and host != "localhost", (host, resolved)
