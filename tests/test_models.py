"""Model loading (kto_pipeline/models.py): the inputs that cannot load fail fast, in one line that says what to do."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from helpers import cli_cmd, unpaired_rows, write_jsonl

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.models import load_model, load_tokenizer


def _cli(tmp_path, *args, **env):
    return subprocess.run(cli_cmd(*args), capture_output=True, text=True, env={**os.environ, **env}, cwd=tmp_path)


def test_hub_id_without_network_fails_fast_and_says_how_to_pass_a_directory(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(4))
    started = time.perf_counter()
    # an endpoint that refuses connections stands in for a machine without network
    result = _cli(
        tmp_path,
        "precompute",
        "--model",
        "some-org/some-model",
        "--dataset",
        str(data),
        "--output",
        str(tmp_path / "c"),
        HF_HUB_OFFLINE="0",
        HF_ENDPOINT="http://127.0.0.1:9",
        HF_HUB_CACHE=str(tmp_path / "hub"),
    )
    assert time.perf_counter() - started < 60
    assert result.returncode == 1 and "Traceback" not in result.stderr
    err = result.stderr
    assert err.startswith("error: --model some-org/some-model: ") and err.count("\n") == 1
    assert "cannot be reached" in err and "--model DIR" in err and "hf download some-org/some-model" in err
    assert not (tmp_path / "c").exists()


def test_gguf_file_without_the_gguf_package(tmp_path, monkeypatch):
    import importlib.util

    gguf = tmp_path / "model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name))
    for load in (load_tokenizer, lambda name: load_model(name, dtype=None)):
        with pytest.raises(KTOPipelineError) as info:
            load(str(gguf))
        message = str(info.value)
        assert message.startswith(f"--model {gguf}: reading GGUF files needs the gguf package")
        assert "pip install gguf" in message


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(KTOPipelineError, match="absent.gguf: no such file"):
        load_tokenizer(str(tmp_path / "absent.gguf"))


def test_directory_without_config_is_not_a_model(tmp_path):
    with pytest.raises(KTOPipelineError, match="has no config.json"):
        load_model(str(tmp_path), dtype=None)


def test_a_file_a_trailing_slash_and_a_model_without_its_tokenizer_are_named(tmp_path, tiny_model_dir):
    import shutil

    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(4))
    with pytest.raises(KTOPipelineError, match=r"d\.jsonl: a file, not a model directory"):
        load_tokenizer(str(data))
    with pytest.raises(KTOPipelineError, match="missing/: no such directory"):  # not read as a hub id
        load_tokenizer("missing/")
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    with pytest.raises(KTOPipelineError, match=r"bare: the directory has no tokenizer .*save_pretrained"):
        load_tokenizer(str(bare))
