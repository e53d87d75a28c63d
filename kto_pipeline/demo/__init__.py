"""The demo and its fixtures: `run.py` (make demo, make demo-tiny), the SmolLM2 fetcher (`smollm2.py`), the
HH-RLHF converter (`hh_rlhf.py`), the tiny model and tokenizer the tests build (`tiny.py`), and the bundled data
(`assets/`)."""
