"""Checkpoints: save and resume the whole training state with ``torch.distributed.checkpoint`` (DCP).

One owner per concern (import from the owner; this package's ``__init__`` stays empty so that the
[checkpoint] section's module, ``config.py``, loads without torch for the launcher's pre-flight):

* :mod:`~trainer.checkpoint.config`: the [checkpoint] section and its rules;
* :mod:`~trainer.checkpoint.layout`: the folders on disk, the commit marker, the one scanner
  (:func:`scan_folder`), validation, atomic writes and sizes (no process group);
* :mod:`~trainer.checkpoint.state`: what a checkpoint holds and the explicit components it is taken from;
* :mod:`~trainer.checkpoint.manager`: :class:`CheckpointManager`, what the training loop calls, with
  :mod:`~trainer.checkpoint.space` and :mod:`~trainer.checkpoint.agree` (how all ranks agree on a save's
  or load's outcome);
* saving: :mod:`~trainer.checkpoint.saving` (a save, its commit and outcome, retention) with
  :mod:`~trainer.checkpoint.writer` (DCP's writer, hashing) and :mod:`~trainer.checkpoint.background`
  (the one asynchronous save path);
* loading: :mod:`~trainer.checkpoint.loading` (the resume policy), :mod:`~trainer.checkpoint.restore`
  (one checkpoint into the components), :mod:`~trainer.checkpoint.reader` (the tensors read, verified)
  and :mod:`~trainer.checkpoint.dcp_compat` (the one piece of DCP internals read);
* :mod:`~trainer.checkpoint.offline`: single-process reading for tools (export, eval, generate);
* :mod:`~trainer.checkpoint.cli`: ``trainer checkpoint list|inspect``.
"""
