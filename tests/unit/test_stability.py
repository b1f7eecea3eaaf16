"""Unit tests of the stability toolkit (torchtitan_ext/stability): no processes launched except one
2-rank gloo group for the vocabulary-sharded z-loss."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from torchtitan_ext.stability.callbacks import build_stability_callbacks
from torchtitan_ext.stability.config import normalize_ranges
from torchtitan_ext.stability.embedding import AlphaSchedule, EmbeddingGradShrink, shrink_embedding_grad
from torchtitan_ext.stability.faults import FaultInjection, random_tokens_like
from torchtitan_ext.stability.guard import StepGuard, StopTraining
from torchtitan_ext.stability.rewarmup import LRRewarmup
from torchtitan_ext.stability.skip import SkipRanges
from torchtitan_ext.stability.zloss import ZLoss, z_loss
from tests.support import children
from tests.support.models import seeded_model
from trainer.callbacks import CallbackList
from trainer.callbacks import RunView
from torchtitan_ext.config import ExtJobConfig
from trainer.config import ConfigError, load_config, validate
from trainer.optim.config import LRScheduler
from trainer.models.llama.args import LlamaModelArgs
from trainer.models.llama.model import Transformer
from trainer.optim.optimizer import LRSchedule


def make_config(**stability) -> ExtJobConfig:
    config = ExtJobConfig()
    for k, v in stability.items():
        setattr(config.stability, k, v)
    return config


def fake_trainer(config: ExtJobConfig | None = None, **kw) -> RunView:
    """The view callbacks get of a one-process run (no model needed by these tests)."""
    fields = dict(config=config or ExtJobConfig(), model_parts=[], model_args=SimpleNamespace(vocab_size=100),
                  tokenizer=SimpleNamespace(vocab_size=100), optimizer=None, lr_schedule=None,
                  state=SimpleNamespace(step=0, resumed_from_step=None), device=torch.device("cpu"),
                  dims=SimpleNamespace(dp=1), seed=0, dp_rank=0, accum_steps=1, pp_microbatches=None,
                  global_loss=lambda loss: loss, finish_checkpoints=lambda: None)
    fields.update(kw)
    return RunView(**fields)


# ------------------------------------------------------------------------------------------------ skip ranges


def test_skip_steps_from_toml_and_command_line(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[stability]\nskip_steps = [[10, 20], [25, 30]]\n")
    assert load_config(["--job.config_file", str(toml)], env={}).stability.skip_steps == [[10, 20], [25, 30]]
    cli = load_config(["--stability.skip_steps=10-20,25-30,40"], env={}).stability.skip_steps
    assert cli == [[10, 20], [25, 30], [40, 40]]
    # Overlapping and adjacent ranges merge; bad ranges are config errors naming the key.
    assert normalize_ranges([[25, 30], [10, 20], [21, 22], [28, 35]]) == [(10, 22), (25, 35)]
    with pytest.raises(ConfigError, match=r"stability.skip_steps\[0\]"):
        build_stability_callbacks(make_config(skip_steps=[[20, 10]]))
    with pytest.raises(ConfigError, match="stability.skip_steps"):
        normalize_ranges([[0, 3]])


def test_skip_ranges_decide_before_forward_and_count():
    cb = SkipRanges([[3, 5], [8, 8]])
    reasons = {s: cb.skip_before_forward(None, s) for s in range(1, 11)}
    assert [s for s, r in reasons.items() if r] == [3, 4, 5, 8]
    assert reasons[4] == "skip_steps 3-5" and reasons[8] == "skip_steps 8-8"
    assert cb.metrics(None, 10) == {"skipped_range_steps": 4}
    # Ranges may change on resume; the running count is checkpointed.
    resumed = SkipRanges([[12, 13]])
    resumed.load_state_dict(cb.state_dict())
    assert [s for s in range(11, 16) if resumed.skip_before_forward(None, s)] == [12, 13]
    assert resumed.metrics(None, 15) == {"skipped_range_steps": 6}


# ------------------------------------------------------------------------------------------------ step guard


def guard(**kw) -> StepGuard:
    cfg = dict(spike_guard=True, spike_window=5, spike_min_history=3, spike_sigma=3.0, max_consecutive_bad_steps=0)
    cfg.update(kw)
    config = make_config(**cfg)
    return StepGuard(config.stability, config)


def feed(g: StepGuard, values, start: int = 1, trainer=None) -> list[str | None]:
    """Steps as the loop runs them with a log every step: the verdict stays a device tensor, and the log
    step's metrics give the reason of a skip."""
    trainer = trainer or fake_trainer(g.config)
    reasons = []
    for i, (loss, gn) in enumerate(values):
        skip = g.should_skip(trainer, start + i, torch.tensor(loss), torch.tensor(gn))
        if skip is None:
            reasons.append(None)
            continue
        assert isinstance(skip, torch.Tensor) and skip.dtype == torch.bool and skip.ndim == 0
        reason = g.metrics(trainer, start + i).get("skip_reason")
        assert (reason is not None) == bool(skip)
        reasons.append(reason)
    return reasons


