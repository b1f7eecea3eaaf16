"""optimizer.name = "Muon" on one process: torch.optim.Muon on the block matrices plus torch's AdamW on the
rest, bit for bit; the parameter split; the skip verdict; the LR schedule on both parts; the config's
refusals. (Sharded runs: tests/distributed/test_muon.py.)"""

import pytest
import torch

from trainer.config import ConfigError, load_config, validate
from trainer.optim.config import Muon, Optimizer, LRScheduler
from trainer.optim.muon import MuonWithAdamW, orthogonalise
from trainer.optim.optimizer import LRSchedule, build_optimizer


def _model():
    from trainer.models.llama.args import LlamaModelArgs
    from trainer.models.llama.model import Transformer

    torch.manual_seed(0)
    model = Transformer(LlamaModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16))
    model.init_weights()
    return model


def _is_block_matrix(name, p):
    return name.startswith("layers.") and p.ndim == 2


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _reference(model, muon_lr, adamw_lr, **muon_kwargs):
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if _is_block_matrix(n, p)], lr=muon_lr, weight_decay=0.05,
                            **muon_kwargs)
    rest = [(n, p) for n, p in named if not _is_block_matrix(n, p)]
    adamw = torch.optim.AdamW([{"params": [p for _, p in rest if p.ndim >= 2], "weight_decay": 0.1},
                               {"params": [p for _, p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=adamw_lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    return muon, adamw


@pytest.mark.parametrize("adjust_lr_fn,nesterov", [(None, True), ("match_rms_adamw", False)])
def test_muon_is_torchs_muon_plus_adamw_for_ten_steps(adjust_lr_fn, nesterov):
    """Ten steps under a warmup-decay schedule: every weight equals torch.optim.Muon's (block matrices) and
    torch.optim.AdamW's (embedding, output, norms) bit for bit, each part at its own peak lr times the same
    schedule factor."""
    ours, theirs = _model(), _model()
    cfg = Optimizer(name="Muon", lr=3e-3, implementation="for-loop",
                    muon=Muon(lr=0.02, weight_decay=0.05, adjust_lr_fn=adjust_lr_fn, nesterov=nesterov))
    opt = build_optimizer(list(ours.named_parameters()), cfg)
    assert isinstance(opt, MuonWithAdamW)
    muon, adamw = _reference(theirs, 0.02, 3e-3, adjust_lr_fn=adjust_lr_fn, nesterov=nesterov)
    schedule = LRSchedule(LRScheduler(warmup_steps=3, decay_type="cosine", min_lr_factor=0.1), 3e-3, 10)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 11):
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        schedule.apply(opt, step)
        f = schedule.factor(step)
        for g in muon.param_groups:
            g["lr"] = 0.02 * f
        for g in adamw.param_groups:
            g["lr"] = 3e-3 * f
        _loss(ours, tokens).backward()
        _loss(theirs, tokens).backward()
        opt.step_or_skip(torch.tensor(False))
        muon.step()
        adamw.step()
        for o in (opt, muon, adamw):
            o.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(ours.layers["0"].attention.wq.weight, _model().layers["0"].attention.wq.weight)
    assert opt.orthogonalised.tolist() == [10] * 14  # 7 matrices a block, each once a step


def test_split_block_matrices_to_muon_the_rest_to_adamw():
    model = _model()
    opt = build_optimizer(list(model.named_parameters()), Optimizer(name="Muon", implementation="for-loop"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = opt.param_groups
    assert muon["muon"] and sorted({names[id(p)].split(".", 2)[2] for p in muon["params"]}) == [
        "attention.wk.weight", "attention.wo.weight", "attention.wq.weight", "attention.wv.weight",
        "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"]
    assert len(muon["params"]) == 14
    assert sorted(names[id(p)] for p in decay["params"]) == ["output.weight", "tok_embeddings.weight"]
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    # None: AdamW's lr and weight decay (Moonlight's recipe)
    assert muon["lr"] == decay["lr"] == 8e-4 and muon["weight_decay"] == 0.1
    assert opt.base_lrs == [8e-4] * 3


def test_a_skipped_step_changes_nothing():
    model = _model()
    opt = build_optimizer(list(model.named_parameters()), Optimizer(name="Muon", lr=3e-3, implementation="for-loop"))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for verdict in (torch.tensor(False), torch.tensor(True)):
        _loss(model, tokens).backward()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        counts = opt.orthogonalised.clone()
        opt.step_or_skip(verdict)
        opt.zero_grad()
    after = {id(p): s for p, s in opt.state.items()}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert state.keys() == after.keys() and len(state) == len(list(model.parameters()))
    assert all(torch.equal(state[i][k], after[i][k]) for i in state for k in state[i])
    assert torch.equal(counts, opt.orthogonalised)


def test_state_dict_round_trip_restores_the_adamw_link():
    """A loaded state dict replaces the optimizer's state and groups; AdamW's part must step on the new ones."""
    model = _model()
    opt = build_optimizer(list(model.named_parameters()), Optimizer(name="Muon", implementation="for-loop"))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    _loss(model, tokens).backward()
    opt.step()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    opt.param_groups[1]["lr"] = 0.5
    assert opt._adamw.param_groups[0] is opt.param_groups[1] and opt._adamw.state is opt.state
    assert {"momentum_buffer"} == set(opt.state[opt.param_groups[0]["params"][0]])


def test_float32_newton_schulz_is_close_to_bfloat16s():
    m = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    coefficients = (3.4445, -4.775, 2.0315)
    bf16 = orthogonalise(m, coefficients, 5, 1e-7, torch.bfloat16)
    fp32 = orthogonalise(m, coefficients, 5, 1e-7, torch.float32)
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32 and fp32.shape == (24, 16)
    assert 0 < (bf16.float() - fp32).abs().max() < 0.05


@pytest.mark.parametrize("args,message", [
    (["--optimizer.muon.momentum", "0.9"], "optimizer.muon.momentum is set but optimizer.name is 'AdamW'"),
    (["--optimizer.name", "Muon", "--optimizer.muon.momentum", "1.0"], "optimizer.muon.momentum must be in [0, 1)"),
    (["--optimizer.name", "Muon", "--optimizer.muon.ns_steps", "0"], "optimizer.muon.ns_steps must be in [1, 99]"),
    (["--optimizer.name", "Muon", "--optimizer.muon.ns_coefficients", "1,2"], "must hold three numbers"),
    (["--optimizer.name", "Muon", "--optimizer.muon.lr", "0"], "optimizer.muon.lr must be > 0"),
    (["--optimizer.name", "Muon", "--optimizer.muon.eps", "0"], "optimizer.muon.eps must be > 0"),
    (["--optimizer.name", "Muon", "--optimizer.muon.weight_decay", "-1"], "optimizer.muon.weight_decay must be >= 0"),
    (["--optimizer.name", "Muon", "--optimizer.muon.adjust_lr_fn", "spectral"], "adjust_lr_fn"),
    (["--optimizer.name", "Muon", "--training.enable_cpu_offload"], "enable_cpu_offload is not supported"),
])
def test_config_refusals(args, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(args, env={}))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_muon_keys_are_accepted_with_muon():
    c = load_config(["--optimizer.name", "Muon", "--optimizer.muon.adjust_lr_fn", "match_rms_adamw",
                     "--optimizer.muon.ns_coefficients", "3,-4,2", "--optimizer.muon.ns_dtype", "float32"], env={})
    validate(c)
    assert c.optimizer.muon.ns_coefficients == [3.0, -4.0, 2.0] and c.optimizer.muon.lr is None


def test_plan_counts_one_state_per_muon_matrix_and_the_exchange(capsys):
    """trainer plan: Muon's matrices hold one fp32 state (4 B) where AdamW holds two; the rest stays at 8 B;
    the report gives Muon's exchange per step."""
    from trainer.tools.plan.cli import main
    from trainer.tools.plan.memory import Layout, Shape, memory_estimate, muon_exchange_bytes
    from trainer.models.llama.args import LlamaModelArgs

    s = Shape.from_args(LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128))
    layout = Layout(1, 2, 2, 1, 1, 8)
    adamw, muon = (memory_estimate(s, layout, optimizer=o)["optimizer"] for o in ("AdamW", "Muon"))
    assert adamw - muon == 4 * 2 * s.layer_matrices / 4
    exchange = muon_exchange_bytes(s, 2, 4, group_rank=1)
    assert exchange["gather"] == 2 * 2 * s.layer_matrices / 4
    h, kv, f = s.dim, s.kv_dim, s.ffn
    # group rank 1 of 4 owns matrices 1, 5, 9, 13 of 14: wk and w2 of block 0, wv and w3 of block 1
    assert exchange["scatter"] == 2 * 2 * (kv * h + h * f)
    assert main(["--config", "train_configs/debug_model.toml", "--ngpu", "2", "--optimizer.name", "Muon"]) == 0
    assert "Muon's exchange:" in capsys.readouterr().out


def test_simulate_counts_muons_exchange_and_state():
    """trainer simulate with Muon on FSDP 2 x TP 2: the two all-to-alls over the dp_shard x tp group move what
    the formula says, and the optimizer state is what trainer plan counts."""
    from trainer.tools.simulate.cli import collective_rows, memory_rows, simulate

    config = load_config(["--job.config_file", "train_configs/debug_model.toml", "--parallelism.data_parallel_shard_degree",
                          "2", "--parallelism.tensor_parallel_degree", "2", "--training.global_batch_size", "2",
                          "--training.local_batch_size", "1", "--training.seq_len", "64", "--optimizer.name", "Muon"],
                         env={})
    row = simulate(config, 4, layers=2, ranks=[1])["roles"][0]
    a2a = [c for c in collective_rows(row) if c["kind"] == "all_to_all"]
    assert [(c["group"], c["group_size"], c["count"]) for c in a2a] == [("dp_shard+tp", 4, 2)]
    assert a2a[0]["bytes"] == a2a[0]["analytic_bytes"] > 0
    state = {term: (sim, plan) for term, sim, plan in memory_rows(row)}["optimizer state"]
    assert state[0] == pytest.approx(state[1], rel=1e-4)  # the plan leaves out AdamW's step counters (4 B each)
    assert state[0] < 0.75 * 2 * row["analytic"]["param_bytes"]  # AdamW's two states would be twice the params
