"""Stability toolkit: step-range skipping, spike and non-finite guards, embedding-gradient shrink, z-loss,
LR re-warm after resume and fault drills. See docs/stability.md.

Every tool is a :class:`trainer.callbacks.Callback`. All of them are always built (a disabled one does
nothing), so the callback state a checkpoint holds has the same keys whichever tools are enabled, and a
tool can be switched on when resuming. Import from the submodules: config.py (the [stability] section and
its rules, torch-free, read by the registry), callbacks.py (what a run builds), and one module per tool.
"""
