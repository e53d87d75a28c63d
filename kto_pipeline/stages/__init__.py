"""The two stages, built alike: each a folder whose `stage.py` is the outline, read top to bottom from its entry
function, beside the parts only that stage uses.

    precompute/   stage 1: the reference pass into a cache
        stage.py      prepare rows -> load the reference -> plan the output -> score shards -> finish
        phases.py     what passes between the phases: one dataclass each
        data.py       load, check, normalize and tokenize a dataset; KL partners
        shards.py     the packing check, the shards the reference pass scores, their entries in the manifest
        finish.py     the segment and the run's timing into the manifest, and the summary
        append.py     --append: the rows a cache does not hold, as a new segment
        segments.py   content keys and segments: a cache that grows (--append)
    train/        stage 2: the policy against the cache
        stage.py      setup -> resume -> prepare the output directory -> fit -> finish
        policy.py     load the policy and build its optimizer (also what estimate-memory measures)
        step.py       a micro-batch's forward and the update: what train runs and estimate-memory simulates
        data.py       open and check the cache; its loaders of packed (or padded) micro-batches
        batches.py    the items' order from (seed, epoch)
        checks.py     where a run starts: its output directory, the policy's first weights, a checkpoint

One forward pass, its loss and its metrics belong to the loss family (`kto_pipeline.objectives`).

How a process runs (launch, precision, engine) is asked of `kto_pipeline.runtime`; neither stage tests which
engine runs.
"""
