"""Evaluation with lm-eval: ``trainer eval`` (cli.py) and the ``[eval]`` section that scores lm-eval tasks
on the live model during training (callback.py, config.py)."""
