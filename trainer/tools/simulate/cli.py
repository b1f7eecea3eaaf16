"""``trainer simulate``: build and step a config's layout on N simulated ranks, with the trainer's own code.

    trainer simulate --config train_configs/llama3_70b.toml --ngpu 256 [--layers N] [--ranks R,...]
                     [--json [FILE]] [--quiet] [--section.key value ...]

For each distinct rank role (with pipelining: the first, a middle and the last stage; without it every
rank is alike) one process-local simulation builds the rank's model parts (mesh, stage split,
parallelize, optimizer) over torch's fake process group and fake tensors, and runs one training step.
It prints, per role, the memory one GPU holds (parameters, gradients, optimizer state, FSDP's gathered
weights, activations at the peak), the FLOPs and the collectives of one micro-batch (kind, mesh
dimension, bytes), each beside the same quantity by formula: ``trainer plan``'s memory estimate, FLOPs
from the model's shape, collective volumes from the FSDP units and the TP plan; with the difference in %.

A layout that cannot be built (degrees that do not divide the heads, layers or batch) is refused in one
line before anything is built (exit 2). ``--layers N`` keeps the flavor's width but only N blocks: every
per-layer quantity is the same, and a big model simulates in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import sys
import time
import warnings
from typing import Any

from trainer.config import ConfigError, load_config

GiB = 2**30

# Rough seconds of simulation on a shared 2-core machine, with and without tensor parallel (DTensor dispatch
# is slower): per transformer block and micro-batch (forward + backward), per layer once (FSDP's lazy
# initialisation at the first forward, and the first clip and optimizer step working out the sharding of
# every parameter's ops: 18 s and 100 s of the 70B preset's 230 s at 256 ranks), and per role (process
# start, build). The TP figures were measured on that run; no_tp is scaled by the blocks' ratio.
SECONDS_PER_BLOCK = {"tp": 1.25, "no_tp": 0.6}
SECONDS_PER_LAYER_ONCE = {"tp": 1.5, "no_tp": 0.7}
SECONDS_PER_ROLE = 8.0
PATIENCE_S = 60  # beyond this a user is told how long it will take and how to make it shorter


# --------------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------------


class ProgressBar:
    """One bar per rank role on stderr: block forwards and backwards done (a backward weighs as two
    forwards), the phase, elapsed and remaining time. On a terminal it redraws one line; otherwise it
    prints a line every tenth and at phase changes. The time left comes from the pace since the first
    block finished (building the rank and the first block's one-off set-up would inflate it many times
    over) and is shown while blocks run; the optimizer's step after them is not counted."""

    WEIGHT = {"forward": 1, "backward": 2}

    def __init__(self, label: str, blocks: int, stream=None, width: int = 30):
        self.label, self.blocks, self.width = label, max(1, blocks), width
        self.stream = stream or sys.stderr
        self.done = {"forward": 0, "backward": 0}
        self.t0 = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_tenth = -1
        self.phase = "build"
        self.first: tuple[float, int] | None = None  # (time, units) when the first block was done

    def tick(self, phase: str) -> None:
        self.done[phase] += 1
        if self.first is None:
            self.first = (time.perf_counter(), self._units())
        self.set_phase(phase)

    def _units(self) -> int:
        return sum(self.WEIGHT[k] * n for k, n in self.done.items())

    def set_phase(self, phase: str) -> None:
        changed, self.phase = phase != self.phase, phase
        self.render(force=changed)

    def render(self, final: bool = False, force: bool = False) -> None:
        units = self._units()
        frac = min(1.0, units / (3 * self.blocks))
        now = time.perf_counter()
        elapsed = now - self.t0
        left = None
        if self.first is not None and units > self.first[1] and self.phase in self.WEIGHT and not final:
            pace = (now - self.first[0]) / (units - self.first[1])
            left = pace * max(0, 3 * self.blocks - units)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        text = (f"  {self.label:<14} [{bar}] forward {self.done['forward']}/{self.blocks}, backward "
                f"{self.done['backward']}/{self.blocks} blocks, {self.phase:<9} {elapsed:5.0f} s"
                + ("" if left is None else f", ~{left:.0f} s left"))
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
            self.stream.flush()
        elif final or force or int(frac * 10) > self.last_tenth:
            self.last_tenth = int(frac * 10)
            self.stream.write(text + "\n")
            self.stream.flush()


