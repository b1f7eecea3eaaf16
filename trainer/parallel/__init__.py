"""Device mesh, parallelization (TP, activation checkpointing, compile, FSDP2/HSDP) and initialisation."""
