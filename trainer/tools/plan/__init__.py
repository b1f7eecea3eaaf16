"""``trainer plan``: parameters, FLOPs per token and memory per GPU for a config on N GPUs.

Modules: ``memory`` (the memory model: bytes per GPU of a layout, and the search over layouts), ``cli``
(a config to the report, and the command).
"""