# --------------------------------------------------------------------------------------------------
# Running the roles
# --------------------------------------------------------------------------------------------------


def estimate_seconds(args, layout, roles: int) -> float:
    from trainer.tools.simulate.analytic import stage_of

    kind = "tp" if layout.dims.tp > 1 else "no_tp"
    plan = layout.stage_plan
    stages = plan.modules if plan else [None]
    layers = max(stage_of(args.n_layers, modules).layers for modules in stages)
    return roles * (SECONDS_PER_ROLE + layers * (SECONDS_PER_LAYER_ONCE[kind]
                                                 + SECONDS_PER_BLOCK[kind] * layout.microbatches))


def simulate_role(config, args, layout, world_size: int, rank: int, label: str, quiet: bool) -> dict:
    """Build and step one rank; returns its measurements and the analytic numbers beside them."""
    from trainer.tools.simulate import world
    from trainer.tools.simulate.step import run_step

    stage_layers = _stage_for_rank(args, layout, rank).layers
    bar = None if quiet else ProgressBar(label, stage_layers * layout.microbatches)
    t0 = time.perf_counter()
    mode = world.fake_mode()
    with world.fake_process_group(world_size, rank), world.isolated_sharding_propagation():
        view = world.build_rank_view(config, args, layout, rank, mode)
        build_s = time.perf_counter() - t0
        result = run_step(view, config, args, layout, mode, on_block=bar.tick if bar else None,
                          on_phase=bar.set_phase if bar else None)
        if bar:
            bar.phase = "done"
            bar.render(final=True)
        row = {"role": label, "rank": rank, "coordinate": view.coordinate, "stage_ids": view.stage_ids,
               "build_s": round(build_s, 2), "step_s": round(result.seconds, 2),
               "total_s": round(time.perf_counter() - t0, 2),
               "memory": result.memory, "peak_by_type": result.peak_by_type, "flops": result.flops,
               "collectives": result.collectives}
        row["analytic"] = analytic_for(config, args, layout, view)
    return row


