"""Parallel layouts' rules and float8 pieces, in this process (a one-rank gloo group where one is needed)."""

import pytest

from tests.support.processes import free_port


def test_tp_must_divide_heads():
    from trainer.config import ConfigError, load_config, validate

    def config(tp: int):
        return load_config(["--model.flavor", "llama3_8b", "--parallelism.tensor_parallel_degree", str(tp)], env={})

    with pytest.raises(ConfigError, match="key/value heads \\(8\\)"):  # 32 heads, 8 key/value heads
        validate(config(16), 16)
    validate(config(8), 16)


def test_float8_scale_precompute_runs_after_the_optimizer_step():
    """The hook computes every FSDP weight's float8 scale from the updated weights (this process, a one-rank
    gloo group)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.config import load_config
    from trainer.parallel.float8 import quiet_torchao_import, register_float8_scale_precompute

    with quiet_torchao_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        config = load_config(["--model.converters", "quantize.linear.float8",
                              "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                              "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"], env={})
        assert register_float8_scale_precompute(opt, [model], config)
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        for layer in model:
            local = layer.weight._local_tensor  # the float8-cast weight wrapper that carries the scale
            amax = local.detach().abs().max().float()
            expected = torch.finfo(torch.float8_e4m3fn).max / amax
            assert torch.allclose(local._precomputed_scale.float(), expected, rtol=1e-5), \
                (local._precomputed_scale, expected)
    finally:
        dist.destroy_process_group()


def test_float8_precompute_needs_float8_all_gather():
    from trainer.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match="needs enable_fsdp_float8_all_gather"):
        validate(load_config(["--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"], env={}))


def test_float8_all_gather_refused_on_cpu(tmp_path, monkeypatch, capsys):
    """gloo cannot all-gather float8: the trainer stops with a config error naming the key (the worker's
    config errors reach the launcher's one line as tests/e2e/test_launcher_errors.py shows)."""
    import torch

    from tests.support.launch import train_in_process

    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    rc, out = train_in_process(tmp_path, "--model.converters", "quantize.linear.float8",
                               "--quantize.linear.float8.enable_fsdp_float8_all_gather", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert rc == 2, out[-3000:] + err[-3000:]
    assert "gloo cannot all-gather float8" in out + err, out[-3000:] + err[-3000:]
