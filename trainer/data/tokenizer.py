"""The run's tokenizer, from the config."""

from __future__ import annotations

from trainer.errors import ConfigError


def load_tokenizer(config):
    """model.tokenizer_path, or the bundled debug tokenizer when it is empty; a ConfigError naming the key
    for a file that cannot be read."""
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer

    path = config.model.tokenizer_path or DEBUG_TOKENIZER_PATH
    try:
        return build_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None