def run_roles(config, args, layout, world_size: int, roles: list[tuple[str, int]], quiet: bool) -> list[dict]:
    """Each role in a fresh process: torch caches redistribution plans and sharding decisions per device
    mesh (meshes compare equal across process groups), so a second fake world in the same process would
    reuse the first one's groups."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context(role_start_method())
    rows = []
    for label, rank in roles:
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            future = pool.submit(_role_process, config, args, layout, world_size, rank, label, quiet)
            rows.append(future.result())
    return rows


def role_start_method() -> str:
    """How each role's process starts. fork where it is safe: the parent has built nothing (no process group,
    no caches), and a forked child skips the seconds of importing torch again. Where CUDA devices are visible,
    autograd starts a thread per device at a process's first backward pass, and a child forked after that
    cannot run autograd (torch refuses, or it hangs): a caller that trained before (a test, a notebook) would
    hang there, so each role starts a fresh interpreter (spawn) instead."""
    import multiprocessing

    import torch

    if "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_available():
        return "fork"
    return "spawn"


def _role_process(config, args, layout, world_size: int, rank: int, label: str, quiet: bool) -> dict:
    # A forked child inherits the parent's objects, some holding torch state that is not valid after a fork
    # (a garbage collection in the middle of a fake-tensor dispatch once crashed on them, under pytest).
    # freeze(): the collector never looks at what was inherited; disable(): no collection mid-dispatch, as the
    # training loop does. The child does one role and exits.
    gc.freeze()
    gc.disable()
    _quiet_torch()
    return simulate_role(config, args, layout, world_size, rank, label, quiet)


def _stage_for_rank(args, layout, rank: int):
    from trainer.tools.simulate.analytic import stage_of

    if layout.stage_plan is None:
        return stage_of(args.n_layers, None)
    pp_rank = rank // (layout.dims.world_size // layout.dims.pp)
    ids = layout.stage_plan.stages_of_rank(pp_rank, layout.dims.pp, layout.schedule)
    return stage_of(args.n_layers, layout.stage_plan.modules[ids[0]])


def analytic_for(config, args, layout, view) -> dict:
    """The formulas' numbers for this rank (bytes and FLOPs per micro-batch; see analytic.py)."""
    from trainer.parallel.parallelize import DTYPES
    from trainer.tools.plan.memory import Shape
    from trainer.tools.simulate import analytic

    s = Shape.from_args(args)
    dims, t = layout.dims, config.training
    stage = _stage_for_rank(args, layout, view.rank)
    c = DTYPES[t.mixed_precision_param].itemsize
    r = DTYPES[t.mixed_precision_reduce].itemsize
    tokens = t.local_batch_size * t.seq_len // dims.cp  # this rank's share of the sequences under CP
    from trainer.tools.plan.cli import ac_name

    ac = ac_name(config)
    comm = {}
    comm.update(analytic.fsdp_collectives(s, dims, stage, c, r, config.parallelism.fsdp_reshard_after_forward,
                                          last_moe=args.moe is not None and args.is_moe_layer(args.n_layers - 1)))
    comm.update(analytic.tp_collectives(s, dims, stage, tokens, c, ac))
    comm.update(analytic.ep_collectives(s, dims, stage, tokens, c, ac))
    cp_sequences = t.local_batch_size if dims.pp == 1 else config.parallelism.pipeline_parallel_microbatch_size
    cp_comm = analytic.cp_collectives(s, dims, stage, cp_sequences, t.seq_len, c, ac,
                                      config.parallelism.context_parallel_rotate_method)
    if dims.pp > 1:  # per micro-batch of the schedule, as many as the local batch holds
        cp_comm = {k: v * layout.microbatches for k, v in cp_comm.items()}
    comm.update(cp_comm)
    act_bytes = c if dims.fsdp_enabled else 4
    mb_tokens = config.parallelism.pipeline_parallel_microbatch_size * t.seq_len // dims.cp
    comm.update(analytic.pipeline_p2p(s, dims, stage, layout.microbatches, mb_tokens, act_bytes))
    if config.optimizer.name == "Muon":  # once per optimizer step
        ns_bytes = DTYPES[config.optimizer.muon.ns_dtype].itemsize
        comm.update(analytic.muon_collectives(s, dims, stage, view.coordinate, ns_bytes))
    elements = analytic.sharded_elements(view.param_shapes, dims)
    return {
        "param_bytes": 4 * elements,
        "param_tensors": len(view.param_shapes),
        "flops": analytic.step_flops(s, stage, tokens, t.seq_len, dims.tp, ac),
        "collectives": [{"kind": k, "group": g, "bytes": b} for (k, g), b in sorted(comm.items())],
        "plan_memory": analytic.plan_memory(s, dims, config, stage),
        "stage": dataclasses.asdict(stage),
    }


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _pct(sim: float, ref: float) -> str:
    if ref == 0:
        return "" if sim == 0 else "n/a"
    return f"{100 * (sim - ref) / ref:+.1f}%"


def memory_rows(row: dict) -> list[tuple[str, float, float | None]]:
    """(term, simulated bytes, plan bytes): persistent state, then the terms at the step's peak."""
    mem, plan = row["memory"], row["analytic"]["plan_memory"]
    peak = mem["peak"]
    return [
        ("params", mem["after_step"]["params"], plan["params"]),
        ("grads (after backward)", mem["after_backward"]["grads"], plan["grads"]),
        ("optimizer state", mem["after_step"]["optimizer"], plan["optimizer"]),
        ("grads at the peak", peak["grads"], None),
        ("gathered weights at the peak", peak["weight_copies"], plan["weight_copies"]),
        ("activations at the peak", peak["activations"], plan["activations"]),
        ("peak total", peak["total"], plan["total"]),
    ]


