"""Llama-family transformer: arguments (args.py), the flavor table (flavors.py), the model (model.py), FLOP
and parameter counts (flops.py) and Hugging Face conversion (hf_adapter.py). Import from the submodule:
args.py and flavors.py are torch-free (the launcher's pre-flight reads them), the others import torch."""
