"""Jobs around training that the ``trainer`` console script runs (see trainer/cli.py)."""