NORMAL = [(5.0, 1.0), (5.1, 1.1), (4.9, 0.9), (5.05, 1.0), (4.95, 1.05), (5.0, 0.95)]


def test_spike_guard_skips_spikes_and_adapts_to_a_new_level():
    g = guard()
    assert feed(g, [(5.0, 1.0)]) == [None]
    assert g.metrics(None, 1)["spike_loss_threshold"] is None  # no spread yet: logged as null
    # Too little history: even a huge value is accepted.
    assert feed(g, [(50.0, 1.0)], start=2) == [None]
    g = guard()
    assert feed(g, NORMAL) == [None] * 6
    window = g.window.chronological()
    assert len(window) == 5 and window[-1] == [5.0, pytest.approx(0.95)]
    # A loss spike and a grad-norm spike are each skipped, with their values in the reason.
    reasons = feed(g, [(9.0, 1.0)], start=7) + feed(guard(), NORMAL + [(5.0, 30.0)])[-1:]
    assert all(r and r.startswith("spike") for r in reasons), reasons
    assert "spike: loss 9 > 5.2" in reasons[0] and "spike: grad_norm 30 > 1.2" in reasons[1]
    assert "grad_norm 1)" in reasons[0] and "loss 5," in reasons[1]  # both values are always given
    m = g.metrics(None, 7)
    assert m["skipped_spike_steps"] == 1 and m["consecutive_bad_steps"] == 1 and m["spike_window"] == 5
    assert 5.0 < m["spike_loss_threshold"] < 9.0
    # As in OLMo-core, skipped values enter the window: the next step (normal) is accepted and resets the
    # streak, and a lasting new level is accepted after one skip instead of being skipped forever.
    assert g.window.chronological()[-1] == [9.0, 1.0]
    assert feed(g, [(5.02, 1.0)], start=8) == [None]
    assert g.metrics(None, 8)["consecutive_bad_steps"] == 0
    g = guard()
    feed(g, NORMAL)
    shifted = feed(g, [(8.0, 1.0), (8.1, 1.0), (7.9, 1.0), (8.0, 1.0)], start=7)
    assert shifted[0] is not None and shifted[1:] == [None, None, None]


def test_spike_metric_selects_what_is_watched():
    g = guard(spike_metric="loss")
    feed(g, NORMAL)
    assert feed(g, [(5.0, 30.0), (9.0, 1.0)], start=7)[0] is None
    g = guard(spike_metric="grad_norm")
    feed(g, NORMAL)
    assert feed(g, [(9.0, 1.0)], start=7) == [None]


def test_nonfinite_guard_skips_nan_and_inf_and_counts():
    g = guard(spike_guard=False)
    reasons = feed(g, [(5.0, 1.0), (float("nan"), 1.0), (5.0, float("inf")), (5.0, 1.0)])
    assert reasons[0] is None and reasons[3] is None
    assert "non-finite" in reasons[1] and "non-finite" in reasons[2]
    assert g.metrics(None, 4) == {"skipped_nonfinite_steps": 2, "consecutive_bad_steps": 0}
    # With the spike guard on too, a NaN is reported as non-finite and never enters the window.
    g = guard()
    feed(g, NORMAL)
    before = g.state_dict()
    assert "non-finite" in feed(g, [(float("nan"), float("nan"))], start=7)[0]
    assert {k: v for k, v in g.state_dict().items() if k.startswith("window")} == {
        k: v for k, v in before.items() if k.startswith("window")}
    # Both guards off: nothing is decided (and nothing synchronises).
    assert feed(guard(spike_guard=False, nonfinite_guard=False), [(float("nan"), 1.0)]) == [None]


