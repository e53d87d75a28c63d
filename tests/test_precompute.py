"""Stage 1: the cache's contents against an independent full-logits computation, the manifest,
data sources, and re-running into an existing cache."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset
from helpers import conversational_rows, cpu_attention, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, precompute
from kto_pipeline.cache import SCHEMA, open_cache


def read_rows(cache_dir):
    return open_cache(cache_dir).table.to_pylist()


def full_logits_token_logps(model, prompt_ids, completion_ids):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logps[len(prompt_ids) - 1 :].numpy()


def test_cache_values_match_full_logits(small_cache, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rows = read_rows(small_cache)
    by_id = {r["example_id"]: r for r in rows}
    assert sorted(by_id) == list(range(24))
    for r in rows:
        assert r["kl_example_id"] != r["example_id"] and r["kl_example_id"] in by_id
        assert len(r["ref_token_logps"]) == len(r["completion_ids"])
        assert len(r["ref_kl_token_logps"]) == len(r["kl_completion_ids"])
        # the KL completion is the partner's completion, truncated so prompt + it fits max_length (64)
        partner = by_id[r["kl_example_id"]]
        room = 64 - len(r["prompt_ids"])
        assert r["kl_completion_ids"] == partner["completion_ids"][:room] or len(partner["completion_ids"]) == (
            64 - len(partner["prompt_ids"])
        )
        assert len(r["prompt_ids"]) + len(r["kl_completion_ids"]) <= 64
        want = full_logits_token_logps(model, r["prompt_ids"], r["completion_ids"])
        np.testing.assert_allclose(r["ref_token_logps"], want, atol=1e-4)
        assert r["ref_logp"] == pytest.approx(float(want.sum()), abs=1e-4)
        want_kl = full_logits_token_logps(model, r["prompt_ids"], r["kl_completion_ids"])
        np.testing.assert_allclose(r["ref_kl_token_logps"], want_kl, atol=1e-4)
        assert r["ref_kl_logp"] == pytest.approx(float(want_kl.sum()), abs=1e-4)
    assert sorted(r["kl_example_id"] for r in rows) == list(range(24))  # every completion reused once


def test_truncation_at_max_length(tmp_path, tiny_model_dir):
    rows = unpaired_rows(6)
    rows[0]["completion"] = " " + "very long answer " * 10
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), max_length=60)
    )
    for r in read_rows(out):
        assert len(r["prompt_ids"]) + len(r["completion_ids"]) <= 60
    long_row = next(r for r in read_rows(out) if r["example_id"] == 0)
    assert len(long_row["prompt_ids"]) + len(long_row["completion_ids"]) == 60


def test_schema_manifest_and_readers(small_cache):
    manifest = json.loads((small_cache / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["format_version"] == 2
    assert manifest["counts"] == {
        "rows": 24,
        "desirable": 16,
        "undesirable": 8,
        "dropped": {},
        "pairs": {"complete": 0, "rows_without_partner": 0},
    }
    assert manifest["settings"] == {"max_length": 64, "dtype": "float32", "autocast": None, "kl_seed": 0}
    assert manifest["distributed"] == {"engine": "single", "world_size": 1}
    for key in ("weights_hash", "name_or_path", "revision"):
        assert key in manifest["reference_model"]
    assert manifest["tokenizer"]["hash"].startswith("sha256:")
    assert manifest["dataset"]["content_hash"].startswith("sha256:") and manifest["dataset"]["source_rows"] == 24
    shard = small_cache / manifest["shards"][0]["file"]
    with pa.memory_map(str(shard)) as source:
        table = pa.ipc.open_stream(source).read_all()
    assert table.schema.equals(SCHEMA)
    assert sum(s["rows"] for s in manifest["shards"]) == 24
    ds = Dataset.from_file(str(shard))  # the contract: datasets reads shards directly too
    assert ds.num_rows == table.num_rows and ds.column_names == SCHEMA.names


def test_many_shards_small_batches_same_values(tmp_path, tiny_model_dir, small_cache):
    """Shard size, batch size and token budget change the batching, never the values."""
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows())
    out = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir),
            dataset=str(data),
            output=str(tmp_path / "c"),
            max_length=64,
            shard_size=5,
            batch_size=3,
            max_tokens_per_batch=128,
        )
    )
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == 5
    a, b = read_rows(out), read_rows(small_cache)
    for x, y in zip(a, b, strict=True):
        assert x["example_id"] == y["example_id"] and x["kl_example_id"] == y["kl_example_id"]
        np.testing.assert_allclose(x["ref_token_logps"], y["ref_token_logps"], atol=1e-5)
        np.testing.assert_allclose(x["ref_kl_token_logps"], y["ref_kl_token_logps"], atol=1e-5)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "arrow", "save_to_disk", "dataset_dict"])
def test_data_sources(tmp_path, tiny_model_dir, fmt):
    rows = unpaired_rows(6)
    ds = Dataset.from_list(rows)
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, rows)
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    elif fmt == "arrow":
        ds.save_to_disk(str(tmp_path / "tmpds"))
        path = next((tmp_path / "tmpds").glob("*.arrow"))
    elif fmt == "save_to_disk":
        ds.save_to_disk(str(path))
    else:
        from datasets import DatasetDict

        DatasetDict({"train": ds.select(range(2)), "test": ds}).save_to_disk(str(path))
    out = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir),
            dataset=str(path),
            output=str(tmp_path / "c"),
            max_length=64,
            split="test" if fmt == "dataset_dict" else "train",
        )
    )
    got = read_rows(out)
    assert len(got) == 6 and [r["label"] for r in got] == [r["label"] for r in rows]


def test_conversational_and_paired(tmp_path, tiny_model_dir):
    conv = write_jsonl(tmp_path / "conv.jsonl", conversational_rows())
    out = precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(conv), output=str(tmp_path / "c1")))
    assert len(read_rows(out)) == 12
    paired = write_jsonl(
        tmp_path / "paired.jsonl", [{"prompt": f"Q{i}?", "chosen": " good", "rejected": " bad"} for i in range(5)]
    )
    out = precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(paired), output=str(tmp_path / "c2")))
    rows = read_rows(out)
    assert [r["label"] for r in rows] == [True, False] * 5


def test_unpaired_and_paired_columns_together_are_read_as_unpaired_and_said(tmp_path, tiny_model_dir, capsys):
    both = [dict(r, chosen=" good", rejected=" bad") for r in unpaired_rows(6)]
    data = write_jsonl(tmp_path / "both.jsonl", both)
    out = precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c")))
    assert len(read_rows(out)) == 6
    assert "its rows are read as unpaired, and chosen and rejected are not used" in capsys.readouterr().out


def test_rerun_same_inputs_does_nothing(small_cache, tiny_model_dir, capsys):
    manifest = json.loads((small_cache / "manifest.json").read_text())
    before = {s["file"]: (small_cache / s["file"]).stat().st_mtime_ns for s in manifest["shards"]}
    data = manifest["dataset"]["name_or_path"]
    precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=data, output=str(small_cache), max_length=64))
    assert "nothing to do" in capsys.readouterr().out
    after = {s["file"]: (small_cache / s["file"]).stat().st_mtime_ns for s in manifest["shards"]}
    assert before == after


def test_rerun_other_settings_refused_then_overwritten(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(6))
    cfg = dict(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), max_length=64)
    precompute(PrecomputeConfig(**cfg))
    with pytest.raises(KTOPipelineError, match="max_length: cache has 64, this run has 48"):
        precompute(PrecomputeConfig(**{**cfg, "max_length": 48}))
    precompute(PrecomputeConfig(**{**cfg, "max_length": 48, "overwrite": True}))
    assert open_cache(tmp_path / "c").manifest["settings"]["max_length"] == 48


def test_output_that_holds_something_else(tmp_path, tiny_model_dir, unpaired_file):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(KTOPipelineError, match="not a kto-pipeline cache"):
        precompute(
            PrecomputeConfig(model=str(tiny_model_dir), dataset=str(unpaired_file), output=str(tmp_path / "busy"))
        )
    with pytest.raises(KTOPipelineError, match="is a file"):
        precompute(
            PrecomputeConfig(
                model=str(tiny_model_dir), dataset=str(unpaired_file), output=str(tmp_path / "busy" / "notes.txt")
            )
        )


def test_missing_model_and_dataset(tmp_path, tiny_model_dir, unpaired_file):
    with pytest.raises(KTOPipelineError, match="--model ./nope: no such directory"):
        precompute(PrecomputeConfig(model="./nope", dataset=str(unpaired_file), output=str(tmp_path / "c")))
    with pytest.raises(KTOPipelineError, match="--dataset ./nope.jsonl: no such file"):
        precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset="./nope.jsonl", output=str(tmp_path / "c")))


def test_non_finite_reference_logps_stop_with_the_row(tmp_path, tiny_model_dir, unpaired_file):
    from transformers import AutoModelForCausalLM

    broken = tmp_path / "broken"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[5] = float("nan")
    model.save_pretrained(broken)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(broken)
    with pytest.raises(KTOPipelineError, match="example 0: the reference model gave a non-finite log-prob"):
        precompute(PrecomputeConfig(model=str(broken), dataset=str(unpaired_file), output=str(tmp_path / "c")))
    assert not list((tmp_path / "c").glob("shards/*.arrow"))


@pytest.mark.parametrize("packed", [True, False])
def test_progress_is_reported_per_forward_pass(tiny_model_dir, packed):
    """The reference pass reports after every forward pass (the progress bar moves within a shard), with the
    tokens the sequences need and the tokens the pass ran, padding included."""
    from transformers import AutoModelForCausalLM

    from kto_pipeline.scoring.logprobs import ReferenceScorer, score_shard
    from kto_pipeline.scoring.packing import ScoredSequence, pack_batches, pack_trees

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    trees = [([5, 6, 7], [list(range(8, 10 + i)), list(range(8, 11 + i))]) for i in range(5)]
    calls = []
    scorer = ReferenceScorer(model, cpu_attention(model))
    out = score_shard(
        scorer, trees, 0, batch_size=3, max_tokens=40, device="cpu", on_batch=lambda *c: calls.append(c), packed=packed
    )
    assert [len(o) for pair in out for o in pair] == [len(c) for _, conts in trees for c in conts]
    if packed:  # trees (prompt once) side by side in rows as wide as the largest tree
        sizes = [3 + len(c) + len(k) for _, (c, k) in trees]
        passes = pack_trees(sizes, 3, 40)
        assert [c[0] for c in calls] == [2 * sum(map(len, rows)) for rows in passes]
        assert sum(c[1] for c in calls) == sum(sizes)
        assert [c[2] for c in calls] == [len(rows) * max(sum(sizes[t] for t in r) for r in rows) for rows in passes]
    else:  # every sequence on its own, padded to the longest of its batch
        seqs = [ScoredSequence(t, k, 3, p + c) for t, (p, cs) in enumerate(trees) for k, c in enumerate(cs)]
        batches = pack_batches(seqs, 3, 40)
        assert [c[0] for c in calls] == [len(b) for b in batches]
        assert sum(c[1] for c in calls) == sum(len(s.ids) for s in seqs)
        assert [c[2] for c in calls] == [len(b) * max(len(s.ids) for s in b) for b in batches]
    assert len(calls) > 1


@pytest.mark.parametrize("packed", [True, False])
def test_a_forwards_values_are_read_once_the_next_forward_is_queued(tiny_model_dir, packed, monkeypatch):
    """The reference pass copies a forward's log-probs to the host in one copy and reads them after queueing the
    next forward (on an accelerator the host builds the next batch while the device runs the last), each sequence's
    values split on the host: the values of every sequence scored alone."""
    from transformers import AutoModelForCausalLM

    from kto_pipeline.scoring import logprobs
    from kto_pipeline.scoring.logprobs import HostCopy, ReferenceScorer, score_sequences, score_shard

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    trees = [([5, 6, 7 + i], [list(range(8, 10 + i)), list(range(8, 11 + 2 * i))]) for i in range(5)]
    events = []
    forward, read = ReferenceScorer.forward, HostCopy.read
    monkeypatch.setattr(ReferenceScorer, "forward", lambda *a, **k: events.append("forward") or forward(*a, **k))
    monkeypatch.setattr(HostCopy, "read", lambda self: events.append("read") or read(self))
    monkeypatch.setattr(logprobs, "pack_trees", lambda sizes, *a: [[[t]] for t in range(len(sizes))])  # a tree a pass
    monkeypatch.setattr(logprobs, "pack_batches", lambda seqs, *a: [[s] for s in seqs])  # a sequence a pass
    out = score_shard(ReferenceScorer(model, cpu_attention(model)), trees, 0, 3, 40, device="cpu", packed=packed)
    passes = events.count("forward")
    assert passes == (5 if packed else 10) and events == ["forward"] + ["forward", "read"] * (passes - 1) + ["read"]
    for (prompt, continuations), scored in zip(trees, out, strict=True):
        for continuation, values in zip(continuations, scored, strict=True):
            ids = torch.tensor([prompt + continuation])
            completion = torch.tensor([[0] * len(prompt) + [1] * len(continuation)])
            with torch.no_grad():
                alone = score_sequences(model, ids, torch.ones_like(ids), completion).token_logps
            assert values.dtype == np.float32 and len(values) == len(continuation)
            np.testing.assert_allclose(values, alone.numpy(), rtol=1e-5, atol=1e-5)


def test_pack_trees_respects_budgets():
    from kto_pipeline.scoring.packing import AttentionCosts, pack_trees

    sizes = [10, 9, 6, 5, 4, 3, 1]
    passes = pack_trees(sizes, batch_size=100, max_tokens=1000, costs=AttentionCosts(pair=0.05))
    assert sorted(t for p in passes for row in p for t in row) == list(range(len(sizes)))
    assert len(passes) == 1 and len(passes[0]) == 4  # 10 | 9 1 | 6 4 | 5 3
    for p in pack_trees(sizes, batch_size=4, max_tokens=20):  # <= 2 trees, <= 20 tokens (or one row) a pass
        assert sum(map(len, p)) <= 2 or len(p) == 1
        assert len(p) * max(sum(sizes[t] for t in r) for r in p) <= 20 or len(p) == 1


def test_padded_fallback_gives_the_same_cache(tmp_path, tiny_model_dir, unpaired_file):
    """A model whose attention takes no packed layout runs every sequence on its own; the values are the same
    and the manifest says which path ran. The padded run calls the stage's phases one by one, saying after
    `load_reference` that this model takes no packed layout."""
    from kto_pipeline.runtime.peak_memory import PeakMemory
    from kto_pipeline.stages.precompute import stage as stage

    packed = open_cache(precompute(PrecomputeConfig(str(tiny_model_dir), str(unpaired_file), str(tmp_path / "a"))))
    assert packed.manifest["reference_pass"] == {"prefix_shared": True, "attention_kernel": "by-tree"}
    with PeakMemory() as peaks:  # as the stage holds it
        run = stage.setup(PrecomputeConfig(str(tiny_model_dir), str(unpaired_file), str(tmp_path / "b")), peaks)
        run.prepared = stage.prepare_rows(run.config, run.tokenizer, run.state)
        stage.load_reference(run)
        assert run.reference.plan.padded_because is None
        run.reference.plan = run.reference.plan.padded("attention implementation 'x'")
        assert stage.plan_output(run)
        stage.score_shards(run)
        stage.finish(run)
    padded = open_cache(tmp_path / "b")
    assert padded.manifest["reference_pass"] == {
        "prefix_shared": False,
        "unshared_because": "attention implementation 'x'",
    }
    for x, y in zip(packed.table.to_pylist(), padded.table.to_pylist(), strict=True):
        np.testing.assert_allclose(x["ref_token_logps"], y["ref_token_logps"], atol=1e-5)
        np.testing.assert_allclose(x["ref_kl_token_logps"], y["ref_kl_token_logps"], atol=1e-5)
    assert packed.manifest["timing"]["tokens_executed"] < padded.manifest["timing"]["tokens_executed"]


@pytest.mark.parametrize("batch_size", [1, 6])
def test_manifest_counts_executed_and_needed_tokens(tmp_path, tiny_model_dir, batch_size):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(20))
    cache = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir),
            dataset=str(data),
            output=str(tmp_path / "c"),
            batch_size=batch_size,
            shard_size=7,
        )
    )
    opened = open_cache(cache)
    rows = opened.table.to_pylist()
    timing = opened.manifest["timing"]
    needed = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) + len(r["kl_completion_ids"]) for r in rows)
    scored = needed + sum(len(r["prompt_ids"]) for r in rows)  # as separate sequences, prompts run twice
    assert timing["tokens_needed"] == needed and timing["tokens_scored"] == scored
    if batch_size == 1:
        assert timing["tokens_executed"] == needed  # one tree (prompt once) per pass: no padding
    else:
        assert needed < timing["tokens_executed"] < scored  # trees share padded rows, prompts still run once
    assert timing["token_efficiency"] == round(needed / timing["tokens_executed"], 4)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_forwards_are_filled_to_the_token_budget_not_a_row_count(tmp_path, tiny_model_dir, batch_size):
    """By default the pass fills each forward to its token budget (the CPU's: 1,024 tokens, the longest sequence
    allowed at the default max_length): 80 rows, ~2,400 needed tokens, in as few forwards as the budget allows;
    --batch-size stays a user's limit on the sequences a forward holds (4: two trees a forward, 40 forwards)."""
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(80))
    config = PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"))
    config.batch_size = batch_size
    timing = open_cache(precompute(config)).manifest["timing"]
    assert timing["forward_tokens"] == 1024
    if batch_size is None:
        fewest = -(-timing["tokens_executed"] // 1024)
        assert 2 <= fewest <= timing["forwards"] <= fewest + 1, timing
    else:
        assert timing["forwards"] == 40


def test_a_forwards_memory_stays_within_its_estimate(tiny_model_dir):
    """`forward_bytes_per_token`, which sizes the forwards on a GPU, bounds what a forward holds at its peak, beyond
    the weights (measured with torch's MemTracker on the CPU, one tree a row and four trees a row), without
    overstating it more than twofold where the mask is not dense."""
    from transformers import AutoModelForCausalLM

    from kto_pipeline.memory.simulation import memory_tracker
    from kto_pipeline.scoring.attention import CHUNK_LOGITS_BYTES, attention_costs, forward_bytes_per_token
    from kto_pipeline.scoring.logprobs import ReferenceScorer
    from kto_pipeline.scoring.packing import layout_trees

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trees = [([5] * 60, [[6] * 50, [7] * 50]) for _ in range(32)]
    for kernel in ("by-tree", "dense"):
        scorer = ReferenceScorer(model, attention_costs(model, kernel))
        for per_row in (1, 4):
            layout = layout_trees(trees, [list(range(i, i + per_row)) for i in range(0, 32, per_row)])
            tracker = memory_tracker()
            with torch.inference_mode(), tracker:
                scorer(layout=layout)
            peak = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
            tokens = layout.input_ids.numel()
            held = peak - weights - min(2 * tokens * model.config.vocab_size * 4, 2 * CHUNK_LOGITS_BYTES)
            estimate = forward_bytes_per_token(model, kernel) * tokens
            assert held <= estimate, (kernel, per_row, held / tokens, estimate / tokens)
            assert kernel == "dense" or estimate <= 2 * held, (kernel, per_row, held / tokens, estimate / tokens)


def test_forward_budget_on_a_gpu_follows_the_free_memory(monkeypatch):
    """On a CUDA device the budget is half the free memory over the bytes a token holds, at most 65,536 tokens, in
    multiples of 1,024, never below the longest sequence; on the CPU 1,024 or the longest sequence."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from kto_pipeline.scoring.attention import forward_bytes_per_token, forward_tokens

    config = Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    per_token = forward_bytes_per_token(model, "block-mask")
    assert per_token == 2 * (2 * 896 + 3 * 4864) * 2 + 64  # the MLP's tensors are the larger, in bf16
    free = {"now": 80 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["now"], 80 << 30))
    assert forward_tokens(model, "cuda", "block-mask", 1024)[0] == 65536  # plenty: the cap
    free["now"] = 1 << 30
    budget, why = forward_tokens(model, "cuda", "block-mask", 1024)
    assert budget == (2**29 - 2 * (128 << 20)) // per_token // 1024 * 1024 and "1.0 GiB free" in why
    free["now"] = 100 << 20
    assert forward_tokens(model, "cuda", "block-mask", 3000)[0] == 3000  # a sequence always fits
    assert forward_tokens(model, "cpu", "by-tree", 512)[0] == 1024
    assert forward_tokens(model, "cpu", "by-tree", 3000)[0] == 3000


def test_ahead_keeps_the_order_raises_where_the_item_failed_and_stops_when_left():
    """`prefetch.ahead`, which prepares the next forwards in a thread: the items in order; an exception raised while
    making item k is raised after items 0..k-1; a loop left early stops the thread."""
    import threading

    from kto_pipeline.runtime.prefetch import ahead

    def threads() -> int:
        return sum(t.name == "kto-pipeline-prefetch" for t in threading.enumerate())

    running = threads()
    assert list(ahead(iter(range(50)), depth=3)) == list(range(50))

    def failing():
        yield from range(3)
        raise ValueError("item 3")

    got = []
    with pytest.raises(ValueError, match="item 3"):
        for item in ahead(failing()):
            got.append(item)
    assert got == [0, 1, 2]
    made = []

    def endless():
        while True:
            made.append(len(made))
            yield made[-1]

    for item in ahead(endless(), depth=2):
        if item == 5:
            break
    assert len(made) <= 5 + 1 + 2 + 1  # at most the queue's depth and the one in the making beyond what was taken
    assert threads() == running


def test_a_ctrl_c_while_the_prefetch_thread_stops_is_raised_once_it_has_stopped():
    """A Ctrl-C landing while `ahead` waits for its thread to end (a loop closing) is raised only once the thread has
    ended: a daemon thread left inside torch's C++ code at the interpreter's exit aborts the process (status -6), which
    an interrupted precompute did now and then."""
    import queue
    import threading
    import time

    from kto_pipeline.runtime import prefetch

    ended = threading.Event()

    def making() -> None:  # a producer still making its item when the stop comes
        time.sleep(0.3)
        ended.set()

    class Interrupted(queue.Queue):
        calls = 0

        def get(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                raise KeyboardInterrupt  # as a Ctrl-C would, between two bytecodes of the wait
            return super().get(*args, **kwargs)

    thread = threading.Thread(target=making, daemon=True)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        prefetch._wait_for(thread, Interrupted())
    assert ended.is_set() and not thread.is_alive()
