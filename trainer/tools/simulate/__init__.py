"""``trainer simulate``: build and step one rank of a big layout on this machine, with no GPU and no memory.

One process plays one rank of a world of N over torch's fake process group (collectives return at once
and move nothing) and fake tensors (shapes and dtypes, no storage). The rank's view is built by the
trainer's own code (``ParallelDims`` and its mesh, ``trainer.setup.build_model_parts``, ``build_optimizer``),
then one training step runs through ``trainer.step`` (forward, backward, gradient clipping, AdamW) while
torch's FSDP memory tracker, a FLOP counter and a collective counter watch it.

Modules: ``world`` (fake world, checks, the rank's build), ``step`` (the step and what it measures),
``analytic`` (the same quantities by formula, and trainer plan's memory estimate), ``cli`` (the command).
"""
