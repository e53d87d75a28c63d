"""The scoring engine both stages share: packed layouts of (prompt, [completion, KL completion]) trees
(`packing.py`), the attention that runs them (`attention.py`), and per-token log-probs through the LM head in
chunks (`logprobs.py`)."""
