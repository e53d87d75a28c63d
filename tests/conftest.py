"""Shared fixtures: a tiny seeded Llama with a character-level tokenizer, and small datasets in every
supported format. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
# tokenized datasets (precompute's datasets.map) go to a fresh cache per test session, not ~/.cache
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="kto-pipeline-tests-datasets-"))


def train_config(cache, out, **kw):
    """A short TrainConfig for tiny-model tests: 3 steps of 4 rows, every step logged; keywords override."""
    from kto_pipeline import TrainConfig

    base = dict(
        cache=str(cache),
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-3,
        seed=0,
    )
    return TrainConfig(**{**base, **kw})


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run the real entry point in-process: (exit code, stdout, stderr)."""
    import sys

    from kto_pipeline.cli import main

    monkeypatch.setattr(sys, "argv", ["kto-pipeline", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_metrics(out: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def unpaired_rows(n: int = 24) -> list[dict]:
    """Standard unpaired rows of varied lengths, labels alternating in a 2:1 pattern."""
    rows = []
    for i in range(n):
        good = i % 3 != 0
        rows.append(
            {
                "prompt": f"User: question number {i} about {'cats' if i % 2 else 'the weather'}?\nAssistant:",
                "completion": (" Yes, happy to help with that" + "!" * (i % 5)) if good else f" No{'.' * (i % 4)}",
                "label": good,
            }
        )
    return rows


def conversational_rows(n: int = 12) -> list[dict]:
    rows = []
    for i in range(n):
        good = i % 2 == 0
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"Tell me about topic {i}."}],
                "completion": [
                    {"role": "assistant", "content": f"Topic {i} is interesting." if good else "I will not."}
                ],
                "label": good,
            }
        )
    return rows


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved 2-layer Llama (hidden 64) + char tokenizer with a chat template."""
    from kto_pipeline.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def other_tokenizer_model_dir(tmp_path_factory) -> Path:
    """Same architecture, but a tokenizer whose chat template differs (so its hash differs)."""
    from kto_pipeline.tiny import build_char_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-llama-other-tok"
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    build_tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def unpaired_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "unpaired.jsonl", unpaired_rows())


@pytest.fixture(scope="session")
def small_cache(tmp_path_factory, tiny_model_dir) -> Path:
    """A complete cache of 24 unpaired rows at max_length 64, built once per session."""
    from kto_pipeline import PrecomputeConfig, precompute

    root = tmp_path_factory.mktemp("cache")
    data = write_jsonl(root / "data.jsonl", unpaired_rows())
    return precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(root / "cache"), max_length=64)
    )
