"""The two stages, built alike: each a folder whose `stage.py` is the outline, read top to bottom from its entry
function, beside the parts only that stage uses.

    precompute/   stage 1: the reference pass into a cache
        stage.py      prepare rows -> load the reference -> plan the output -> score shards -> finish
        data.py       load, check, normalize and tokenize a dataset; KL partners
        segments.py   content keys and segments: a cache that grows (--append)
    train/        stage 2: the policy against the cache
        stage.py      setup -> resume -> prepare the output directory -> fit -> finish
        policy.py     load the policy and build its optimizer (also what estimate-memory measures)
        batches.py    the memory-mapped cache as packed (or padded) micro-batches
        kto_step.py   one forward pass, its loss and its metrics

How a process runs (launch, precision, engine) is asked of `kto_pipeline.runtime`; neither stage tests which
engine runs.
"""
