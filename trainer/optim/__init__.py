"""The optimizer and the learning-rate schedule: config.py holds their config sections and rules (torch-free),
optimizer.py builds them (torch), muon.py is Muon (with AdamW on the rest), on one process or sharded."""
