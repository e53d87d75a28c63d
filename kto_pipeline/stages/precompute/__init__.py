"""Stage 1: the frozen reference model scores every completion and its KL completion once, into a cache.
The outline is `stage.py`; `data.py` reads and tokenizes the dataset, `segments.py` lets a cache grow."""
