"""Stage 1: the frozen reference model scores every completion and its KL completion once, into a cache.
The outline is `stage.py` (its run state, `phases.py`); `data.py` reads and tokenizes the dataset, `shards.py`
scores the rows into shards and finishes the cache, `append.py` and `segments.py` let a cache grow."""
