"""Pairs in the cache: a cache made from paired data records, for each row, the other row of the (chosen, rejected)
pair it came from (`pair_example_id`), robust to dropped rows and appends; the manifest counts the pairs; caches of
format version 1 (before pairs) still open, train KTO, and grow in their own format."""

import json

import numpy as np
import pyarrow as pa
import pytest
from helpers import unpaired_rows, write_jsonl
from rich.console import Console

from kto_pipeline import PrecomputeConfig, precompute
from kto_pipeline.cache import NO_PAIR, SCHEMA_V1, check_cache, open_cache, read_manifest
from kto_pipeline.cache.inspect import inspect_cache
from kto_pipeline.files import sha256_file


def pairs(n: int, long_prompts: tuple[int, ...] = (), start: int = 0) -> list[dict]:
    """n (prompt, chosen, rejected) rows; the prompts of `long_prompts` reach max_length 64 (trl drops both rows)."""
    return [
        {
            "prompt": f"Question {i}: what is {i} plus {i}?" * (3 if i in long_prompts else 1),
            "chosen": f" It is {2 * i}.",
            "rejected": " no idea",
        }
        for i in range(start, start + n)
    ]


def config(model, data, out, **kw) -> PrecomputeConfig:
    return PrecomputeConfig(model=str(model), dataset=str(data), output=str(out), max_length=64, shard_size=4, **kw)


def rows_by_id(cache) -> dict[int, dict]:
    return {r["example_id"]: r for r in open_cache(cache, verify=True).table.to_pylist()}


def test_paired_data_records_each_rows_pair_and_the_manifest_counts_them(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(6, long_prompts=(2,)))
    cache = precompute(config(tiny_model_dir, data, tmp_path / "cache"))
    assert "  pairs        5 (chosen, rejected) pairs, 0 rows without their partner\n" in capsys.readouterr().out
    rows = rows_by_id(cache)
    # source row i -> example ids 2i (chosen) and 2i+1 (rejected); pair 2 is dropped (its prompt is too long), and
    # the pairs after it keep their partners
    assert sorted(rows) == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    for i in (0, 1, 3, 4, 5):
        chosen, rejected = rows[2 * i], rows[2 * i + 1]
        assert (chosen["label"], rejected["label"]) == (True, False)
        assert (chosen["pair_example_id"], rejected["pair_example_id"]) == (2 * i + 1, 2 * i)
        assert chosen["prompt_ids"] == rejected["prompt_ids"]
    manifest = read_manifest(cache)
    assert manifest.format_version == 2 and manifest.paired
    assert manifest["counts"]["dropped"] == {"prompt >= max_length (64)": 2}
    assert manifest["counts"]["pairs"] == {"complete": 5, "rows_without_partner": 0}
    assert manifest["segments"][0]["pairs"] == {"complete": 5, "rows_without_partner": 0}
    console = Console(record=True, width=200)
    assert inspect_cache(cache, verify=True, console=console) == []
    assert "5 complete, 0 rows without their partner in the cache" in console.export_text()


def test_implicit_prompt_pairs_are_recorded_too(tmp_path, tiny_model_dir):
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in pairs(3)]
    cache = precompute(config(tiny_model_dir, write_jsonl(tmp_path / "implicit.jsonl", implicit), tmp_path / "c"))
    rows = rows_by_id(cache)
    assert [rows[i]["pair_example_id"] for i in range(6)] == [1, 0, 3, 2, 5, 4]
    assert read_manifest(cache).pairs == {"complete": 3, "rows_without_partner": 0}


def test_unpaired_data_has_no_pairs(small_cache):
    table = open_cache(small_cache, verify=True).table
    assert set(table.column("pair_example_id").to_pylist()) == {NO_PAIR}
    manifest = read_manifest(small_cache)
    assert not manifest.paired and manifest.pairs == {"complete": 0, "rows_without_partner": 0}
    console = Console(record=True, width=200)
    inspect_cache(small_cache, console=console)
    assert "none (unpaired data: KTO only)" in console.export_text()


