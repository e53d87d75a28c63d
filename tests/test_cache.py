"""The cache as a trustworthy artifact: verification, fingerprints, crash safety and resume,
and bad data that must never reach (or poison) a cache."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import cli_args, cli_cmd, run_cli, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import SCHEMA, open_cache, read_manifest
from kto_pipeline.cache.inspect import inspect_cache
from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model
from kto_pipeline.files import sha256_file
from kto_pipeline.stages.precompute.data import tokenize


def copy_cache(src, dst):
    shutil.copytree(src, dst)
    return dst


def first_shard(cache):
    return cache / read_manifest(cache)["shards"][0]["file"]


def rewrite_shard(cache, change):
    """Apply `change(pylist)` to the first shard and re-seal the manifest (so only the content differs)."""
    path = first_shard(cache)
    with pa.memory_map(str(path)) as source:
        rows = pa.ipc.open_stream(source).read_all().to_pylist()
    change(rows)
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as writer:
        writer.write_table(table)
    manifest = read_manifest(cache)
    manifest["shards"][0].update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (cache / "manifest.json").write_text(json.dumps(manifest))


def train_cfg(cache, out, **kw):
    return TrainConfig(cache=str(cache), output_dir=str(out), per_device_train_batch_size=4, max_steps=2, **kw)


# ------------------------------------------------------------------------------------ verification


def test_verify_passes_on_a_sound_cache(small_cache):
    assert inspect_cache(small_cache, verify=True) == []


def test_flipped_byte_caught_by_verify(small_cache, tmp_path):
    cache = copy_cache(small_cache, tmp_path / "c")
    shard = first_shard(cache)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, same row count: only a checksum sees it
    shard.write_bytes(bytes(data))
    problems = inspect_cache(cache, verify=True)
    assert any("sha256 differs" in p for p in problems)
    with pytest.raises(KTOPipelineError, match="sha256 differs"):
        train(train_cfg(cache, tmp_path / "run", verify=True))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_shard_is_read_once_then_again_after_it_changes_and_a_flipped_byte_is_refused(
    small_cache, tmp_path, monkeypatch
):
    """Without --verify: a shard's sha256 is checked the first time it is read as it is now (a copied cache), not
    by the runs after (a sweep), and again once it was written to: a flipped byte is refused before training."""
    import kto_pipeline.files as files_module

    cache, reads = copy_cache(small_cache, tmp_path / "c"), []
    real = files_module.sha256_file

    def counted(path, into=None):  # the shards' reads (--verify reads the keys files too)
        reads.extend([path] if Path(path).parent.name == "shards" else [])
        return real(path, into)

    monkeypatch.setattr(files_module, "sha256_file", counted)
    shards = len(read_manifest(cache).shards)
    assert open_cache(cache) and len(reads) == shards  # a copy: every shard read
    assert open_cache(cache) and inspect_cache(cache) == [] and len(reads) == shards  # marked: none again
    assert open_cache(cache, verify=True) and len(reads) == 2 * shards  # --verify: every shard again
    time.sleep(0.05)  # past the file system clock's tick: the write gives the shard another modification time
    shard = first_shard(cache)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(KTOPipelineError, match="sha256 differs"):
        train(train_cfg(cache, tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert any("sha256 differs" in p for p in inspect_cache(cache))


def test_precompute_marks_the_shards_it_wrote_as_verified(tmp_path, tiny_model_dir, monkeypatch):
    """The shards precompute wrote are not read again by the first run on them."""
    import kto_pipeline.files as files_module

    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(12))
    config = PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), shard_size=4)
    cache, reads = precompute(config), []
    real = files_module.sha256_file
    monkeypatch.setattr(files_module, "sha256_file", lambda path, into=None: reads.append(path) or real(path, into))
    assert len(read_manifest(cache).shards) == 3 and open_cache(cache) and reads == []


def test_missing_and_truncated_shards_refused_by_cheap_checks(small_cache, tmp_path):
    cache = copy_cache(small_cache, tmp_path / "c")
    shard = first_shard(cache)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(KTOPipelineError, match="bytes, the manifest says"):
        train(train_cfg(cache, tmp_path / "run"))
    shard.unlink()
    with pytest.raises(KTOPipelineError, match="missing"):
        train(train_cfg(cache, tmp_path / "run"))


def test_unknown_format_version_refused(small_cache, tmp_path):
    cache = copy_cache(small_cache, tmp_path / "c")
    manifest = read_manifest(cache)
    manifest["format_version"] = 99
    (cache / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KTOPipelineError, match="format version 99, this kto-pipeline reads versions 1, 2 and 3"):
        train(train_cfg(cache, tmp_path / "run"))


def test_verify_checks_kl_partner_ids(small_cache, tmp_path):
    cache = copy_cache(small_cache, tmp_path / "c")

    def break_partner(rows):
        rows[0]["kl_example_id"] = 10_000

    rewrite_shard(cache, break_partner)
    assert inspect_cache(cache, verify=False) == []  # structurally fine
    problems = inspect_cache(cache, verify=True)
    assert any("name no row of the cache" in p and "10000" in p for p in problems)


@pytest.mark.parametrize("change", ["vocab", "special_tokens", "chat_template"])
def test_tokenizer_differences_refused(small_cache, tmp_path, change):
    tok = build_char_tokenizer()
    if change == "vocab":
        tok.add_tokens(["<new>"])
    elif change == "special_tokens":
        tok.add_special_tokens({"eos_token": "<|im_start|>"})
    else:
        tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    model_dir = tmp_path / "model"
    build_tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with pytest.raises(KTOPipelineError, match="tokenizer of --model .* differs"):
        train(train_cfg(small_cache, tmp_path / "run", model=str(model_dir)))


# ------------------------------------------------------------------------------------ fingerprint


def test_fingerprint_names_what_differs(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(8))
    base = dict(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), max_length=64)
    precompute(PrecomputeConfig(**base))
    start = time.perf_counter()
    precompute(PrecomputeConfig(**base))  # identical: nothing to do
    assert time.perf_counter() - start < 10

    write_jsonl(data, unpaired_rows(9))  # other data, same path
    with pytest.raises(KTOPipelineError, match="dataset_hash: cache has"):
        precompute(PrecomputeConfig(**base))
    write_jsonl(data, unpaired_rows(8))

    other = tmp_path / "other-weights"
    model = build_tiny_model(build_char_tokenizer(), seed=1)
    model.save_pretrained(other)
    build_char_tokenizer().save_pretrained(other)
    with pytest.raises(KTOPipelineError, match="model_hash: cache has") as err:
        precompute(PrecomputeConfig(**{**base, "model": str(other)}))
    assert "--overwrite" in str(err.value)
    with pytest.raises(KTOPipelineError, match="kl_seed: cache has 0, this run has 3"):
        precompute(PrecomputeConfig(**{**base, "seed": 3}))


# ------------------------------------------------------------------------------ crash and resume


def _precompute_args(model, data, out):
    return cli_args(model=model, dataset=data, output=out, max_length=64, shard_size=8, batch_size=4)


def _precompute_cmd(model, data, out):
    return cli_cmd("precompute", *_precompute_args(model, data, out))


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, tiny_model_dir, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(400))
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        _precompute_cmd(tiny_model_dir, data, tmp_path / "killed"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    manifest_path = tmp_path / "killed" / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if len(json.loads(manifest_path.read_text())["shards"]) >= 3:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = read_manifest(tmp_path / "killed")
    assert not partial["complete"] and 3 <= len(partial["shards"]) < 50, len(partial["shards"])

    # the same command again, and the uninterrupted run: the CLI in this process (the SIGKILL is the child's)
    code, out, err = run_cli(
        monkeypatch, capsys, "precompute", *_precompute_args(tiny_model_dir, data, tmp_path / "killed")
    )
    assert code == 0, err
    assert "resuming" in out
    code, _, err = run_cli(
        monkeypatch, capsys, "precompute", *_precompute_args(tiny_model_dir, data, tmp_path / "clean")
    )
    assert code == 0, err
    a, b = open_cache(tmp_path / "killed", verify=True), open_cache(tmp_path / "clean", verify=True)
    assert a.table.num_rows == b.table.num_rows == 400
    assert a.table.to_pylist() == b.table.to_pylist()  # value by value
    assert sorted(p.name for p in (tmp_path / "killed" / "shards").iterdir()) == sorted(
        p.name for p in (tmp_path / "clean" / "shards").iterdir()
    )


@pytest.mark.slow
def test_ctrl_c_ends_cleanly_and_says_rerun_resumes(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(3000))
    proc = subprocess.Popen(
        _precompute_cmd(tiny_model_dir, data, tmp_path / "c"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
        # a shell's background job (`cmd &`) ignores SIGINT, and so would this child: give it the default back
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    manifest_path = tmp_path / "c" / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline and not (manifest_path.exists() and read_manifest(tmp_path / "c")["shards"]):
        time.sleep(0.01)
    shards_seen = len(read_manifest(tmp_path / "c")["shards"]) if manifest_path.exists() else 0
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, (shards_seen, out[-2000:], err[-2000:])
    assert "Traceback" not in err and "interrupted" in err and "Run the same command again to resume" in err
    assert not read_manifest(tmp_path / "c")["complete"]


# -------------------------------------------------------------------------------------- bad data


def test_empty_completions_are_dropped_and_counted():
    tok = build_char_tokenizer()
    tok.eos_token = None  # without an EOS to append, an empty completion stays empty
    rows = [{"prompt": "Q", "completion": "", "label": True}, {"prompt": "Q", "completion": " a", "label": False}]
    out = tokenize(tok, rows, max_length=32)
    assert out.example_ids.tolist() == [1] and out.dropped == {"empty completion": 1}


def test_non_finite_loss_stops_with_step_and_ids_keeping_checkpoint(small_cache, tmp_path):
    cache = copy_cache(small_cache, tmp_path / "c")
    rows = open_cache(cache).table.to_pylist()
    poisoned = rows[13]["example_id"]  # in the 4th batch of 4 in sequential order

    def poison(shard_rows):
        for r in shard_rows:
            if r["example_id"] == poisoned:  # a token's value: training sums a row's values itself
                r["ref_token_logps"][0] = float("nan")

    rewrite_shard(cache, poison)
    out = tmp_path / "run"
    with pytest.raises(KTOPipelineError, match=rf"non-finite loss at step 4, batch example ids \[.*{poisoned}.*\]"):
        train(
            TrainConfig(
                cache=str(cache),
                output_dir=str(out),
                per_device_train_batch_size=4,
                max_steps=6,
                save_steps=3,
                logging_steps=1,
                train_sampling_strategy="sequential",
            )
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-3")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert not (out / "model.safetensors").exists()  # no final model from a failed run
    original = open_cache(small_cache).table.column("ref_token_logps").combine_chunks().flatten().to_numpy()
    assert not np.isnan(original).any()  # original untouched


def test_overwrite_replaces_an_unreadable_manifest(tmp_path, tiny_model_dir, unpaired_file):
    out = tmp_path / "c"
    out.mkdir()
    (out / "manifest.json").write_text("{not json")
    cfg = dict(model=str(tiny_model_dir), dataset=str(unpaired_file), output=str(out), max_length=64)
    with pytest.raises(KTOPipelineError, match="not valid JSON"):
        precompute(PrecomputeConfig(**cfg))
    precompute(PrecomputeConfig(**cfg, overwrite=True))
    assert open_cache(out).manifest["complete"]
