"""deepspeed.checkpoint: only the helper Accelerate imports from it (utils.py)."""
