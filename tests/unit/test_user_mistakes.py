"""Mistakes a user makes in the config and on the command line: one line naming the cause and the fix."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError


def test_a_config_folder_instead_of_a_file_names_its_toml_files(tmp_path):
    (tmp_path / "mine.toml").write_text("[training]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"is a folder; name a TOML file, such as one in it \(mine.toml\)"):
        load_config(["--job.config_file", str(tmp_path)], env={})


def test_a_toml_with_a_byte_order_mark_gets_the_hint(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[training]\nsteps = 3\n")
    with pytest.raises(ConfigError, match="byte-order mark.*save it as UTF-8 without BOM"):
        load_config(["--job.config_file", str(path)], env={})
    path.write_bytes(b"[training\nsteps = 3\n")  # other TOML mistakes get no such hint
    with pytest.raises(ConfigError) as e:
        load_config(["--job.config_file", str(path)], env={})
    assert "byte-order" not in str(e.value)


def test_no_prefix_sets_an_optional_boolean_to_false():
    """README: ``--section.no_key`` sets a boolean to false; model.tie_word_embeddings is one whose unset
    value (None) means the flavor's."""
    assert load_config(["--model.no_tie_word_embeddings"], env={}).model.tie_word_embeddings is False
    assert load_config(["--model.tie_word_embeddings"], env={}).model.tie_word_embeddings is True
    assert load_config([], env={}).model.tie_word_embeddings is None
    with pytest.raises(ConfigError, match="unknown config key 'model.no_dim'"):
        load_config(["--model.no_dim"], env={})  # not a boolean


@pytest.mark.parametrize("args, word", [(["--temperature", "-1"], "--temperature must be >= 0"),
                                        (["--top_k", "-2"], "--top_k must be >= 0"),
                                        (["--num_samples", "0"], "--num_samples must be >= 1")])
def test_generate_refuses_impossible_sampling_settings(args, word, tmp_path, capsys):
    from torchtitan_ext.generate import main

    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(tmp_path), *args])  # refused before any checkpoint is read
    assert e.value.code == 2 and word in capsys.readouterr().err


def test_prepare_output_must_be_a_folder_for_tokens_only(tmp_path, capsys):
    from trainer.data.cli import main

    source = ["--training.dataset", "jsonl", "--training.dataset_path",
              str(tmp_path.parent / "none.jsonl")]  # never read: the output is refused first
    (tmp_path / "afile").write_text("x")
    assert main(["prepare", "--output", str(tmp_path / "afile"), "--no-progress", *source]) == 2
    assert "is a file; name a folder" in capsys.readouterr().err
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main(["prepare", "--output", str(other), "--overwrite", "--no-progress", *source]) == 2
    assert "holds other files" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep me"  # --overwrite never deletes a folder of other files


def test_exported_safetensors_are_readable_as_the_umask_allows(tmp_path):
    """safetensors alone writes 0600 files; an export is for colleagues on a shared cluster too."""
    import os
    import stat

    import torch

    from torchtitan_ext.hf import save_safetensors_sharded

    for umask, mode in ((0o022, 0o644), (0o002, 0o664)):
        old = os.umask(umask)
        try:
            folder = tmp_path / f"u{umask:o}"
            folder.mkdir()
            names = save_safetensors_sharded({"a": torch.zeros(64), "b": torch.ones(64)}, folder, 300)
        finally:
            os.umask(old)
        assert len(names) == 2
        assert {stat.S_IMODE((folder / n).stat().st_mode) for n in names} == {mode}


