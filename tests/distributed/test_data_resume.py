"""A run checkpointed with 2 data-parallel ranks resumes with 1 rank (same global batch) and continues with
exactly the data, and the loss, of an uninterrupted run (real processes, batched torchrun starts)."""

import pytest

from tests.support.batches import spec

COMMON = ["--lr_scheduler.decay_type", "constant", "--training.global_batch_size", "4", "--debug.deterministic",
          "--checkpoint.interval", "4", "--checkpoint.last_save_model_only", "false"]

STRAIGHT = spec("data_straight", 1, *COMMON, "--training.local_batch_size", "4", "--training.steps", "8")
DP2 = spec("data_dp2", 2, *COMMON, "--checkpoint.enable", "--training.local_batch_size", "2", "--training.steps", "4")
DP1 = spec("data_dp2_to_dp1", 1, *COMMON, "--checkpoint.enable", "--training.local_batch_size", "4",
           "--training.steps", "8", after=(DP2,), copy=((f"{{root}}/{DP2}/checkpoint", f"{{root}}/{DP2}_to_dp1/checkpoint"),))


@pytest.mark.slow
@pytest.mark.runs(STRAIGHT, DP2, DP1)
def test_two_ranks_to_one(batches):
    straight = batches.get(STRAIGHT).records()
    resumed = batches.get(DP1).records()
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step]["data_fingerprint"] == straight[step]["data_fingerprint"], step
        assert resumed[step]["tokens_seen"] == straight[step]["tokens_seen"]
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= 1e-5 * straight[step]["loss"]


# Token files other trainers wrote (tests/assets/token_files: megatron-core's builder, pyarrow's file writer), as a
# 3:1 mixture: two ranks for 4 steps, then one rank to 8, against one rank straight through.
TOKENS = ["--data.sources", "megatron:tests/assets/token_files/megatron,arrow:tests/assets/token_files/arrow",
          "--data.weights", "3,1", "--data.num_shards", "4", "--training.global_batch_size", "8", *COMMON[:2],
          "--debug.deterministic", "--checkpoint.interval", "4", "--checkpoint.last_save_model_only", "false"]
TOK_STRAIGHT = spec("tokfiles_straight", 1, *TOKENS, "--training.local_batch_size", "8", "--training.steps", "8")
TOK_DP2 = spec("tokfiles_dp2", 2, *TOKENS, "--checkpoint.enable", "--training.local_batch_size", "4",
               "--training.steps", "4")
TOK_DP1 = spec("tokfiles_dp2_to_dp1", 1, *TOKENS, "--checkpoint.enable", "--training.local_batch_size", "8",
               "--training.steps", "8", after=(TOK_DP2,),
               copy=((f"{{root}}/{TOK_DP2}/checkpoint", "{root}/tokfiles_dp2_to_dp1/checkpoint"),))


@pytest.mark.slow
@pytest.mark.runs(TOK_STRAIGHT, TOK_DP2, TOK_DP1)
def test_token_files_two_ranks_to_one_and_the_mixture_ratio(batches):
    import json

    straight = batches.get(TOK_STRAIGHT).records()
    run = batches.get(TOK_DP1)
    resumed = run.records()
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step]["data_fingerprint"] == straight[step]["data_fingerprint"], step
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= 1e-5 * straight[step]["loss"]
    # The mixture: every window is seq_len + 1 tokens, so the share of sequences is the share of tokens.
    state = json.loads((run.dump / "checkpoint" / "step-8" / "dataloader.json").read_text())
    per_source = [0, 0]
    for shard in state["shards"].values():
        for s, st in shard["sources"].items():
            per_source[int(s)] += st["sequences"]
    total = sum(per_source)
    assert total == 8 * 8
    # Each of the 4 shards keeps its prefix of choices within a sequence or two of the weights.
    assert abs(per_source[0] / total - 0.75) <= 4 * 1.5 / total, per_source
