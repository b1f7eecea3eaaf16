"""Frozen outputs of the inference paths: generation (library and ``trainer generate``), the lm-eval model
wrapper and ``trainer eval``, for a fixed tiny model (the debug flavor with seeded random weights, fp32, CPU).

The numbers in tests/assets/reference_outputs.json were recorded from the code before the model got its own
KV cache (when generate.py re-implemented attention and RoPE), so any change in what these tools compute
shows here: token ids must match exactly, log-likelihoods within 1e-5. Regenerate only for an intended
change of behaviour, and say why in the commit:

    PYTHONPATH=. python -m tests.test_reference_outputs --write
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from torchtitan_ext.generate import generate, main as generate_main  # noqa: E402
from torchtitan_ext.native import save_native_checkpoint  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.models.config import resolve_model_args  # noqa: E402
from trainer.data.tokenizer import load_tokenizer  # noqa: E402
from tests.support.models import fast_model  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "reference_outputs.json"
TASKS_DIR = Path(__file__).resolve().parents[1] / "assets" / "lm_eval_tasks"
SEQ_LEN = 64  # the in-process model's RoPE table; checkpoints load with the flavor's 2048
PROMPTS = ["ROMEO:", "JULIET: O gentle Romeo, if thou dost love"]
# Longer than SEQ_LEN tokens: generation cuts it from the left, loglikelihood_rolling needs several windows.
LONG_TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: "
             "You are all resolved rather to die than to famish? All: Resolved. resolved. First Citizen: First, "
             "you know Caius Marcius is chief enemy to the people.")
SAMPLING = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
LOGPROB_ATOL = 1e-5


def build_reference_model():
    """The debug flavor at seq_len 64 with seeded random weights (fp32, CPU), and its tokenizer."""
    config = load_config(["--model.flavor", "debug_gqa", "--training.seq_len", str(SEQ_LEN)], env={})
    tok = load_tokenizer(config)
    return config, tok, fast_model(resolve_model_args(config, tok.vocab_size), seed=0)


def forward_outputs(model) -> dict:
    """Next-token log-probs of the training forward on fixed tokens: guards the training path itself."""
    tokens = torch.randint(0, model.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(tokens).float(), dim=-1)
    picked = logprobs[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return {"next_token_logprobs": picked.tolist(), "argmax": logprobs.argmax(-1).tolist()}


def generate_outputs(model, tok) -> dict:
    """``generate`` on a left-padded batch of two prompts, greedy and sampled, with and without the KV cache;
    and a prompt longer than the RoPE table allows (cut from the left)."""
    prompts = [tok.encode(p, bos=True) for p in PROMPTS]
    out = {}
    for cache in (True, False):
        suffix = "kv_cache" if cache else "no_kv_cache"
        out[f"greedy_{suffix}"] = generate(model, prompts, 16, use_kv_cache=cache, pad_id=tok.pad_id)
        gen = torch.Generator().manual_seed(1234)
        out[f"sampled_{suffix}"] = generate(model, prompts, 16, use_kv_cache=cache, pad_id=tok.pad_id,
                                            generator=gen, **SAMPLING)
        out[f"long_prompt_greedy_{suffix}"] = generate(model, [tok.encode(LONG_TEXT, bos=True)], 8,
                                                       use_kv_cache=cache)
    return out


def generate_cli_outputs(dump: Path, tmp: Path) -> dict:
    """``trainer generate`` on a checkpoint: the token ids it writes to --output_json."""
    base = ["--checkpoint", str(dump), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max_new_tokens", "12",
            "--device", "cpu"]
    runs = {"greedy": ["--temperature", "0"],
            "sampled": ["--temperature", "0.8", "--top_k", "20", "--top_p", "0.9", "--seed", "7",
                        "--num_samples", "2"]}
    out = {}
    for name, extra in runs.items():
        for cache in (True, False):
            path = tmp / f"{name}_{cache}.json"
            argv = base + extra + ["--output_json", str(path)] + ([] if cache else ["--no_kv_cache"])
            assert generate_main(argv) == 0
            samples = json.loads(path.read_text())["samples"]
            out[f"{name}_{'kv_cache' if cache else 'no_kv_cache'}"] = [s["tokens"] for s in samples]
    return out


class _Request:
    """What lm-eval hands a model: an object with ``args``."""

    def __init__(self, *args):
        self.args = args


LOGLIKELIHOOD_REQUESTS = [("To be, or not to be:", " that is the question"), ("a b c", " d"),
                          ("First Citizen:", " Before we proceed"), ("x", " y z w"), (LONG_TEXT, " Citizen")]
GENERATE_REQUESTS = [("Hello", {"until": ["e"], "max_gen_toks": 5}),
                     ("First Citizen:", {"until": ["\n\n"], "max_gen_toks": 6}),
                     (LONG_TEXT, {"until": ["\n"], "max_gen_toks": 4})]


def lm_eval_outputs(model, tok, dump: Path) -> dict:
    """The lm-eval wrapper in-process (RoPE table 64: truncation and several rolling windows) and loaded
    from the checkpoint (context 2048)."""
    from torchtitan_ext.lm_eval_model import NativeLM

    out = {}
    for name, lm in (("in_process", NativeLM(model=model, tokenizer=tok, batch_size=2)),
                     ("checkpoint", NativeLM(str(dump), batch_size=3))):
        ll = lm.loglikelihood([_Request(*r) for r in LOGLIKELIHOOD_REQUESTS], disable_tqdm=True)
        out[name] = {
            "loglikelihood": [[logprob, greedy] for logprob, greedy in ll],
            "loglikelihood_rolling": lm.loglikelihood_rolling(
                [_Request("Shall I compare thee to a summer's day?"), _Request(LONG_TEXT)], disable_tqdm=True),
            "generate_until": lm.generate_until([_Request(*r) for r in GENERATE_REQUESTS], disable_tqdm=True),
        }
    return out


def trainer_eval_outputs(dump: Path, tmp: Path) -> dict:
    """``trainer eval --checkpoint`` on the local tiny tasks: every numeric metric."""
    from torchtitan_ext.lm_eval_model import main as eval_main

    path = tmp / "eval.json"
    assert eval_main(["--checkpoint", str(dump), "--tasks", "tiny_mc,tiny_ppl,tiny_gen", "--include_path",
                      str(TASKS_DIR), "--limit", "6", "--batch_size", "4", "--device", "cpu",
                      "--output_path", str(path)]) == 0
    results = json.loads(path.read_text())["results"]
    return {f"{task}/{key}": value for task, metrics in sorted(results.items()) for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in key}


def reference_setup(tmp: Path) -> dict:
    """The reference model, its tokenizer and its checkpoint (a dump folder with config.toml) under ``tmp``."""
    config, tok, model = build_reference_model()
    dump = tmp / "run"
    save_native_checkpoint(model.state_dict(), dump, step=3, config=config)
    return {"tmp": tmp, "tok": tok, "model": model, "dump": dump}


def compute_reference(tmp: Path) -> dict:
    s = reference_setup(tmp)
    return {"forward": forward_outputs(s["model"]), "generate": generate_outputs(s["model"], s["tok"]),
            "generate_cli": generate_cli_outputs(s["dump"], tmp),
            "lm_eval": lm_eval_outputs(s["model"], s["tok"], s["dump"]),
            "trainer_eval": trainer_eval_outputs(s["dump"], tmp)}


def assert_matches(actual, expected, path: str = "", rtol: float = 0.0) -> None:
    """Structures equal; ints, bools and strings exactly, floats within 1e-5 (plus ``rtol`` relative)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (path, actual, expected)
        for key in expected:
            assert_matches(actual[key], expected[key], f"{path}/{key}", rtol)
    elif isinstance(expected, list):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), (path, actual, expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_matches(a, e, f"{path}[{i}]", rtol)
    elif isinstance(expected, float):
        assert abs(actual - expected) <= LOGPROB_ATOL + rtol * abs(expected), (path, actual, expected)
    else:
        assert type(actual) is type(expected) and actual == expected, (path, actual, expected)


@pytest.fixture(scope="module")
def reference():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference_setup(tmp_path_factory.mktemp("reference"))


def test_training_forward_matches_reference(setup, reference):
    assert_matches(forward_outputs(setup["model"]), reference["forward"], "forward")


def test_generate_matches_reference(setup, reference):
    assert_matches(generate_outputs(setup["model"], setup["tok"]), reference["generate"], "generate")


def test_generate_cli_matches_reference(setup, reference):
    assert_matches(generate_cli_outputs(setup["dump"], setup["tmp"]), reference["generate_cli"], "generate_cli")


def test_lm_eval_wrapper_matches_reference(setup, reference):
    pytest.importorskip("lm_eval")
    actual = lm_eval_outputs(setup["model"], setup["tok"], setup["dump"])
    assert_matches(actual, reference["lm_eval"], "lm_eval")


def test_trainer_eval_matches_reference(setup, reference):
    pytest.importorskip("lm_eval")
    # Perplexities are exponentials of summed log-likelihoods: compare them relatively.
    assert_matches(trainer_eval_outputs(setup["dump"], setup["tmp"]), reference["trainer_eval"], "trainer_eval",
                   rtol=1e-5)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_reference_outputs --write  (re-records the fixture)")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        FIXTURE.write_text(json.dumps(compute_reference(Path(d)), indent=1) + "\n")
    print(f"wrote {FIXTURE}")
