"""Per-step fault tolerance across replica groups (torchft): ``[fault_tolerance]`` (config.py, torch-free)
and the run-time side (replicas.py), which imports torchft only when the section is enabled."""
