"""trainer simulate: one rank of a big layout built by the trainer's own code over a fake process group and
fake tensors, stepped once, and checked against the formulas: parameter shards exactly as the layout
divides them, FSDP and TP collective bytes of one step, FLOPs, and trainer plan's memory estimate."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.tools.simulate.cli import collective_rows, main, memory_rows, simulate

from tests.support.launch import ROOT

LLAMA3_8B = ROOT / "train_configs" / "llama3_8b.toml"
GiB = 2**30


def _config(*overrides: str):
    return load_config(["--job.config_file", str(LLAMA3_8B), *overrides], env={})


def _collectives(row: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["group"]): c for c in collective_rows(row)}


def _check_memory_and_flops(row: dict) -> None:
    # Parameter shards: every parameter's TP-local shape split over the FSDP shards, to the byte; fp32
    # gradients the same size, AdamW state twice that plus fused AdamW's float32 step count per parameter.
    mem, a = row["memory"], row["analytic"]
    assert mem["after_step"]["params"] == a["param_bytes"]
    assert mem["after_backward"]["grads"] == a["param_bytes"]
    assert mem["after_step"]["optimizer"] == 2 * a["param_bytes"] + 4 * a["param_tensors"]
    # FLOPs: the rank's share of the model's FLOPs plus what recomputation repeats.
    sim_flops = sum(row["flops"].values())
    assert sim_flops == pytest.approx(a["flops"]["total"], rel=0.01)
    # trainer plan's memory estimate for the same layout is within 10 % of the simulated peak.
    peak = {term: (sim, plan) for term, sim, plan in memory_rows(row)}["peak total"]
    assert peak[1] == pytest.approx(peak[0], rel=0.10), peak


def test_8b_shape_on_64_ranks_hsdp_fsdp_tp():
    """Llama 3 8B's width (2 of its 32 blocks) on 64 ranks: 2 replicas x FSDP 8 x TP 4. Ranks 0 and 63 (the
    last shard of every dimension) see the same numbers."""
    config = _config("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                     "8", "--parallelism.tensor_parallel_degree", "4", "--training.global_batch_size", "32",
                     "--activation_checkpoint.mode", "full")
    report = simulate(config, 64, layers=2, ranks=[0, 63])
    assert report["layout"] == "world 64: pp=1, dp_replicate=2, dp_shard=8, tp=4"
    assert report["accum_steps"] == 2
    first, last = report["roles"]
    assert last["coordinate"] == {"pp": 0, "dp_replicate": 1, "dp_shard": 7, "tp": 3}
    for row in (first, last):
        _check_memory_and_flops(row)
        comm = _collectives(row)
        # One micro-batch of FSDP: every unit all-gathered in bf16 (forward, and again in backward unless
        # kept), its gradient reduce-scattered in fp32 and all-reduced across the 2 replicas.
        for key in [("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("all_reduce", "dp_replicate"),
                    ("all_gather", "tp"), ("reduce_scatter", "tp")]:
            assert comm[key]["bytes"] == pytest.approx(comm[key]["analytic_bytes"], rel=0.01), key
        assert comm[("all_reduce", "dp_replicate")]["group_size"] == 2
        assert comm[("all_gather", "dp_shard")]["group_size"] == 8
    for key in ("memory", "flops", "collectives"):
        assert first[key] == last[key]


def test_pipeline_fsdp_tp_stages():
    """A smaller shape (4 blocks of the 8B width) on 8 ranks: 2 pipeline stages x FSDP 2 x TP 2, 1F1B over
    2 micro-batches. Each stage holds its own share of the parameters, to the byte."""
    config = _config("--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree",
                     "2", "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
                     "--training.local_batch_size", "2", "--training.global_batch_size", "4",
                     "--training.seq_len", "2048")
    report = simulate(config, 8, layers=4)
    assert report["schedule"] == "1F1B" and report["microbatches"] == 2
    first, last = report["roles"]
    assert (first["role"], first["stage_ids"], last["role"], last["stage_ids"]) == \
        ("first stage", [0], "last stage", [1])
    assert first["analytic"]["stage"] == {"layers": 2, "first": True, "last": False}
    for row in (first, last):
        _check_memory_and_flops(row)
        comm = _collectives(row)
        for key in [("all_gather", "tp"), ("reduce_scatter", "tp"), ("send", "pp"), ("recv", "pp")]:
            assert comm[key]["bytes"] == pytest.approx(comm[key]["analytic_bytes"], rel=0.01), key
        assert comm[("reduce_scatter", "dp_shard")]["count"] > 0
    # The first stage holds the embedding, the last the output layer (as large) and the final norm, whose
    # fp32 weight is split over the 2 FSDP shards.
    assert last["analytic"]["param_bytes"] - first["analytic"]["param_bytes"] == 4 * 4096 // 2


def test_llama4_scout_shape_on_64_ranks_with_tensor_parallel():
    """Llama 4 Scout's shape (2 of its 48 MoE blocks, the preset's full AC) on 64 ranks: FSDP 16 x TP 4, each
    expert's hidden units and the shared expert split over the TP ranks, the router replicated. Parameter
    shards to the byte, FLOPs (with the routed experts' recomputed w2), the TP and FSDP collectives, and trainer
    plan's memory."""
    config = load_config(["--job.config_file", str(ROOT / "train_configs" / "llama4_17bx16e.toml"),
                          "--parallelism.tensor_parallel_degree", "4"], env={})
    (row,) = simulate(config, 64, layers=2)["roles"]
    _check_memory_and_flops(row)
    comm = _collectives(row)
    for key in [("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("all_gather", "tp"),
                ("reduce_scatter", "tp")]:
        assert comm[key]["bytes"] == pytest.approx(comm[key]["analytic_bytes"], rel=0.01), key


def test_llama4_scout_shape_on_64_ranks_with_expert_parallel():
    """Scout's shape (2 blocks) on 64 ranks: HSDP 2 x FSDP 32 with expert parallel 4 (each rank holds 4 of the
    16 experts, sharded over the 8 ranks holding the same ones), the exchange sized for an even routing: the
    parameter shards to the byte, the experts' own all-gather and reduce-scatter over those 8 ranks, the
    replicas' all-reduce, and the token exchange (counts, copies out and back, forward and backward, again
    for the recomputed blocks)."""
    config = load_config(["--job.config_file", str(ROOT / "train_configs" / "llama4_17bx16e.toml"),
                          "--parallelism.expert_parallel_degree", "4",
                          "--parallelism.data_parallel_replicate_degree", "2"], env={})
    report = simulate(config, 64, layers=2)
    (row,) = report["roles"]
    assert report["layout"] == "world 64: pp=1, dp_replicate=2, dp_shard=32, ep=4, tp=1"
    _check_memory_and_flops(row)
    comm = _collectives(row)
    for key in [("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("all_gather", "efsdp"),
                ("reduce_scatter", "efsdp"), ("all_reduce", "dp_replicate"), ("all_to_all", "ep")]:
        assert comm[key]["bytes"] == pytest.approx(comm[key]["analytic_bytes"], rel=0.01), key
    assert (comm[("all_gather", "efsdp")]["group_size"], comm[("all_to_all", "ep")]["group_size"]) == (8, 4)
    assert any("evenly routed" in note for note in report["notes"])


@pytest.mark.parametrize("overrides, message", [
    (["--parallelism.tensor_parallel_degree", "3", "--parallelism.data_parallel_shard_degree", "2"],
     "must divide the number of attention heads"),
    (["--parallelism.pipeline_parallel_degree", "8", "--parallelism.data_parallel_shard_degree", "1",
      "--training.local_batch_size", "8"], "every stage needs a layer"),
    (["--parallelism.data_parallel_shard_degree", "8", "--training.global_batch_size", "100"],
     "must be a multiple of"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "4",
      "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--training.local_batch_size", "2"],
     "runs the single-stage pipeline schedules"),
])
def test_layouts_out_of_reach_refuse_in_one_line(overrides, message, capsys):
    ngpu = {"3": "6", "8": "8"}.get(overrides[1], "8")
    code = main(["--config", str(LLAMA3_8B), "--ngpu", ngpu, "--layers", "4", "--quiet",
                 "--parallelism.data_parallel_replicate_degree", "1", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_entry_and_progress(capfd):
    """``trainer simulate`` is a registered command; its report has the tables and a bar per role."""
    from trainer.cli import main as trainer_main

    code = trainer_main(["simulate", "--config", str(LLAMA3_8B), "--ngpu", "8", "--layers", "1",
                         "--parallelism.data_parallel_replicate_degree", "1",
                         "--parallelism.data_parallel_shard_degree", "8", "--training.global_batch_size", "-1",
                         "--training.seq_len", "1024"])
    captured = capfd.readouterr()  # the role runs in a child process: its bar goes to file descriptor 2
    assert code == 0
    assert "memory per GPU (GiB)" in captured.out and "reduce_scatter  dp_shard" in captured.out
    assert "parameter shards" in captured.out and ": equal" in captured.out
    assert "all ranks" in captured.err and "blocks" in captured.err


def test_the_up_front_estimate_of_the_70b_preset_is_its_measured_time():
    """`trainer simulate --config llama3_70b.toml --ngpu 256` took 230 s on the 2-core machine (block
    forwards and backwards 99 s, the first block's FSDP set-up 18 s, the first clip and optimizer step 100 s);
    it used to announce "about 1 min" (88 s)."""
    from trainer.tools.plan.cli import model_args_for_plan
    from trainer.tools.simulate import world
    from trainer.tools.simulate.cli import estimate_seconds

    config, _ = world.simulation_config(load_config(
        ["--job.config_file", str(ROOT / "train_configs" / "llama3_70b.toml")], env={}))
    args, _ = model_args_for_plan(config)
    layout = world.check_layout(config, args, 256)
    roles = world.role_ranks(layout.dims)
    assert 230 / 1.5 <= estimate_seconds(args, layout, len(roles)) <= 230 * 1.5


def test_progress_bar_time_left_follows_the_pace_after_the_first_block(monkeypatch):
    """A first block that takes long (set-up: 18 s for 70B) is not extrapolated over the others: with 80
    blocks at 1 s a unit after it, the time left is the remaining units at 1 s, not thousands of seconds;
    and none is shown during the optimizer's step, which the bar does not count."""
    import io

    from trainer.tools.simulate import cli

    clock = [0.0]
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock[0])
    out = io.StringIO()
    bar = cli.ProgressBar("all ranks", 80, stream=out)
    clock[0] = 23.0
    bar.tick("forward")  # the first block, after 5 s of build and 18 s of its own set-up
    for _ in range(23):
        clock[0] += 1.0
        bar.tick("forward")
    last = out.getvalue().strip().splitlines()[-1]
    assert "forward 24/80" in last and "~216 s left" in last, last  # 240 - 24 units at 1 s each
    bar.set_phase("optimizer")
    assert "left" not in out.getvalue().strip().splitlines()[-1]


def test_context_parallel_counts_local_tokens_and_its_collectives():
    """CP 2 beside FSDP 2 (one block of the 8B) against FSDP 4 at the same tokens per rank: the parameters
    are sharded over dp_shard x cp, the memory is the same (simulated and planned), the FLOPs are those of
    the rank's half of each sequence against all its keys, and the K/V all-gather over cp and its backward
    are the formula's bytes."""
    cp = simulate(_config("--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree",
                          "2", "--training.seq_len", "1024", "--training.global_batch_size", "2"), 4, layers=1)
    fsdp = simulate(_config("--parallelism.data_parallel_shard_degree", "4", "--training.seq_len", "512",
                            "--training.global_batch_size", "4"), 4, layers=1)
    assert cp["layout"] == "world 4: pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1"
    (row,), (ref,) = cp["roles"], fsdp["roles"]
    mem, a = row["memory"], row["analytic"]
    assert mem["after_step"]["params"] == a["param_bytes"] == ref["analytic"]["param_bytes"]
    assert sum(row["flops"].values()) == pytest.approx(a["flops"]["total"], rel=0.01)
    # Attention of 512 local queries over 1024 keys: more than FSDP 4's 512 over 512, the rest the same.
    assert a["flops"]["total"] > ref["analytic"]["flops"]["total"]
    for (term, sim, plan), (_, sim_ref, plan_ref) in zip(memory_rows(row), memory_rows(ref)):
        assert sim == pytest.approx(sim_ref, rel=0.01), term
        assert plan == (None if plan_ref is None else pytest.approx(plan_ref, rel=0.01)), term
    comm = _collectives(row)
    for key in [("all_gather", "cp"), ("all_to_all", "cp"), ("all_gather", "dp_shard_cp"),
                ("reduce_scatter", "dp_shard_cp")]:
        assert comm[key]["bytes"] == pytest.approx(comm[key]["analytic_bytes"], rel=0.01), key
    assert comm[("all_gather", "cp")]["group_size"] == 2 and comm[("all_gather", "dp_shard_cp")]["group_size"] == 4


def test_roles_fork_unless_cuda_devices_are_visible(monkeypatch):
    """Where CUDA devices are visible, a process that ran a backward pass holds autograd's device threads, and a
    forked child cannot run autograd (it hung under pytest on a GPU machine): each role is spawned there."""
    import multiprocessing

    import torch

    from trainer.tools.simulate.cli import role_start_method

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert role_start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert role_start_method() == ("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def test_llama4_scout_shape_on_64_ranks_shards_experts_on_their_hidden_dimension():
    """Llama 4 Scout's shape (2 of its 48 blocks, 16 experts each) on FSDP 64: the experts are sharded on their
    hidden dimension (16 experts over 64 ranks on dim 0 would pad each rank to a whole expert: 2.9x the
    parameters), so each rank holds 1/64 of the model; the grouped matrix multiplies' FLOPs and FSDP's bytes
    are the formulas'."""
    config = load_config(["--job.config_file", str(ROOT / "train_configs" / "llama4_17bx16e.toml")], env={})
    (row,) = simulate(config, 64, layers=2)["roles"]
    mem, a = row["memory"], row["analytic"]
    assert mem["after_step"]["params"] == a["param_bytes"]
    total = 6_473_180_160  # count_params of the 2-block model: 2 x 2.2B blocks + 2 x 1.03B embedding/output
    assert a["param_bytes"] == pytest.approx(4 * total / 64, rel=1e-3)
    assert sum(row["flops"].values()) == pytest.approx(a["flops"]["total"], rel=0.02)
    comm = _collectives(row)
    for key in [("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard")]:
        assert comm[key]["bytes"] == pytest.approx(comm[key]["analytic_bytes"], rel=0.01), key
