"""Multi-node launch and recovery through run_train.sh, on one machine: launcher processes stand in for nodes.

- The launcher's torchrun arguments under plain variables, Slurm (sbatch + srun) and PBS (qsub + mpiexec),
  with fake ``scontrol``/``srun``/``mpiexec`` on PATH and ``RUN_TRAIN_DRY=1`` (nothing is started).
- Two launchers (``NNODES=2``, two processes each) meeting at a c10d rendezvous train HSDP (replicas across the
  "nodes") to the same losses as four processes on one node, in two network namespaces joined by a veth pair
  where ``ip netns`` is permitted (on localhost elsewhere, and the namespace test is skipped).
- In that job a worker is killed mid-run (``debug.crash_at_step``): torchrun restarts both nodes
  (``MAX_RESTARTS=1``), the trainer resumes from the latest checkpoint and ends with the uninterrupted run's
  losses. One job for the three: each two-node launch costs the suite a CPU-half-minute.
- A hung rank fails the run within ``comm.train_timeout_seconds``, with the rank and collective named.

The training runs are few processes on a small machine: the module starts every run the selected tests need
at once (they are independent) and each test checks its own.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.launch import FAST, ROOT, read_metrics, start_train
from tests.support.parity import LAYOUTS, STEPS
from tests.support.processes import QUICK_S, free_port, kill_tree, run as run_process

# The one-node reference is the parity tests' HSDP 2 x 2 run on four processes (a batched run declared in
# tests/support/parity.py; its evaluation at step 4 leaves the losses as they are): the two-node runs train
# what it trains, so that no four-process run exists only to be compared with them.
REFERENCE = "layout_hsdp2x2"
_, _BATCH, HSDP = LAYOUTS["hsdp2x2"]  # 2 replicas (one per node) x FSDP 2
TRAIN = [*FAST, *STEPS, "--training.local_batch_size", str(_BATCH)]
DEADLINE_S = 540  # all runs together, on a loaded 2-core machine


# --------------------------------------------------------------------------------------------------
# Dry runs: the torchrun command under each scheduler
# --------------------------------------------------------------------------------------------------


def torchrun_args(line: str) -> dict[str, str]:
    """``--key=value`` options between ``trainer.launch`` (torchrun) and ``-m trainer.train`` (flags map to "")."""
    words = shlex.split(line)
    start = words.index("trainer.launch") + 1  # torch.distributed.run with a one-line failure report
    end = words.index("trainer.train") - 1
    args = {}
    for w in words[start:end]:
        key, _, value = w.partition("=")
        args[key] = value
    args["_trainer_args"] = " ".join(words[end + 2:])
    args["_env"] = " ".join(w for w in words[:start] if "=" in w and not w.startswith("-"))
    return args


def fake_bin(tmp_path: Path) -> Path:
    """scontrol (prints $FAKE_HOSTS), srun (runs the command once per node of the job, sequentially, with
    the variables srun sets) and mpiexec (once per -n, with PMI_RANK/PMI_SIZE; the node file only exists
    on the first node, as on PBS Pro)."""
    b = tmp_path / "bin"
    b.mkdir()
    (b / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
                                'for h in $FAKE_HOSTS; do echo "$h"; done\n')
    (b / "srun").write_text(
        '#!/bin/bash\necho "fake-srun: $*" >&2\n'
        'while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done\n'
        'n=$SLURM_JOB_NUM_NODES\n'
        'for ((i = 0; i < n; i++)); do\n'
        '  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NNODES=$n SLURM_STEP_NUM_NODES=$n \\\n'
        '  SLURM_STEP_NUM_TASKS=$n SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" || exit $?\n'
        'done\n')
    (b / "mpiexec").write_text(
        '#!/bin/bash\n[ "$1" = "--version" ] && { echo "HYDRA build details: fake"; exit 0; }\n'
        'echo "fake-mpiexec: $*" >&2\n'
        'n=1\n'
        'while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do\n'
        '  case $1 in -n|-np) n=$2; shift 2;; --ppn|--map-by|-x) shift 2;; *) shift;; esac\n'
        'done\n'
        'for ((i = 0; i < n; i++)); do\n'
        '  if [ $i -eq 0 ]; then PMI_RANK=$i PMI_SIZE=$n "$@" || exit $?\n'
        '  else env -u PBS_NODEFILE PMI_RANK=$i PMI_SIZE=$n "$@" || exit $?; fi\n'
        'done\n')
    for f in b.iterdir():
        f.chmod(0o755)
    return b


def dry(cmd: list[str], env: dict[str, str], tmp_path: Path, check: bool = True) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "PBS_", "PMI_", "OMPI_", "PALS_", "PMIX_"))
             and k not in ("NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_CONF", "MASTER_ADDR",
                           "MASTER_PORT", "LOCAL_ADDR", "MAX_RESTARTS", "NGPU", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    full = {**clean, "RUN_TRAIN_DRY": "1", "PATH": f"{fake_bin(tmp_path)}:{os.environ['PATH']}", **env}
    proc = run_process(cmd, cwd=ROOT, env=full, timeout=QUICK_S)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_slurm_batch_script_starts_one_launcher_per_node(tmp_path):
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3", "SLURM_NNODES": "3", "SLURM_NODEID": "0",
           "SLURM_JOB_NODELIST": "gpu-a[01-03]", "FAKE_HOSTS": "gpu-a01 gpu-a02 gpu-a03",
           "SLURM_SUBMIT_DIR": str(ROOT), "NGPU": "8", "SLURM_CPUS_PER_TASK": "64"}
    proc = dry(["bash", str(ROOT / "scripts/slurm/train.sbatch"), "--training.steps", "7"], env, tmp_path)
    assert "--ntasks-per-node=1" in proc.stderr and "--cpus-per-task=64" in proc.stderr, proc.stderr
    runs = [torchrun_args(line) for line in proc.stdout.splitlines() if "trainer.launch" in line]
    assert [r["--node-rank"] for r in runs] == ["0", "1", "2"]
    for r in runs:
        assert r["--nnodes"] == "3" and r["--nproc-per-node"] == "8"
        assert r["--rdzv-backend"] == "c10d" and r["--rdzv-endpoint"] == "gpu-a01:29500"
        assert r["--rdzv-id"] == "4242" and r["--max-restarts"] == "3"
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r["_env"]
        assert r["_trainer_args"].endswith("--training.steps 7")


def test_pbs_batch_script_starts_one_launcher_per_node(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"x100{n}.hpc\n" for n in (3, 5) for _ in range(4)))  # 4 slots per node
    env = {"PBS_JOBID": "777.pbs01", "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(ROOT),
           "NGPU": "4", "TRAIN_ARGS": "--training.steps 9 --metrics.log_freq 3"}
    proc = dry(["bash", str(ROOT / "scripts/pbs/train.pbs")], env, tmp_path)
    assert "-n 2 --ppn 1" in proc.stderr, proc.stderr
    runs = [torchrun_args(line) for line in proc.stdout.splitlines() if "trainer.launch" in line]
    assert [r["--node-rank"] for r in runs] == ["0", "1"]
    for r in runs:  # the second copy has no node file: NNODES and MASTER_ADDR came from the script
        assert r["--nnodes"] == "2" and r["--nproc-per-node"] == "4"
        assert r["--rdzv-endpoint"] == "x1003.hpc:29500" and r["--rdzv-id"] == "777.pbs01"
        assert r["_trainer_args"].endswith("--training.steps 9 --metrics.log_freq 3")


@pytest.mark.parametrize("case", ["plain", "master_addr", "slurm", "pbs", "single", "local_addr"])
def test_launcher_derives_torchrun_arguments(tmp_path, case):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("cn7\ncn7\ncn9\ncn9\ncn4\ncn4\n")
    env, expect = {
        "plain": ({"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": "10.0.0.5:29400", "NGPU": "2"},
                  {"--nnodes": "2", "--node-rank": "1", "--rdzv-endpoint": "10.0.0.5:29400", "--rdzv-id": "trainer"}),
        "master_addr": ({"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "head", "MASTER_PORT": "1234"},
                        {"--nnodes": "4", "--node-rank": "3", "--rdzv-endpoint": "head:1234"}),
        "slurm": ({"SLURM_JOB_ID": "99", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]",
                   "FAKE_HOSTS": "n1 n2", "MAX_RESTARTS": "2"},
                  {"--nnodes": "2", "--node-rank": "1", "--rdzv-endpoint": "n1:29500", "--rdzv-id": "99",
                   "--max-restarts": "2"}),
        "pbs": ({"PBS_JOBID": "5.srv", "PBS_NODEFILE": str(nodefile), "PMI_RANK": "2"},
                {"--nnodes": "3", "--node-rank": "2", "--rdzv-endpoint": "cn7:29500", "--rdzv-id": "5.srv"}),
        "single": ({"NGPU": "4"}, {"--nnodes": "1", "--nproc-per-node": "4", "--standalone": ""}),
        "local_addr": ({"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": "10.9.0.1:29400", "LOCAL_ADDR": "10.9.0.1",
                        "RDZV_CONF": "join_timeout=900"},
                       {"--local-addr": "10.9.0.1", "--rdzv-conf": "join_timeout=900,is_host=1"}),
    }[case]
    r = torchrun_args(dry([str(ROOT / "run_train.sh")], env, tmp_path).stdout)
    for key, value in expect.items():
        assert r.get(key) == value, (key, r)
    assert ("--standalone" in r) == (case == "single")


@pytest.mark.parametrize("case", ["node_rank_out_of_range", "no_endpoint", "srun_per_gpu", "mpiexec_per_slot"])
def test_launcher_refuses_wrong_launches(tmp_path, case):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("a\na\nb\nb\n")
    env, message = {
        "node_rank_out_of_range": ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:1"}, "NODE_RANK=2"),
        "no_endpoint": ({"NNODES": "2", "NODE_RANK": "1"}, "RDZV_ENDPOINT"),
        "srun_per_gpu": ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
                          "SLURM_STEP_NUM_TASKS": "16", "SLURM_NODEID": "0"}, "srun --ntasks-per-node=1"),
        "mpiexec_per_slot": ({"PBS_JOBID": "1", "PBS_NODEFILE": str(nodefile), "PMI_RANK": "0", "PMI_SIZE": "4"},
                             "start exactly one per node"),
    }[case]
    proc = dry([str(ROOT / "run_train.sh")], env, tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------------
# Training runs, started together
# --------------------------------------------------------------------------------------------------


@dataclass
class Run:
    dump: Path
    agents: list[tuple[subprocess.Popen, Path]] = field(default_factory=list)
    returncodes: list[int | None] = field(default_factory=list)
    elapsed_s: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def log(self) -> str:
        return "\n".join(f"===== {log.name}\n{log.read_text(errors='replace')}" for _, log in self.agents)

    def tail(self, n: int = 6000) -> str:
        return "\n".join(f"===== {log.name}\n{log.read_text(errors='replace')[-n:]}" for _, log in self.agents)

    def losses(self) -> dict[int, float]:
        """The last record of each step (a resumed run logs the steps after its checkpoint again)."""
        return {r["step"]: r["loss"] for r in read_metrics(self.dump)}


def two_nodes(root: Path, name: str, args: list[str], env: dict[str, str] | None = None,
              per_node: list[dict[str, str]] | None = None, prefixes: list[tuple[str, ...]] | None = None,
              node_ranks: bool = True) -> Run:
    """Two launchers, NNODES=2 and two processes each, started concurrently, into one dump folder (as on a
    shared filesystem). ``node_ranks`` False leaves NODE_RANK unset on both, as users of the c10d rendezvous
    often do (it assigns the ranks): both launchers then meet the dump folder's run lock as node 0."""
    run = Run(root / name)
    base = {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": f"{name}-{os.getpid()}",
            **(env or {})}
    for node in (0, 1):
        rank = {"NODE_RANK": str(node)} if node_ranks else {}
        node_env = {**base, **rank, **(per_node[node] if per_node else {})}
        run.agents.append((start_train(run.dump, *args, nproc=2, env=node_env, fast=False,
                                       log=root / f"{name}-node{node}.log",
                                       prefix=prefixes[node] if prefixes else ()), root / f"{name}-node{node}.log"))
    return run