def test_export_to_a_file_is_one_line(tmp_path, capsys):
    from torchtitan_ext.hf import main as export_main

    target = tmp_path / "model.bin"
    target.write_text("someone's file")
    assert export_main(["--checkpoint", str(tmp_path), "--output", str(target)]) == 2
    assert "--output" in capsys.readouterr().err and target.read_text() == "someone's file"


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_the_run(tmp_path):
    from trainer.config import validate

    (tmp_path / "checkpoint").write_text("not a folder")
    argv = ["--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
    with pytest.raises(ConfigError, match="checkpoint.folder: .* is a file; name a folder"):
        validate(load_config(argv, env={}), 1)
    validate(load_config([*argv, "--checkpoint.folder", "ckpt"], env={}), 1)  # another name is fine
    validate(load_config(argv[:2], env={}), 1)  # checkpoints off: nothing will be written there


def test_command_line_sources_replace_a_preset_dataset_and_say_so(tmp_path, caplog):
    """The presets set training.dataset; --data.sources on the command line wins, as the command line does
    for any key, and the log names what it replaced. Both in one place is still refused."""
    import logging

    from trainer.config import validate

    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "hello there"}\n' * 50)
    preset = tmp_path / "preset.toml"
    preset.write_text('[training]\ndataset = "shakespeare"\n')
    with caplog.at_level(logging.INFO, logger="trainer"):
        config = load_config(["--job.config_file", str(preset), "--data.sources", f"jsonl:{data}",
                              "--data.num_shards", "1"], env={})
    validate(config)
    assert f'replaces training.dataset = "shakespeare" of {preset}' in caplog.text
    with pytest.raises(ConfigError, match="set either data.sources or training.dataset, not both"):
        validate(load_config(["--training.dataset", "shakespeare", "--data.sources", f"jsonl:{data}"], env={}))
    both = tmp_path / "both.toml"
    both.write_text(f'[training]\ndataset = "shakespeare"\n[data]\nsources = ["jsonl:{data}"]\n')
    with pytest.raises(ConfigError, match="not both"):
        validate(load_config(["--job.config_file", str(both)], env={}))


def test_an_empty_data_file_is_named_as_empty_not_as_too_many_shards(tmp_path):
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer
    from trainer.data.loader import build_train_loader

    tok = build_tokenizer(DEBUG_TOKENIZER_PATH)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = load_config(["--training.dataset", "jsonl", "--training.dataset_path", str(empty)], env={})
    with pytest.raises(ConfigError, match="holds no document") as e:
        build_train_loader(config, tok, dp_rank=0, dp_world_size=1)
    assert "num_shards" not in str(e.value)
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "one document"}\n')  # data, but fewer documents than shards
    config = load_config(["--training.dataset", "jsonl", "--training.dataset_path", str(small),
                          "--data.num_shards", "64"], env={})  # asked for: refused, naming the key
    with pytest.raises(ConfigError, match="lower data.num_shards"):
        build_train_loader(config, tok, dp_rank=0, dp_world_size=1)


def test_default_num_shards_is_lowered_to_what_a_small_file_fills(tmp_path, caplog):
    """data.num_shards left at its default (64) and a file of 5 documents: the loader uses the largest
    count the data fills that the data-parallel degree divides, and says so in one line."""
    import logging

    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer
    from trainer.data.loader import build_train_loader

    tok = build_tokenizer(DEBUG_TOKENIZER_PATH)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(f'{{"text": "document number {i} with a few words"}}\n' for i in range(5)))
    config = load_config(["--training.dataset", "jsonl", "--training.dataset_path", str(small),
                          "--training.local_batch_size", "1"], env={})
    assert not config.explicitly_set("data.num_shards") and config.data.num_shards == 64
    with caplog.at_level(logging.INFO):
        assert build_train_loader(config, tok, dp_rank=0, dp_world_size=2).plan.num_shards == 4
        assert build_train_loader(config, tok, dp_rank=0, dp_world_size=1).plan.num_shards == 5
    lines = [r.getMessage() for r in caplog.records if "data.num_shards" in r.getMessage()]
    assert len(lines) == 2 and "using 4" in lines[0] and "set data.num_shards" in lines[0], lines
    with pytest.raises(ConfigError, match="too few documents for 8 data-parallel ranks"):  # no count fits
        build_train_loader(config, tok, dp_rank=0, dp_world_size=8)
