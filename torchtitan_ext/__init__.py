"""Capabilities beyond the torchtitan baseline. The core reaches them only through ``register``, which
trainer/extensions.py calls: config sections (config.py), their rules, the callbacks a run needs, and the
``trainer`` subcommands. Registration imports nothing heavy; the callbacks and commands load on first use."""

from __future__ import annotations

from torchtitan_ext.config import ALIASES, SECTION_DOC, ExtJobConfig


def register(registry) -> None:
    registry.add_sections(ExtJobConfig, SECTION_DOC)
    for former, current in ALIASES.items():
        registry.add_alias(former, current)
    registry.add_rule("torchtitan_ext.stability.config:check_config")
    registry.add_callbacks("torchtitan_ext.stability.callbacks:build_stability_callbacks")
    registry.add_rule("torchtitan_ext.evaluation.config:check_config")
    registry.add_callbacks("torchtitan_ext.evaluation.callback:build_eval_callbacks")
    registry.add_command("export", "torchtitan_ext.hf", "export a checkpoint to a Hugging Face Llama folder (safetensors)")
    registry.add_command("import", "torchtitan_ext.hf_import",
                         "turn a Hugging Face Llama folder into a seed checkpoint and the [model] keys to train with")
    registry.add_command("eval", "torchtitan_ext.lm_eval_model", "score a checkpoint or exported folder with lm-eval")
    registry.add_command("generate", "torchtitan_ext.generate", "sample text from a checkpoint")
    registry.add_command("compare", "torchtitan_ext.compare",
                         "compare loss curves of runs and reference CSVs (table + PNG)")
