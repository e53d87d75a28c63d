"""Stage 2: the policy trains alone against a reference cache. The outline is `stage.py`; `policy.py` loads the
policy and builds its optimizer, `step.py` runs a micro-batch's forward and the update, `data.py` reads the cache
into micro-batches (in the order of `batches.py`), `checks.py` checks where a run starts; a forward, its loss and
metrics are the loss family's (`kto_pipeline.objectives`)."""