def commit_marker(folder: Path, step: int) -> None:
    """What a finished save leaves (see trainer/checkpoint/layout.py): DCP metadata and the commit marker."""
    import json

    from trainer.checkpoint import layout as ckpt

    (folder / ckpt.DCP_METADATA).write_bytes(b"x" * 10)
    (folder / ckpt.MARKER).write_text(json.dumps({"format": ckpt.FORMAT_VERSION, "step": step,
                                                  "files": {ckpt.DCP_METADATA: 10}}))


def test_consecutive_bad_steps_stop_the_run_naming_the_last_good_checkpoint(tmp_path):
    config = make_config(spike_guard=False, max_consecutive_bad_steps=3)
    config.job.dump_folder = str(tmp_path)
    config.checkpoint.enable = True
    for s in (5, 10, 12, 20):
        (tmp_path / "checkpoint" / f"step-{s}").mkdir(parents=True)
        if s != 12:  # step-12 has no commit marker: an unfinished save, never named
            commit_marker(tmp_path / "checkpoint" / f"step-{s}", s)
    g = StepGuard(config.stability, config)
    finished = []
    trainer = fake_trainer(config, finish_checkpoints=lambda: finished.append(True))
    nan = (float("nan"), 1.0)
    feed(g, [(5.0, 1.0), nan, nan, (5.0, 1.0)], start=11, trainer=trainer)  # a streak of 2 resets
    feed(g, [nan, nan], start=15, trainer=trainer)
    with pytest.raises(StopTraining) as exc:
        feed(g, [nan], start=17, trainer=trainer)
    assert exc.value.exit_code == 3 and finished == [True]
    msg = str(exc.value)
    assert "3 consecutive bad steps (steps 15-17" in msg
    assert str(tmp_path / "checkpoint" / "step-10") in msg
    assert "--checkpoint.load_step 10 --stability.skip_steps=15-17" in msg
    # Without any checkpoint the message says so.
    config.checkpoint.enable = False
    config.job.dump_folder = str(tmp_path / "elsewhere")
    g = StepGuard(config.stability, config)
    with pytest.raises(StopTraining, match=r"No checkpoint in .*checkpoint.enable is false"):
        feed(g, [nan] * 3, trainer=fake_trainer(config))


def test_guard_config_is_validated():
    with pytest.raises(ConfigError, match="spike_min_history"):
        validate(load_config(["--stability.spike_guard", "--stability.spike_window", "5",
                              "--stability.spike_min_history", "10"], env={}))
    with pytest.raises(ConfigError, match="max_consecutive_bad_steps"):
        validate(load_config(["--stability.max_consecutive_bad_steps", "-1"], env={}))


def test_guard_state_survives_a_resume_exactly():
    values = NORMAL + [(9.0, 1.0), (float("nan"), 1.0), (5.01, 1.02), (5.2, 1.1), (4.8, 0.9)]
    later = [(5.03, 1.01), (7.0, 1.0), (5.0, 5.0), (4.97, 0.99)]
    a = guard()
    feed(a, values)
    state = a.state_dict()
    a_window = a.window.chronological()
    # The state is plain Python values (checkpoint-format friendly, window size free).
    assert set(state) == {"skipped_nonfinite", "skipped_spike", "consecutive_bad", "streak_start", "window_slots",
                          "window_pos", "window_size"}
    assert all(isinstance(v, (int, list)) for v in state.values())
    b = guard()
    b.load_state_dict(state)
    assert b.state_dict() == state
    start = len(values) + 1
    assert feed(a, later, start=start) == feed(b, later, start=start)
    assert a.state_dict() == b.state_dict() and a.metrics(None, 0) == b.metrics(None, 0)
    # A smaller window on resume keeps the newest entries.
    c = guard(spike_window=3)
    c.load_state_dict(state)
    c._window(torch.device("cpu"))
    assert c.window.chronological() == a_window[-3:]


# ------------------------------------------------------------------------------------------------ embedding


def tiny_model(seed: int = 0) -> Transformer:
    return seeded_model(LlamaModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                                       max_seq_len=16), seed)


