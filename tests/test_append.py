"""precompute --append: a cache that grows with a feedback log. Only the rows the cache does not hold are tokenized
and scored, into new shards; the old shards are never rewritten; anything that would make the new rows' values
differ from the old ones' is refused, and the cache stays as it was."""

import json

import numpy as np
import pyarrow as pa
import pytest
from helpers import cli_args, cli_cmd, run_cli, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, precompute
from kto_pipeline.cache import open_cache, read_manifest
from kto_pipeline.files import sha256_file
from kto_pipeline.stages.precompute import shards as precompute_module
from kto_pipeline.stages.precompute.data import assign_kl_partners
from kto_pipeline.stages.precompute.segments import match_keys, row_key

ROWS = unpaired_rows(24)


def config(model, data, out, **kw):
    return PrecomputeConfig(model=str(model), dataset=str(data), output=str(out), max_length=64, shard_size=8, **kw)


def table(cache) -> pa.Table:
    return open_cache(cache).table


def files(cache) -> dict[str, str]:
    """Every file of the cache (shards, keys) -> its sha256."""
    return {str(p.relative_to(cache)): sha256_file(p) for p in sorted(cache.rglob("*.arrow"))}


def record_scored(monkeypatch) -> list:
    """The prompts of every tree the reference pass scores."""
    scored = []
    score = precompute_module._score_trees

    def recording(run, trees, pad_id, images=None):
        scored.extend(tuple(prompt) for prompt, _ in trees)
        return score(run, trees, pad_id, images)

    monkeypatch.setattr(precompute_module, "_score_trees", recording)
    return scored


@pytest.fixture(scope="module")
def grown(tmp_path_factory, tiny_model_dir):
    """A cache of the first 16 rows grown to 24 by an append of the whole log, and a full precompute of the 24."""
    root = tmp_path_factory.mktemp("grown")
    first = write_jsonl(root / "first.jsonl", ROWS[:16])
    log = write_jsonl(root / "log.jsonl", ROWS)
    cache = precompute(config(tiny_model_dir, first, root / "cache"))
    before = files(cache)
    precompute(config(tiny_model_dir, log, cache, append=True))
    full = precompute(config(tiny_model_dir, log, root / "full"))
    return {"root": root, "cache": cache, "before": before, "full": full, "log": log}


def test_append_scores_only_the_new_rows_and_keeps_the_old_shards(grown):
    cache, full = grown["cache"], grown["full"]
    after = files(cache)
    assert {k: after[k] for k in grown["before"]} == grown["before"]  # byte-identical old shards and keys
    assert sorted(set(after) - set(grown["before"])) == ["keys/segment-00001.arrow", "shards/shard-00002.arrow"]
    manifest = read_manifest(cache)
    assert manifest.complete and "appending" not in manifest
    assert manifest.counts["rows"] == 24 and manifest.counts["desirable"] == sum(r["label"] for r in ROWS)
    new, old = manifest.segments[1], manifest.segments[0]
    assert (old["rows"], new["rows"], new["matched_rows"], new["first_example_id"]) == (16, 8, 16, 16)
    assert new["source"]["content_hash"] == read_manifest(full).dataset["content_hash"]
    assert new["shards"] == ["shards/shard-00002.arrow"] and new["written_at"]
    assert new["timing"]["rows_scored"] == 8

    # the same rows, the same example ids and the same values as a full precompute of the grown log
    ours, theirs = table(cache).to_pydict(), table(full).to_pydict()
    assert ours["example_id"] == theirs["example_id"] == list(range(24))
    for column in ("label", "prompt_ids", "completion_ids", "ref_logp", "ref_token_logps"):
        assert ours[column] == theirs[column], column
    # old rows keep their KL partners; new rows draw theirs among the new rows (a seeded cycle: each new
    # completion is one new row's KL completion)
    assert ours["kl_example_id"][:16] == [int(i) for i in assign_kl_partners(16, 0)]
    new_partners = ours["kl_example_id"][16:]
    assert sorted(new_partners) == list(range(16, 24)) and all(
        p != i for i, p in zip(range(16, 24), new_partners, strict=True)
    )
    assert new_partners == [16 + int(i) for i in assign_kl_partners(8, [0, 1])]
    assert new["kl"] == {"rule": "seeded cycle through the segment's rows", "seed": [0, 1]}


def test_a_grown_log_and_its_new_rows_alone_append_the_same(grown, tiny_model_dir, tmp_path, monkeypatch):
    first = write_jsonl(tmp_path / "first.jsonl", ROWS[:16])
    new = write_jsonl(tmp_path / "new.parquet.jsonl", ROWS[16:])
    cache = precompute(config(tiny_model_dir, first, tmp_path / "cache"))
    scored = record_scored(monkeypatch)
    precompute(config(tiny_model_dir, new, cache, append=True))
    assert len(scored) == 8  # only the new rows ran through the reference
    assert files(cache) == files(grown["cache"])
    # appending the same rows again finds nothing new and changes nothing
    before = (cache / "manifest.json").read_bytes()
    precompute(config(tiny_model_dir, grown["log"], cache, append=True))
    assert len(scored) == 8 and (cache / "manifest.json").read_bytes() == before


