"""Another node fails at start-up: this node's launcher says so in one line (exit 7), not with torchrun's
DistNetworkError traceback and a C++ stack. The other node is played by a process that hosts the c10d
rendezvous store (as the first node's launcher does) and dies once this node's launcher has joined."""

from __future__ import annotations

import sys
import textwrap

from tests.support.processes import free_port, kill_tree, popen, wait_for

HOST = textwrap.dedent("""
    import sys, time
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
    start = store.num_keys()
    print("ready", flush=True)
    while store.num_keys() <= start:  # the other launcher's rendezvous writes its first keys
        time.sleep(0.05)
    print("joined", flush=True)
    time.sleep(600)
""")


def test_launcher_losing_the_other_node_at_start_up_is_one_line(tmp_path):
    port = free_port()
    (tmp_path / "host.py").write_text(HOST)
    host_out = tmp_path / "host.out"
    with open(host_out, "w") as out:
        host = popen([sys.executable, str(tmp_path / "host.py"), str(port)], stdout=out, stderr=out)
    try:
        wait_for(lambda: "ready" in host_out.read_text(), "the other node's store", proc=host, log=host_out)
        launcher = popen([sys.executable, "-m", "trainer.launch", "--nnodes", "2", "--node-rank", "0",
                          "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-conf", "is_host=0", "-m", "trainer.train", "--job.dump_folder",
                          str(tmp_path / "out")], stdout=open(tmp_path / "l.out", "w"),
                         stderr=open(tmp_path / "l.err", "w"), cwd=tmp_path)
        wait_for(lambda: "joined" in host_out.read_text(), "this node joining the rendezvous", proc=host,
                 log=host_out)
    finally:
        kill_tree(host)  # the other node stops during start-up
    assert launcher.wait(timeout=300) == 7, (tmp_path / "l.err").read_text()
    err = (tmp_path / "l.err").read_text()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "frame #" not in err, err
    assert lines[0].startswith("error: node 0 lost the job's rendezvous") and "another node" in lines[0], err
    assert "DistNetworkError" in lines[0] and "torchrun's log" in lines[0], err