def test_embedding_grad_shrink_scales_the_embedding_gradient_only():
    alpha = 0.25
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    base, shrunk = tiny_model(), tiny_model()
    cb = EmbeddingGradShrink(AlphaSchedule(alpha))
    assert cb.attach([shrunk]) == 1
    out_base, out_shrunk = base(tokens), shrunk(tokens)
    assert torch.equal(out_base, out_shrunk)  # forward bitwise unchanged
    out_base.square().mean().backward()
    out_shrunk.square().mean().backward()
    g_base, g_shrunk = base.tok_embeddings.weight.grad, shrunk.tok_embeddings.weight.grad
    assert g_base.abs().sum() > 0
    torch.testing.assert_close(g_shrunk, alpha * g_base, rtol=1e-5, atol=1e-8)
    for (name, p), q in zip(base.named_parameters(), shrunk.parameters()):
        if name != "tok_embeddings.weight":
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    # A pipeline stage without an embedding is simply not hooked; the function works on DTensor-like values.
    stage = tiny_model()
    stage.tok_embeddings = None
    assert EmbeddingGradShrink(AlphaSchedule(alpha)).attach([stage]) == 0
    x = torch.randn(3, requires_grad=True)
    shrink_embedding_grad(x, 0.5).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 0.5))


def test_embedding_alpha_schedule_metrics_and_state():
    sched = AlphaSchedule(alpha=0.1, alpha_start=1.0, steps=[10, 20])
    assert [sched(s) for s in (1, 10, 15, 20, 30)] == pytest.approx([1.0, 1.0, 0.55, 0.1, 0.1])
    assert AlphaSchedule(0.1)(1) == 0.1
    with pytest.raises(ConfigError, match="embedding_grad_alpha_steps"):
        validate(load_config(["--stability.embedding_grad_alpha_steps", "5"], env={}))
    with pytest.raises(ConfigError, match="embedding_grad_alpha "):
        validate(load_config(["--stability.embedding_grad_alpha", "1.5"], env={}))
    cb = EmbeddingGradShrink(sched)
    cb.on_batches(None, 15, [])
    assert cb.metrics(None, 15) == {"embedding_grad_alpha": pytest.approx(0.55)}
    other = EmbeddingGradShrink(sched)
    other.load_state_dict(cb.state_dict())
    assert other.alpha == cb.alpha
    off = EmbeddingGradShrink(sched, enabled=False)
    assert off.metrics(None, 15) == {} and off.attach is not None


# ------------------------------------------------------------------------------------------------ z-loss


def test_z_loss_value_and_callback():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    expected = 1e-3 * torch.logsumexp(logits, -1).pow(2).sum() / 10
    torch.testing.assert_close(z_loss(logits, 1e-3, 10), expected)
    cb = ZLoss(1e-3)
    cb.on_batches(None, 1, [])
    loss = torch.tensor(2.0)
    out = cb.extra_loss(None, logits, loss, 10)
    out = cb.extra_loss(None, logits, out, 10)  # two micro-batches
    torch.testing.assert_close(out, loss + 2 * expected)
    assert cb.metrics(fake_trainer(), 1)["z_loss"] == pytest.approx(2 * expected.item())
    assert ZLoss(0.0).extra_loss(None, logits, loss, 10) is loss and ZLoss(0.0).metrics(None, 1) == {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vocab_sharded_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = init_device_mesh("cpu", (world,))
        full = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)) * 5
        ref = full.clone().requires_grad_(True)
        z_ref = z_loss(ref, 0.1, 6)
        z_ref.backward()
        local = full.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
        logits = DTensor.from_local(local, mesh, [Shard(2)])
        # Through the callback, with a replicated DTensor loss as loss parallel produces.
        loss = DTensor.from_local(torch.tensor(1.0), mesh, [Replicate()])
        cb = ZLoss(0.1)
        total = cb.extra_loss(None, logits, loss, 6)
        total.to_local().backward()
        torch.save((float(total.to_local()), float(1.0 + z_ref), torch.allclose(
            local.grad, ref.grad.chunk(world, dim=-1)[rank], atol=1e-6)), Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_z_loss_on_vocabulary_sharded_dtensor_logits(tmp_path):
    """Loss parallel: logits sharded on the vocabulary over 2 ranks give the same z-loss and gradients."""
    children.call(_vocab_sharded_worker, 2, _free_port(), str(tmp_path), nprocs=2)
    for rank in (0, 1):
        value, expected, grads_match = torch.load(tmp_path / f"{rank}.pt")
        assert value == pytest.approx(expected, rel=1e-5)
        assert grads_match


# ------------------------------------------------------------------------------------------------ fault drills


def test_fault_injection_random_tokens_and_nonfinite_loss():
    batch = {"input": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4, 16, dtype=torch.long),
             "extra": torch.ones(1)}
    a = random_tokens_like(batch, 50, seed=7)
    b = random_tokens_like(batch, 50, seed=7)
    assert torch.equal(a["input"], b["input"]) and torch.equal(a["labels"], b["labels"])
    assert torch.equal(a["labels"][:, :-1], a["input"][:, 1:]) and a["extra"] is batch["extra"]
    assert 0 <= int(a["input"].min()) and int(a["input"].max()) < 50 and a["input"].float().std() > 5
    cb = FaultInjection(bad_data_steps=[3], nonfinite_loss_steps=[4])
    trainer = fake_trainer()
    assert cb.on_batches(trainer, 2, [batch])[0] is batch
    replaced = cb.on_batches(trainer, 3, [batch, batch])
    assert not torch.equal(replaced[0]["input"], replaced[1]["input"])  # each micro-batch its own tokens
    assert torch.isfinite(cb.extra_loss(trainer, None, torch.tensor(1.0), 1))
    cb.on_batches(trainer, 4, [batch])
    x = torch.tensor(1.0, requires_grad=True)
    loss = cb.extra_loss(trainer, None, x * 2, 1)
    loss.backward()
    assert math.isnan(loss.item()) and math.isnan(x.grad.item())
    assert cb.metrics(trainer, 4) == {"injected_nonfinite_loss": True}