def collective_rows(row: dict) -> list[dict]:
    """Simulated collectives of one micro-batch summed over phases, joined with the analytic volumes."""
    sims: dict[tuple[str, str, int], list[int]] = {}
    for c in row["collectives"]:
        key = (c["kind"], c["group"], c["group_size"])
        acc = sims.setdefault(key, [0, 0])
        acc[0] += c["count"]
        acc[1] += c["bytes"]
    analytic = {(c["kind"], c["group"]): c["bytes"] for c in row["analytic"]["collectives"]}
    rows = []
    for (kind, group, size), (count, nbytes) in sorted(sims.items()):
        rows.append({"kind": kind, "group": group, "group_size": size, "count": count, "bytes": nbytes,
                     "analytic_bytes": analytic.pop((kind, group), None)})
    for (kind, group), nbytes in analytic.items():
        rows.append({"kind": kind, "group": group, "group_size": None, "count": 0, "bytes": 0,
                     "analytic_bytes": nbytes})
    return rows


def format_role(row: dict, accum: int) -> list[str]:
    coord = ", ".join(f"{k} {v}" for k, v in row["coordinate"].items())
    lines = [(f"{row['role']}: rank {row['rank']} ({coord})  built in {row['build_s']:.1f} s, step simulated "
              f"in {row['step_s']:.1f} s"),
             f"  {'memory per GPU (GiB)':<32} {'simulated':>10} {'plan':>10} {'diff':>8}"]
    for term, sim, plan in memory_rows(row):
        plan_s = "" if plan is None else f"{plan / GiB:10.3f}"
        diff = "" if plan is None else _pct(sim, plan)
        lines.append(f"    {term:<30} {sim / GiB:10.3f} {plan_s:>10} {diff:>8}")
    a = row["analytic"]
    plan = a["plan_memory"]
    lines.append(f"  (plan: {plan['precision']}, {plan['stage_layers']} layers per stage, the largest moment of the "
                 f"step; all terms at once {plan['sum'] / GiB:.3f} GiB)")
    sim_params = row["memory"]["after_step"]["params"]
    verdict = "equal" if sim_params == a["param_bytes"] else f"differ by {sim_params - a['param_bytes']:+,} B"
    lines.append(f"  parameter shards: {sim_params:,} B simulated, {a['param_bytes']:,} B by the layout: {verdict}")
    sim_flops = sum(row["flops"].values())
    f = a["flops"]
    lines.append(f"  FLOPs per micro-batch: {sim_flops / 1e12:,.2f} T simulated, {f['total'] / 1e12:,.2f} T by formula "
                 f"({_pct(sim_flops, f['total'])}; PaLM model FLOPs {f['model'] / 1e12:,.2f} T + flash-attention "
                 f"recompute {f['flash_recompute'] / 1e12:,.2f} T + AC recompute {f['ac_recompute'] / 1e12:,.2f} T)")
    lines.append(f"  collectives per micro-batch (x{accum} per optimizer step; the optimizer's own, e.g. Muon's "
                 "all_to_all, once per step):")
    lines.append(f"    {'kind':<15} {'group':<13} {'size':>5} {'count':>6} {'simulated GiB':>14} "
                 f"{'formula GiB':>12} {'diff':>8}")
    for c in collective_rows(row):
        ref = c["analytic_bytes"]
        ref_s = "" if ref is None else f"{ref / GiB:12.3f}"
        size = "" if c["group_size"] is None else str(c["group_size"])
        lines.append(f"    {c['kind']:<15} {c['group']:<13} {size:>5} {c['count']:>6} {c['bytes'] / GiB:14.3f} "
                     f"{ref_s:>12} {'' if ref is None else _pct(c['bytes'], ref):>8}")
    return lines