def test_duplicates_count_as_a_full_precompute_counts_them(tiny_model_dir, tmp_path):
    rows = ROWS[:12]
    cache = precompute(config(tiny_model_dir, write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "cache"))
    # the log repeats row 3 (once more than the cache holds it) and adds one new row: two new rows
    log = write_jsonl(tmp_path / "log.jsonl", [*rows[:5], rows[3], *rows[5:], ROWS[20]])
    precompute(config(tiny_model_dir, log, cache, append=True))
    segment = read_manifest(cache).segments[1]
    assert (segment["rows"], segment["matched_rows"]) == (2, 12)
    t = table(cache).to_pydict()
    assert t["completion_ids"][12] == t["completion_ids"][3] and t["example_id"][12:] == [12, 13]


def test_match_keys_with_multiplicity():
    a, b, c, d = (np.frombuffer(bytes([i]) * 16, dtype="V16")[0] for i in range(4))
    held = np.array([a, b, b, c], dtype="V16")
    given = np.array([b, a, d, b, b, a], dtype="V16")
    match = match_keys(held, given)
    assert match.new.tolist() == [False, False, True, False, True, True]
    assert match.missing.tolist() == [False, False, False, True]


def test_content_key_ignores_layout_and_arrow_padding():
    row = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "x"}]}
    padded = {
        "prompt": [{"role": "user", "content": "hi", "tool_calls": None}],
        "completion": [{"role": "assistant", "content": "x"}],
    }
    assert row_key({**row, "label": True}) == row_key({**padded, "label": True, "tools": None})
    assert row_key({**row, "label": True}) != row_key({**row, "label": False})


def test_a_log_that_lost_rows_is_refused_unless_intended(tiny_model_dir, tmp_path, monkeypatch, capsys):
    cache = precompute(config(tiny_model_dir, write_jsonl(tmp_path / "a.jsonl", ROWS[:16]), tmp_path / "cache"))
    relabelled = {**ROWS[5], "label": not ROWS[5]["label"]}
    log = [*ROWS[:5], relabelled, *ROWS[6:9], *ROWS[10:]]  # row 5 relabelled, row 9 gone, 8 new rows
    data = write_jsonl(tmp_path / "log.jsonl", log)
    before = files(cache) | {"manifest": sha256_file(cache / "manifest.json")}
    code, _, err = run_cli(monkeypatch, capsys, "precompute", *cli(tiny_model_dir, data, cache), "--append")
    assert code == 1
    assert "holds 14 of the cache's rows but not 2 others (example ids 5, 9)" in err and "--allow-missing" in err
    assert files(cache) | {"manifest": sha256_file(cache / "manifest.json")} == before
    precompute(config(tiny_model_dir, data, cache, append=True, allow_missing=True))
    segment = read_manifest(cache).segments[1]
    assert (segment["rows"], segment["matched_rows"]) == (9, 14)  # 8 new rows and the relabelled one
    assert len(table(cache)) == 25


def cli(model, data, out):
    return cli_args(model=model, dataset=data, output=out, max_length=64, shard_size=8)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"max_length": 48}, "max_length: cache has 64, this run has 48"),
        ({"seed": 3}, "kl_seed: cache has 0, this run has 3"),
        ({"bf16": True}, "autocast: cache has None, this run has 'bfloat16'"),
    ],
)
def test_append_with_other_settings_is_refused(grown, tiny_model_dir, change, named):
    cache = grown["cache"]
    before = files(cache) | {"manifest": sha256_file(cache / "manifest.json")}
    kw = {"max_length": 64, "shard_size": 8, **change}
    with pytest.raises(KTOPipelineError, match="another reference or settings") as err:
        precompute(
            PrecomputeConfig(model=str(tiny_model_dir), dataset=str(grown["log"]), output=str(cache), append=True, **kw)
        )
    assert named in str(err.value) and "The cache is unchanged" in str(err.value)
    assert files(cache) | {"manifest": sha256_file(cache / "manifest.json")} == before


def test_append_with_another_reference_is_refused(grown, tiny_model_dir, other_tokenizer_model_dir, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(grown["cache"], cache)
    with pytest.raises(KTOPipelineError) as err:
        precompute(config(other_tokenizer_model_dir, grown["log"], cache, append=True))
    assert "tokenizer_hash: cache has" in str(err.value)
    # the same tokenizer, other weights: refused once the model is loaded, before anything is written
    other = tmp_path / "other-weights"
    shutil.copytree(tiny_model_dir, other)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)
    model.save_pretrained(other)
    before = files(cache) | {"manifest": sha256_file(cache / "manifest.json")}
    with pytest.raises(KTOPipelineError) as err:
        precompute(
            PrecomputeConfig(
                model=str(other), dataset=str(grown["log"]), output=str(cache), append=True, max_length=64, shard_size=8
            )
        )
    assert "model" in str(err.value) and "The cache is unchanged" in str(err.value)
    assert files(cache) | {"manifest": sha256_file(cache / "manifest.json")} == before


