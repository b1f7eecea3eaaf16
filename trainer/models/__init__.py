"""Models: the [model] section and the configuration-to-arguments step (config.py, torch-free) and the
Llama family (llama/). Import from the defining submodule."""
