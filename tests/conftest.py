"""Shared fixtures: a tiny seeded Llama with a character-level tokenizer, and small datasets in every
supported format. Nothing is downloaded."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import unpaired_rows, write_jsonl

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


def _scratch_dir(variable: str, prefix: str) -> None:
    """`variable` names a fresh directory for this test session (unless already set), removed when the process that
    made it exits (pytest-xdist's workers inherit the controller's, which outlives them)."""
    if variable not in os.environ:
        os.environ[variable] = path = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, path, ignore_errors=True)


# tokenized datasets (precompute's datasets.map) go to a fresh cache per test session, not ~/.cache
_scratch_dir("HF_DATASETS_CACHE", "kto-pipeline-tests-datasets-")
_scratch_dir("KTO_PIPELINE_VERIFIED_DIR", "kto-pipeline-tests-verified-")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved 2-layer Llama (hidden 64) + char tokenizer with a chat template."""
    from kto_pipeline.demo.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def other_tokenizer_model_dir(tmp_path_factory) -> Path:
    """Same architecture, but a tokenizer whose chat template differs (so its hash differs)."""
    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-llama-other-tok"
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    build_tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def scaled_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model with its weight matrices scaled x4, so that precision shows: a random tiny model's nearly
    uniform outputs hide the difference between bf16 and float32 (about 1e-4 there, 2e-3 here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("models") / "scaled"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
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


# The longest test files first: `make test` runs files whole in two pytest-xdist workers (--dist loadfile), handed
# out in collection order, so a long file collected last would leave one worker idle while the other finishes it.
# The files of 20 s or more, by their time in a whole run (`make test TEST_DURATIONS=0`, docs/development.md).
LONGEST_FIRST = (
    "test_compile.py",
    "test_real_model.py",
    "test_bench.py",
    "test_bench_gpu.py",
    "test_deepspeed.py",
    "test_fsdp.py",
    "test_slurm.py",
    "test_distributed.py",
    "test_step_one.py",
    "test_memory.py",
    "test_families.py",
    "test_multinode.py",
    "test_vision.py",
    "test_accumulation.py",
    "test_dpo_parity.py",
    "test_bench_dpo.py",
    "test_pair_engines.py",
    "test_cli.py",
    "test_generate.py",
    "test_precision.py",
    "test_estimate_memory.py",
    "test_cache.py",
    "test_sweep_report.py",
    "test_preemption.py",
    "test_lora_moe.py",
    "test_trl_parity.py",
    "test_quantization.py",
)


def pytest_configure(config):
    # pytest-xdist (3.x, --loadscope-reorder on by default) hands the files out by their number of tests, most first,
    # not in collection order: the longest files, which hold few tests (test_real_model.py 6, test_memory.py 3),
    # went last and left one worker idle while the other finished them. Collection order it is.
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