def format_report(report: dict) -> str:
    m = report["model"]
    pipeline = f"; {report['schedule']} with {report['microbatches']} micro-batches" if report["schedule"] else ""
    lines = [(f"simulate   {m['flavor']}: {m['n_layers']} layers{' (--layers)' if m['layers_override'] else ''}, "
              f"dim {m['dim']}, seq_len {m['seq_len']}, local batch {m['local_batch_size']}"),
             f"layout     {report['layout']}; {report['accum_steps']} micro-batch(es) per optimizer step{pipeline}",
             f"time       {report['seconds']:.1f} s for {len(report['roles'])} role(s)", ""]
    for row in report["roles"]:
        lines += format_role(row, report["accum_steps"]) + [""]
    if report["schedule"]:
        lines.append("note: with pipelining the FSDP volumes have no formula here (they depend on the schedule), and "
                     "the simulated activations include the fp32 gradients FSDP accumulates across micro-batches "
                     "(the tracker files them under Temp; plan counts them in its total)")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def simulate(config, ngpu: int, layers: int | None = None, ranks: list[int] | None = None,
             quiet: bool = True) -> dict[str, Any]:
    """Everything ``trainer simulate`` reports, as a JSON-able dict (raises ConfigError)."""
    from trainer.tools.plan.cli import model_args_for_plan
    from trainer.tools.simulate import world

    config, notes = world.simulation_config(config)
    if config.parallelism.expert_parallel_degree > 1:
        notes.append("expert parallel: the token exchange is sized for an evenly routed batch (the routing's "
                     "values are not simulated)")
    args, note = model_args_for_plan(config)
    if note:
        notes.append(note)
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"--layers must be at least 1, got {layers}")
        args = dataclasses.replace(args, n_layers=layers)
    layout = world.check_layout(config, args, ngpu)
    roles = world.role_ranks(layout.dims)
    if ranks:
        bad = [r for r in ranks if not 0 <= r < ngpu]
        if bad:
            raise ConfigError(f"--ranks {bad} outside the world of {ngpu} ranks")
        roles = [(f"rank {r}", r) for r in ranks]
    expected = estimate_seconds(args, layout, len(roles))
    if not quiet:
        _announce(expected, roles, layout, args)
    t0 = time.perf_counter()
    rows = run_roles(config, args, layout, ngpu, roles, quiet)
    t = config.training
    return {
        "model": {"flavor": config.model.flavor, "n_layers": args.n_layers, "layers_override": layers is not None,
                  "dim": args.dim, "seq_len": t.seq_len, "local_batch_size": t.local_batch_size},
        "ngpu": ngpu, "layout": layout.dims.describe(), "accum_steps": layout.accum_steps,
        "schedule": layout.schedule, "microbatches": layout.microbatches,
        "seconds": round(time.perf_counter() - t0, 1), "estimated_seconds": round(expected, 1),
        "roles": rows, "notes": notes,
    }


def _announce(expected: float, roles, layout, args) -> None:
    what = f"{len(roles)} rank role(s) of {layout.dims.describe()}"
    if expected > PATIENCE_S:
        print(f"simulating {what}: this takes about {expected / 60:.0f} min on this machine (one bar per role "
              f"below); --layers N shrinks the model to N of its {args.n_layers} blocks for a quicker answer",
              file=sys.stderr)
    else:
        print(f"simulating {what} (about {expected:.0f} s)", file=sys.stderr)


def _quiet_torch() -> None:
    """The simulation's harmless warnings (FSDP views, DTensor's sequential all-reduces) are not the user's."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="trainer simulate", allow_abbrev=False,
        description="Build and step a config's layout on N simulated ranks (fake process group, fake tensors) "
                    "and compare memory, FLOPs and collectives with the formulas. Other --section.key value "
                    "arguments override the config.")
    parser.add_argument("--config", required=False, help="TOML config (default: $CONFIG_FILE or built-in defaults)")
    parser.add_argument("--ngpu", type=int, required=True, help="world size to simulate")
    parser.add_argument("--layers", type=int, default=None, help="keep only N transformer blocks (faster)")
    parser.add_argument("--ranks", default=None, help="comma-separated ranks to simulate instead of one per role")
    parser.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to FILE, or stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args, overrides = parser.parse_known_args(argv)
    cfg_argv = (["--job.config_file", args.config] if args.config else []) + overrides
    _quiet_torch()
    try:
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    except ValueError:
        parser.error(f"--ranks takes comma-separated integers, got {args.ranks!r}")
    try:
        config = load_config(cfg_argv, env={} if args.config else None)
        report = simulate(config, args.ngpu, args.layers, ranks, quiet=args.quiet)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from trainer.tools.plan.cli import print_report

    print_report(report, format_report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