def test_one_new_row_draws_its_partner_from_the_cache(grown, tiny_model_dir, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(grown["cache"], cache)
    extra = {"prompt": "User: one more?\nAssistant:", "completion": " Sure.", "label": True}
    precompute(config(tiny_model_dir, write_jsonl(tmp_path / "one.jsonl", [extra]), cache, append=True))
    t = table(cache).to_pydict()
    assert t["example_id"][-1] == 24 and 0 <= t["kl_example_id"][-1] < 24
    partner = t["kl_example_id"][-1]
    assert t["kl_completion_ids"][-1] == t["completion_ids"][partner]
    assert read_manifest(cache).segments[-1]["kl"]["rule"] == "drawn from the cache's rows of the same prompt kind"


def test_inspect_lists_and_verifies_segments(grown, monkeypatch, capsys, tmp_path):
    import shutil

    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(grown["cache"]), "--verify")
    assert code == 0 and "segments" in out and "log.jsonl" in out and "OK (all checksums verified)" in out
    cache = tmp_path / "cache"
    shutil.copytree(grown["cache"], cache)
    keys = cache / "keys" / "segment-00001.arrow"
    data = bytearray(keys.read_bytes())
    data[-20] ^= 1
    keys.write_bytes(bytes(data))
    code, _, err = run_cli(monkeypatch, capsys, "inspect", str(cache), "--verify")
    assert code == 1 and "keys/segment-00001.arrow: sha256 differs" in err


def test_manifest_segments_are_json(grown):
    manifest = json.loads((grown["cache"] / "manifest.json").read_text())
    assert [s["index"] for s in manifest["segments"]] == [0, 1]
    assert manifest["segments"][0]["keys"]["file"] == "keys/segment-00000.arrow"


@pytest.mark.slow
def test_sigkill_during_an_append_then_rerun_completes_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The cache as readers see it is the old one until the append finishes; a second writer is refused while it
    runs; after SIGKILL the same command resumes after the append's intact shards, and the old shards never
    change."""
    import os
    import signal
    import subprocess
    import time

    rows = unpaired_rows(400)
    cache = precompute(config(tiny_model_dir, write_jsonl(tmp_path / "first.jsonl", rows[:48]), tmp_path / "cache"))
    old = files(cache)
    log = write_jsonl(tmp_path / "log.jsonl", rows)
    args = ["precompute", *cli(tiny_model_dir, log, cache), "--append", "--batch-size", "4"]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(cli_cmd(*args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    appending = {}
    while time.time() < deadline and len(appending.get("shards", [])) < 3:
        try:
            appending = json.loads((cache / "manifest.json").read_text()).get("appending", {})
        except json.JSONDecodeError:
            pass
        time.sleep(0.01)
    with pytest.raises(KTOPipelineError, match="is in use by"):
        precompute(config(tiny_model_dir, log, cache, append=True))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 3 <= len(appending["shards"]) < 44
    assert len(open_cache(cache, verify=True)) == 48  # readers see the old cache, whole

    code, out, err = run_cli(monkeypatch, capsys, *args)  # the same command again, in this process
    assert code == 0, err[-3000:]
    assert "resuming the append:" in out
    after = files(cache)
    assert {k: after[k] for k in old} == old  # the old shards and keys, byte for byte
    t = open_cache(cache, verify=True).table
    assert t.column("example_id").to_pylist() == list(range(400))  # none lost, none twice
    assert not list((cache / "shards").glob(".*")) and not list((cache / "keys").glob(".*"))

    clean = precompute(config(tiny_model_dir, write_jsonl(tmp_path / "first2.jsonl", rows[:48]), tmp_path / "clean"))
    precompute(config(tiny_model_dir, log, clean, append=True))
    assert t.to_pylist() == open_cache(clean).table.to_pylist()


def test_train_uses_every_row_of_a_grown_cache(grown, tmp_path, monkeypatch):
    from helpers import train_config

    from kto_pipeline import train
    from kto_pipeline.objectives import objective_for

    seen = []
    kto = objective_for("kto")
    forward = kto.forward

    def recording(accelerator, scorer, batch, *args, **kw):
        seen.extend(batch["example_id"].tolist())
        return forward(accelerator, scorer, batch, *args, **kw)

    monkeypatch.setattr(kto, "forward", recording)
    train(train_config(grown["cache"], tmp_path / "run", max_steps=-1, num_train_epochs=1, logging_steps=3))
    assert sorted(seen) == list(range(24))
