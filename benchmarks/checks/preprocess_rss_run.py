"""The child of preprocess_rss.py: kto-pipeline's preprocessing of N rows of the scale case's data."""

import sys
from pathlib import Path

from kto_pipeline.config import PrecomputeConfig
from kto_pipeline.data import assign_kl_partners, select_rows
from kto_pipeline.models import load_tokenizer
from kto_pipeline.precompute import _open_tokenized, _preprocess

WORK = Path(__file__).resolve().parents[1] / ".work" / "scale"
n = sys.argv[1]
tokenizer = load_tokenizer(str(WORK / "model-smollm2"))
config = PrecomputeConfig(
    model=str(WORK / "model-smollm2"), dataset=str(WORK / f"data-v1-{n}.jsonl"), output="unused", max_length=1024
)
prepared = _preprocess(config, tokenizer)
rows = select_rows(_open_tokenized(prepared["files"]), config.max_length)
assign_kl_partners(len(rows), config.seed)
