"""The optimizer and the learning-rate schedule: config.py holds their config sections and rules (torch-free),
optimizer.py builds them (torch)."""
