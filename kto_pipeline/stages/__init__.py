"""The two stages, each read top to bottom from its entry function: `precompute.py` (stage 1, the reference
pass into a cache) and `train.py` (stage 2, the policy against the cache), with stage 2's data (`batches.py`)
and its forward pass and metrics (`kto_step.py`)."""
