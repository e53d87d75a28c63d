"""Peak memory of `train` does not grow with the cache's row count.

The cache is memory-mapped and only the rows of each batch are read, so a run over 50,000 rows needs
no more memory than one over 2,000 rows: same model, same steps, same row lengths. The two caches are
synthesized from a real (small) precompute cache by replicating its rows, shard by shard.

Measured on 2 CPU cores (peak RSS of the `train` process, MiB): 2,000 rows (15 MB cache) and
50,000 rows (383 MB cache) both peak near 700 MiB; the difference is a few MiB. See the printed
numbers (pytest -s) for the current machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import unpaired_rows, write_jsonl

from kto_pipeline.cache import MANIFEST, check_cache, open_cache, read_manifest, write_manifest, write_shard

MAX_LENGTH = 512  # every synthesized row fills it exactly: len(prompt) + len(completion) == MAX_LENGTH
SHARD_ROWS = 2048
SMALL_ROWS, BIG_ROWS = 2_000, 50_000
MIB = 1 << 20

# Runs `python -m kto_pipeline ARGS...` in this process and prints, as its last line, the peak RSS after
# the imports that `train` makes anyway (baseline) and at the end, plus the RSS split at the end.
_MEASURE = r"""
import json, resource, runpy, sys

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

import accelerate, torch, transformers  # noqa: E401,F401
import kto_pipeline.train  # noqa: F401

baseline = peak_mib()
sys.argv = ["kto-pipeline", *sys.argv[1:]]
try:
    runpy.run_module("kto_pipeline", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
status = {}
with open("/proc/self/status") as f:
    for line in f:
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            status[key] = int(value.split()[0]) / 1024
print(json.dumps({"code": code, "baseline_mib": baseline, "peak_mib": peak_mib(), **status}))
"""


def _list_array(parts: list[np.ndarray], dtype) -> pa.ListArray:
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(parts).astype(dtype)))


def synthesize_cache(real: Path, out: Path, n_rows: int) -> int:
    """Write a cache of `n_rows` rows made from the rows of the real cache at `real`: row j copies
    source row j % m with its completion (and per-token log-probs) tiled to fill MAX_LENGTH, its KL
    partner is row (j + 1) % n_rows, whose completion is truncated to fit this row's prompt. Written
    one shard at a time, so only one shard is ever in memory. Returns the cache's bytes on disk."""
    source = open_cache(real).table.to_pylist()
    m = len(source)
    prompts = [np.asarray(r["prompt_ids"], dtype=np.int32) for r in source]
    rooms = [MAX_LENGTH - len(p) for p in prompts]
    completions = [np.resize(np.asarray(r["completion_ids"], np.int32), k) for r, k in zip(source, rooms, strict=True)]
    logps = [np.resize(np.asarray(r["ref_token_logps"], np.float32), k) for r, k in zip(source, rooms, strict=True)]
    labels = np.array([r["label"] for r in source])

    manifest = read_manifest(real)
    shards, desirable = [], 0
    for index, start in enumerate(range(0, n_rows, SHARD_ROWS)):
        ids = np.arange(start, min(n_rows, start + SHARD_ROWS), dtype=np.int64)
        partners = (ids + 1) % n_rows
        src, psrc = (ids % m).tolist(), (partners % m).tolist()
        kl_ids = [completions[p][: rooms[s]] for s, p in zip(src, psrc, strict=True)]
        kl_logps = [logps[p][: rooms[s]] for s, p in zip(src, psrc, strict=True)]
        shard_labels = labels[ids % m]
        desirable += int(shard_labels.sum())
        rows = {
            "example_id": ids,
            "label": shard_labels,
            "prompt_ids": _list_array([prompts[s] for s in src], np.int32),
            "completion_ids": _list_array([completions[s] for s in src], np.int32),
            "kl_example_id": partners,
            "kl_completion_ids": _list_array(kl_ids, np.int32),
            "ref_logp": np.array([logps[s].sum(dtype=np.float32) for s in src], dtype=np.float32),
            "ref_kl_logp": np.array([x.sum(dtype=np.float32) for x in kl_logps], dtype=np.float32),
            "ref_token_logps": _list_array([logps[s] for s in src], np.float32),
            "ref_kl_token_logps": _list_array(kl_logps, np.float32),
        }
        shards.append(write_shard(out, index, rows))
        del rows, kl_ids, kl_logps
    manifest.update(
        complete=True,
        shards=shards,
        counts={"rows": n_rows, "desirable": desirable, "undesirable": n_rows - desirable, "dropped": {}},
    )
    write_manifest(out, manifest)
    return sum(s["bytes"] for s in shards)


def measure_train(cache: Path, output_dir: Path) -> dict:
    """Peak RSS of a `train` run of 5 steps at batch size 4 and the cache's own max length."""
    args = ["train", "--cache", str(cache), "--output-dir", str(output_dir), "--max-steps", "5"]
    args += ["--per-device-train-batch-size", "4", "--logging-steps", "5"]
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, proc.stderr[-3000:]
    assert "train finished: 5 steps" in proc.stdout, proc.stdout[-3000:]
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [5] and np.isfinite(metrics[0]["loss"])
    return result


@pytest.mark.slow
def test_train_peak_memory_does_not_grow_with_cache_rows(tmp_path, tiny_model_dir):
    from kto_pipeline import PrecomputeConfig, precompute

    data = write_jsonl(tmp_path / "data.jsonl", unpaired_rows())
    real = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "real"), max_length=MAX_LENGTH
        )
    )
    small, big = tmp_path / "small", tmp_path / "big"
    small_bytes = synthesize_cache(real, small, SMALL_ROWS)
    big_bytes = synthesize_cache(real, big, BIG_ROWS)
    # The synthesized caches pass every check, checksums and KL partner ids included.
    assert check_cache(small, read_manifest(small), full=True) == []
    assert check_cache(big, read_manifest(big), full=True) == []
    assert read_manifest(big)["tokenizer"]["hash"] == read_manifest(real)["tokenizer"]["hash"]
    assert (big / MANIFEST).exists() and len(open_cache(big)) == BIG_ROWS
    assert big_bytes >= 300 * MIB, f"the 50k-row cache is only {big_bytes / MIB:.0f} MiB; the test means nothing"

    small_run = measure_train(small, tmp_path / "run-small")
    big_run = measure_train(big, tmp_path / "run-big")
    growth = big_run["peak_mib"] - small_run["peak_mib"]
    report = (
        f"cache {SMALL_ROWS} rows = {small_bytes / MIB:.1f} MiB: {small_run}\n"
        f"cache {BIG_ROWS} rows = {big_bytes / MIB:.1f} MiB: {big_run}\n"
        f"peak RSS growth {growth:.1f} MiB, limit {0.1 * big_bytes / MIB:.1f} MiB (10% of the big cache)"
    )
    print("\n" + report)
    assert growth < 0.1 * big_bytes / MIB, report
