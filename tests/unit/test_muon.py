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