# ------------------------------------------------------------------------------------------------ LR on resume


def test_lr_rewarmup_after_load_and_resume_time_schedule_changes():
    cfg = LRScheduler(warmup_steps=10, decay_type="linear", min_lr_factor=0.1)
    schedule = LRSchedule(cfg, base_lr=1.0, total_steps=1000)
    trainer = fake_trainer(lr_schedule=schedule, state=SimpleNamespace(step=500, resumed_from_step=500))
    cb = LRRewarmup(100)
    cb.on_checkpoint_loaded(trainer, 500)
    plain = LRSchedule(cfg, base_lr=1.0, total_steps=1000)
    assert schedule.lr(501) == pytest.approx(plain.lr(501) / 100)
    assert schedule.lr(550) == pytest.approx(plain.lr(550) * 0.5)
    assert schedule.lr(600) == pytest.approx(plain.lr(600))
    # No checkpoint loaded (the hook is not called) or re-warm-up off: nothing changes.
    s = LRSchedule(cfg, 1.0, 1000)
    LRRewarmup(100).on_batches(fake_trainer(lr_schedule=s), 1, [])
    LRRewarmup(0).on_checkpoint_loaded(fake_trainer(lr_schedule=s), 500)
    assert s.rewarmup_from is None
    # The schedule is a pure function of (step, config): a resumed run with new lr/warmup/min_lr_factor
    # gets exactly the new schedule's values from its first step.
    new = LRSchedule(LRScheduler(warmup_steps=20, decay_type="linear", min_lr_factor=0.3), 0.5, 1000)
    fresh = LRSchedule(LRScheduler(warmup_steps=20, decay_type="linear", min_lr_factor=0.3), 0.5, 1000)
    assert [new.lr(s) for s in (501, 700, 1000)] == [fresh.lr(s) for s in (501, 700, 1000)]
    assert new.lr(1000) == pytest.approx(0.5 * (0.3 + 0.7 / 980))  # torchtitan's schedule: one decay step left


# ------------------------------------------------------------------------------------------------ together


def test_checkpointed_state_has_the_same_keys_whatever_is_enabled():
    default = CallbackList(build_stability_callbacks(ExtJobConfig()))
    config = make_config(skip_steps=[[3, 4]], spike_guard=True, embedding_grad_shrink=True,
                         lr_rewarmup_steps_after_load=5)
    config.stability.z_loss_weight = 1e-4
    config.stability.inject_bad_data_steps = [2]
    everything = CallbackList(build_stability_callbacks(config))

    def keys(d, prefix=""):
        return {f"{prefix}{k}" for k, v in d.items()} | {
            x for k, v in d.items() if isinstance(v, dict) for x in keys(v, f"{prefix}{k}.")}

    assert keys(default.state_dict()) == keys(everything.state_dict())
    # A disabled toolkit decides nothing and adds no metrics beyond the default guard counters.
    trainer = fake_trainer()
    assert default.skip_before_forward(trainer, 3) is None
    assert everything.skip_before_forward(trainer, 3) == "skip_steps 3-4"
