"""deepspeed.runtime: only the names training scripts import from it (runtime/zero/)."""