def test_an_append_pairs_its_whole_new_pairs_only(tmp_path, tiny_model_dir):
    """An append of new rows (--allow-missing): its new pairs are recorded; a pair whose chosen row repeats a row
    of the cache (held, not appended again) but whose rejected row is new keeps the new row without a partner."""
    first = pairs(4)
    cache = precompute(config(tiny_model_dir, write_jsonl(tmp_path / "first.jsonl", first), tmp_path / "cache"))
    again = dict(first[3], rejected=" something else entirely")  # pair 3's chosen again (held), a new rejected
    new_rows = write_jsonl(tmp_path / "new.jsonl", [again] + pairs(2, start=4))
    precompute(config(tiny_model_dir, new_rows, cache, append=True, allow_missing=True))
    rows = rows_by_id(cache)
    manifest = read_manifest(cache)
    new = manifest["segments"][1]
    assert new["pairs"] == {"complete": 2, "rows_without_partner": 1}
    assert manifest.pairs == {"complete": 6, "rows_without_partner": 1}
    new_ids = sorted(i for i in rows if i >= new["first_example_id"])
    assert len(new_ids) == 5
    lone = [i for i in new_ids if rows[i]["pair_example_id"] == NO_PAIR]
    assert len(lone) == 1 and rows[lone[0]]["label"] is False
    for i in set(new_ids) - set(lone):
        partner = rows[rows[i]["pair_example_id"]]
        assert partner["pair_example_id"] == i and partner["label"] != rows[i]["label"]
    assert check_cache(cache, manifest, full=True) == []


def rewrite_shard(cache, shard: dict, table: pa.Table) -> None:
    """Replace a shard's file by `table` (written beside it, then renamed: `table` may be mapped from the old file)
    and record its new size and sha256 in the manifest."""
    path = cache / shard["file"]
    tmp = path.with_name(path.name + ".new")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    tmp.replace(path)
    shard["bytes"], shard["sha256"] = path.stat().st_size, sha256_file(path)


def test_verify_finds_broken_pairs(tmp_path, tiny_model_dir):
    cache = precompute(config(tiny_model_dir, write_jsonl(tmp_path / "p.jsonl", pairs(4)), tmp_path / "c"))
    manifest = json.loads((cache / "manifest.json").read_text())
    shard = manifest["shards"][0]
    with pa.memory_map(str(cache / shard["file"])) as source:
        table = pa.ipc.open_stream(source).read_all()
    ids = table.column("pair_example_id").to_numpy().copy()
    ids[0] = ids[2]  # row 0 names row 3 (a rejected row that names row 2 back)
    table = table.set_column(table.schema.get_field_index("pair_example_id"), "pair_example_id", pa.array(ids))
    rewrite_shard(cache, shard, table)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    problems = check_cache(cache, read_manifest(cache), full=True)
    assert problems == [  # row 0 names row 3 (pair 1's rejected row), which names row 2; row 1 names row 0
        "2 rows are not their partner's partner, or have its label (e.g. example_id [0, 1])",
        "1 rows do not share their pair partner's prompt (e.g. example_id [0])",
    ]


