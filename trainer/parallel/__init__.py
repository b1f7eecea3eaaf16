"""Device mesh, parallelization (TP, activation checkpointing, compile, FSDP2/HSDP) and initialisation."""

# Inserted into parameter names by wrappers: torch.compile, activation checkpointing, FSDP1.
WRAPPER_TOKENS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def distribute_parameter(module, name: str, mesh, placements) -> None:
    """Replace ``module``'s parameter ``name`` (on the meta device) by a DTensor over ``mesh`` with ``placements``."""
    from torch import nn
    from torch.distributed.tensor import distribute_tensor

    module.register_parameter(name, nn.Parameter(distribute_tensor(getattr(module, name), mesh, placements)))


def clean_fqn(name: str) -> str:
    """A parameter name as the plain model has it (wrapper segments removed)."""
    for token in WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name