def sh(*cmd: str) -> subprocess.CompletedProcess:
    return run_process(list(cmd), timeout=QUICK_S)


class NetnsPair:
    """Two network namespaces joined by a veth pair: 10.<a>.<b>.1 and .2 on a random /24."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}{random.randint(0, 99)}"
        self.ns = [f"mnA{tag}", f"mnB{tag}"]
        self.ifs = [f"vmA{tag}", f"vmB{tag}"]
        subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
        self.ips = [f"{subnet}.1", f"{subnet}.2"]
        self.created: list[str] = []
        self.error = ""
        steps = [("ip", "netns", "add", self.ns[0]), ("ip", "netns", "add", self.ns[1]),
                 ("ip", "link", "add", self.ifs[0], "type", "veth", "peer", "name", self.ifs[1])]
        for i in (0, 1):
            steps += [("ip", "link", "set", self.ifs[i], "netns", self.ns[i]),
                      ("ip", "-n", self.ns[i], "addr", "add", f"{self.ips[i]}/24", "dev", self.ifs[i]),
                      ("ip", "-n", self.ns[i], "link", "set", self.ifs[i], "up"),
                      ("ip", "-n", self.ns[i], "link", "set", "lo", "up")]
        for cmd in steps:
            try:
                proc = sh(*cmd)
            except (OSError, subprocess.SubprocessError) as e:
                self.error = f"{' '.join(cmd)}: {e}"
                return
            if proc.returncode != 0:
                self.error = f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}"
                return
            if cmd[1:3] == ("netns", "add"):
                self.created.append(cmd[3])

    def bytes_through_veth(self) -> int:
        proc = sh("ip", "-n", self.ns[0], "-s", "-j", "link", "show", self.ifs[0])
        stats = json.loads(proc.stdout)[0]["stats64"]
        return stats["tx"]["bytes"] + stats["rx"]["bytes"]

    def remove(self) -> None:
        for ns in self.created:  # deleting a namespace deletes its end of the veth pair, and so both
            sh("ip", "netns", "del", ns)


NEEDS = {
    "test_two_nodes_match_one_node": {"job"},
    "test_killed_worker_restarts_and_resumes": {"job"},
    "test_two_nodes_across_network_namespaces": {"job", "netns"},
    "test_hung_rank_fails_fast_naming_the_collective": {"hang"},
}
# The one two-node job the first three tests check: HSDP across the "nodes", rank 2 SIGKILLs itself before
# step 3 on the first attempt (torchrun restarts both nodes, the trainer resumes from step 2), NODE_RANK unset
# (the c10d rendezvous assigns the ranks; both launchers meet the run lock as node 0).
JOB = [*TRAIN, *HSDP, "--checkpoint.enable", "--checkpoint.interval", "2", "--debug.crash_at_step", "3",
       "--debug.crash_rank", "2"]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Start the runs the selected tests need, all at once; wait for all of them."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    wanted = set().union(*(NEEDS.get(name, set()) for name in selected))
    root = tmp_path_factory.mktemp("multinode")
    out: dict[str, Run] = {}
    netns = NetnsPair() if "job" in wanted else None
    if netns is not None and netns.error:
        out["netns"] = Run(root / "netns", info={"skip": f"network namespaces not available: {netns.error}"})
        netns = None
    if netns is not None:  # the job in two namespaces: nothing between the "nodes" but the veth pair
        per_node = [{"LOCAL_ADDR": netns.ips[i], "GLOO_SOCKET_IFNAME": netns.ifs[i]} for i in (0, 1)]
        out["job"] = two_nodes(root, "job", JOB, env={"RDZV_ENDPOINT": f"{netns.ips[0]}:29400", "MAX_RESTARTS": "1"},
                               per_node=per_node, prefixes=[("ip", "netns", "exec", ns) for ns in netns.ns],
                               node_ranks=False)
        out["job"].info["netns"] = netns
        out["netns"] = out["job"]
    elif "job" in wanted:  # on localhost
        out["job"] = two_nodes(root, "job", JOB, env={"MAX_RESTARTS": "1"}, node_ranks=False)
    if "hang" in wanted:  # rank 1 sleeps before step 3; rank 0 waits in the step's first collective
        out["hang"] = Run(root / "hang")
        out["hang"].agents.append((start_train(
            root / "hang", *TRAIN, "--comm.train_timeout_seconds", "5", "--comm.watchdog_timeout_seconds", "0",
            "--debug.stall_at_step", "3", "--debug.stall_rank", "1", "--debug.stall_seconds", "300",
            nproc=2, fast=False, log=root / "hang.log"), root / "hang.log"))

    t0 = time.monotonic()
    try:
        started = list({id(run): run for run in out.values()}.values())  # a run standing in for another: once
        pending = [(run, i) for run in started for i in range(len(run.agents))]
        for run in started:
            run.returncodes = [None] * len(run.agents)
        while pending and time.monotonic() - t0 < DEADLINE_S:
            for run, i in list(pending):
                rc = run.agents[i][0].poll()
                if rc is not None:
                    run.returncodes[i] = rc
                    run.elapsed_s = time.monotonic() - t0
                    pending.remove((run, i))
            time.sleep(0.5)
        yield out
    finally:
        for run in out.values():  # whatever is still running: the launcher and every process below it
            for proc, _ in run.agents:
                if proc.poll() is None:
                    kill_tree(proc)
        if netns is not None:
            netns.remove()


def finished(run: Run) -> None:
    assert all(rc == 0 for rc in run.returncodes), f"return codes {run.returncodes}:\n{run.tail()}"


def assert_same_losses(run: Run, reference, steps=(1, 2, 3, 4, 5)) -> None:
    ref, got = reference.losses(), run.losses()
    assert sorted(ref) == list(steps) and sorted(got) == list(steps), (ref, got)
    for s in steps:
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (s, got[s], ref[s])


def assert_node_health(run: Run, world: int = 4) -> None:
    for r in read_metrics(run.dump):
        assert 0 < r["step_time_min_s"] <= r["step_time_max_s"], r
        assert 0 < r["tflops_min"] <= r["tflops_max"], r
        assert 0 <= r["slowest_rank"] < world and r["slowest_node"] in (0, 1), r


@pytest.mark.slow
@pytest.mark.runs(REFERENCE)
def test_two_nodes_match_one_node(runs, batches):
    ref, run = batches.get(REFERENCE), runs["job"]
    finished(run)
    assert "dp_replicate=2, dp_shard=2" in run.log
    assert_same_losses(run, ref)
    assert_node_health(run)
    nodes = {r["slowest_node"] for r in read_metrics(run.dump)} | {0}
    assert nodes <= {0, 1}


@pytest.mark.slow
@pytest.mark.runs(REFERENCE)
def test_two_nodes_across_network_namespaces(runs, batches):
    run = runs["netns"]
    if "skip" in run.info:
        pytest.skip(run.info["skip"])
    finished(run)
    assert_same_losses(run, batches.get(REFERENCE))
    assert_node_health(run)
    # The "nodes" share no loopback: everything between them went through the veth pair.
    assert run.info["netns"].bytes_through_veth() > 10_000_000


@pytest.mark.slow
@pytest.mark.runs(REFERENCE)
def test_killed_worker_restarts_and_resumes(runs, batches):
    ref, run = batches.get(REFERENCE), runs["job"]
    finished(run)
    log = run.log
    assert "rank 2 kills itself (SIGKILL) before step 3" in log, run.tail()
    assert re.search(r"checkpoint \S*step-2 loaded", log), run.tail()
    # Both attempts built the model (the second after torchrun's restart) and the run completed.
    assert log.count("[rank 0] INFO model llama3 debug_gqa") == 2, run.tail()
    steps = [r["step"] for r in read_metrics(run.dump)]
    assert steps[:2] == [1, 2] and steps[-3:] == [3, 4, 5], steps
    assert_same_losses(run, ref)
    summary = json.loads((run.dump / "summary.json").read_text())
    assert summary.get("status") == "completed", summary


@pytest.mark.slow
def test_hung_rank_fails_fast_naming_the_collective(runs):
    run = runs["hang"]
    assert run.returncodes[0] not in (0, None), f"return code {run.returncodes}:\n{run.tail()}"
    log = run.log
    line = next((l for l in log.splitlines() if "collective timed out on rank 0" in l), None)
    assert line is not None, run.tail()
    assert "after step 2" in line and "gloo:" in line and "process group" in line and "timeout 5000 ms" in line, line
    # Failed within comm.train_timeout_seconds of the hang, not the start-up timeout (300 s).
    stamp = lambda l: time.mktime(time.strptime(l[:19], "%Y-%m-%d %H:%M:%S"))  # noqa: E731
    step2 = next(l for l in log.splitlines() if re.search(r"\[rank 0\] INFO step +2 ", l))
    assert stamp(line) - stamp(step2) < 90, (step2, line)