def as_version_1(cache) -> None:
    """Turn a cache into one written before pairs: shards without pair_example_id, format_version 1, no pair counts."""
    manifest = json.loads((cache / "manifest.json").read_text())
    for shard in manifest["shards"]:
        with pa.memory_map(str(cache / shard["file"])) as source:
            table = pa.ipc.open_stream(source).read_all()
        rewrite_shard(cache, shard, table.select(SCHEMA_V1.names))
    manifest["format_version"] = 1
    del manifest["counts"]["pairs"]
    for segment in manifest["segments"]:
        del segment["pairs"]
    (cache / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("data", ["unpaired", "paired"])
def test_a_version_1_cache_opens_and_grows_in_version_1(tmp_path, tiny_model_dir, data):
    rows = unpaired_rows(12) if data == "unpaired" else pairs(6)
    first = write_jsonl(tmp_path / "first.jsonl", rows[: len(rows) * 2 // 3])
    cache = precompute(config(tiny_model_dir, first, tmp_path / "c"))
    before = open_cache(cache).table
    as_version_1(cache)
    old = open_cache(cache, verify=True)
    assert old.table.schema.equals(SCHEMA_V1) and old.table == before.select(SCHEMA_V1.names)
    manifest = read_manifest(cache)
    assert not manifest.paired
    console = Console(record=True, width=200)
    inspect_cache(cache, console=console)
    assert "not recorded (format version 1: precompute again to train pair losses)" in console.export_text()
    # an append writes version-1 shards, so the cache stays one format
    precompute(config(tiny_model_dir, write_jsonl(tmp_path / "log.jsonl", rows), cache, append=True))
    grown = open_cache(cache, verify=True)
    manifest = read_manifest(cache)
    assert manifest.format_version == 1 and "pairs" not in manifest["counts"]
    assert "pairs" not in manifest["segments"][1] and grown.table.schema.equals(SCHEMA_V1)
    assert grown.table.num_rows == len(rows) * (1 if data == "unpaired" else 2)
    assert np.array_equal(grown.table.column("example_id").to_numpy(), np.arange(grown.table.num_rows))


def test_pairs_only_scores_each_pair_as_one_tree_without_kl(tmp_path, tiny_model_dir, capsys):
    """--pairs-only: the same completions' reference values as the full cache, no KL completions; KTO refuses it,
    unpaired data and an odd shard size are refused, and it never appends to a cache with KL completions."""
    from kto_pipeline import KTOPipelineError, TrainConfig, train

    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(6, long_prompts=(2,)))
    full = rows_by_id(precompute(config(tiny_model_dir, data, tmp_path / "full")))
    capsys.readouterr()
    cache = precompute(config(tiny_model_dir, data, tmp_path / "pairs", pairs_only=True))
    assert " scored (chosen + rejected completions, no KL, with their prompts)\n" in capsys.readouterr().out
    rows = rows_by_id(cache)
    assert sorted(rows) == sorted(full)
    for i, row in rows.items():
        for key in ("label", "prompt_ids", "completion_ids", "pair_example_id"):
            assert row[key] == full[i][key], key
        np.testing.assert_allclose(row["ref_token_logps"], full[i]["ref_token_logps"], atol=1e-5)
        assert row["ref_logp"] == pytest.approx(full[i]["ref_logp"], abs=1e-4)
        assert (row["kl_example_id"], row["kl_completion_ids"], row["ref_kl_token_logps"]) == (-1, [], [])
    manifest = read_manifest(cache)
    assert not manifest.has_kl and manifest.settings["kl_completions"] is False and manifest.paired
    assert manifest.fingerprint["kl_completions"] is False and read_manifest(tmp_path / "full").has_kl
    # the reference pass ran one tree per pair: each prompt once for both answers
    needed = manifest.timing["tokens_needed"]
    assert needed == sum(len(r["prompt_ids"]) for r in rows.values()) // 2 + sum(
        len(r["completion_ids"]) for r in rows.values()
    )
    console = Console(record=True, width=200)
    assert inspect_cache(cache, verify=True, console=console) == []
    assert "none (precompute --pairs-only: pair losses only, not KTO)" in console.export_text()
    with pytest.raises(KTOPipelineError, match="written by `precompute --pairs-only`: it holds no KL completions"):
        train(TrainConfig(cache=str(cache), output_dir=str(tmp_path / "run"), max_steps=1))
    with pytest.raises(KTOPipelineError, match="--pairs-only needs paired data"):
        precompute(
            config(tiny_model_dir, write_jsonl(tmp_path / "u.jsonl", unpaired_rows(4)), tmp_path / "u", pairs_only=True)
        )
    with pytest.raises(KTOPipelineError, match="must be even with --pairs-only"):
        PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "o"), pairs_only=True, shard_size=3
        )
    more = write_jsonl(tmp_path / "more.jsonl", pairs(8, long_prompts=(2,)))
    with pytest.raises(KTOPipelineError, match="kl_completions: cache has None, this run has False"):
        precompute(config(tiny_model_dir, more, tmp_path / "full", append=True, pairs_only=True))
    # an append keeps whole new pairs only: a repeated chosen row with a new rejected one is dropped
    again = dict(pairs(6)[3], rejected=" another answer")
    new_rows = write_jsonl(tmp_path / "new.jsonl", [again] + pairs(2, start=6))
    precompute(config(tiny_model_dir, new_rows, cache, append=True, allow_missing=True, pairs_only=True))
    manifest = read_manifest(cache)
    assert manifest["segments"][1]["dropped"] == {"no pair partner": 1}
    assert manifest.pairs == {"complete": 7, "rows_without_partner": 0}
    assert check_cache(cache, manifest, full=True) == []


def test_rows_whose_prompts_tokenized_differently_are_not_a_pair():
    """A pair is one prompt and two answers: where a tokenizer merged the prompt's end into one answer and not the
    other, the two rows stay unpaired (KTO trains on them; a pair loss cannot run them as one tree)."""
    from kto_pipeline.stages.precompute.stage import pair_partners, same_prompts

    prompts = [[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 4], [5], [5], [7, 8], [7, 9]]
    table = pa.table({"prompt_ids": pa.array(prompts, pa.list_(pa.int32()))})
    a, b = np.array([0, 2, 4, 6]), np.array([1, 3, 5, 7])
    assert same_prompts(table, a, b, chunk=3).tolist() == [True, False, True, False]  # across chunk edges too
    positions = np.array([0, 1, 3, 4, 5, 6, 7])  # row 2 dropped: row 3 has no partner
    assert pair_partners(positions, positions + 100, table).tolist() == [101, 100, NO_PAIR, 105, 104, NO_PAIR, NO_PAIR]
