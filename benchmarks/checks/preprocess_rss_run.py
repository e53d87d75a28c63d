"""The child of preprocess_rss.py: kto-pipeline's preprocessing of the scale case's data, as `precompute` runs it
before it loads the model (load, check, tokenize with --num-proc 1, select, pair). It imports only kto_pipeline,
so that its RSS is the preprocessing's.

    python benchmarks/checks/preprocess_rss_run.py MODEL_DIR DATA.jsonl
"""

import sys

from kto_pipeline import PrecomputeConfig
from kto_pipeline.models import load_tokenizer
from kto_pipeline.stages.precompute.stage import prepare_rows

model, data = sys.argv[1], sys.argv[2]
tokenizer = load_tokenizer(model)
prepare_rows(PrecomputeConfig(model=model, dataset=data, output="unused", max_length=1024), tokenizer)
