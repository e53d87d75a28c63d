"""Two rounds of training end to end on the tiny model: train -> generate completions with the policy -> label them
with a rule written here -> precompute --append -> train --init-from -> report. The second round's cache scores
only its new rows, and its training starts from round one's weights."""

import json

import pyarrow.compute as pc
import pytest
import torch
from helpers import run_cli, train_config, unpaired_rows, write_jsonl
from safetensors.torch import load_file

from kto_pipeline import PrecomputeConfig, precompute, train
from kto_pipeline.cache import open_cache, read_manifest
from kto_pipeline.files import sha256_file
from kto_pipeline.report import write_report
from kto_pipeline.rundir import TrainerState
from kto_pipeline.stages.train import stage as train_module

RULE = '''
def label(row):
    """Desirable: an answer of an even number of characters (a rule anyone can check)."""
    return len(row["completion"]) % 2 == 0
'''


@pytest.mark.slow
def test_two_rounds(tiny_model_dir, tmp_path, monkeypatch, capsys):
    rows = unpaired_rows(24)
    cache = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir),
            dataset=str(write_jsonl(tmp_path / "round1.jsonl", rows)),
            output=str(tmp_path / "cache"),
            max_length=64,
        )
    )
    old_shards = {s["file"]: sha256_file(cache / s["file"]) for s in read_manifest(cache).shards}
    run1 = train(train_config(cache, tmp_path / "run1", max_steps=3)).output_dir

    # round 2: the policy answers prompts, a rule labels the answers
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in rows[:6]])
    (tmp_path / "rules.py").write_text(RULE)
    new = tmp_path / "round2.jsonl"
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "--run", str(run1),
        "--prompts", str(prompts),
        "--num-return-sequences", "2",
        "--max-new-tokens", "12",
        "--label-with", f"{tmp_path / 'rules.py'}:label",
        "--output", str(new),
    )  # fmt: skip
    assert code == 0, err
    written = [json.loads(line) for line in new.read_text().splitlines()]
    assert len(written) == 12 and all(r["label"] == (len(r["completion"]) % 2 == 0) for r in written)

    precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(new), output=str(cache), max_length=64, append=True)
    )
    manifest = read_manifest(cache)
    segment = manifest.segments[1]
    kept = segment["rows"]
    assert kept == 12 - sum(segment["dropped"].values()) and segment["matched_rows"] == 0
    # only the new rows ran through the reference: the executed-token counters of the append are those of the
    # new segment's shards alone
    table = open_cache(cache, verify=True).table
    added = table.filter(pc.greater_equal(table["example_id"], 24))
    needed = sum(len(x) for c in ("prompt_ids", "completion_ids", "kl_completion_ids") for x in added[c].to_pylist())
    assert segment["timing"]["rows_scored"] == kept == added.num_rows
    assert segment["timing"]["tokens_needed"] == needed
    assert needed <= segment["timing"]["tokens_executed"] <= 1.1 * needed  # packed: a few tokens of padding at most
    assert all(sha256_file(cache / f) == h for f, h in old_shards.items())

    # round 2 trains from round one's weights
    loaded = {}
    load_policy = train_module.load_policy

    def recording(*args, **kw):
        tokenizer, model, aux = load_policy(*args, **kw)
        loaded.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return tokenizer, model, aux

    monkeypatch.setattr(train_module, "load_policy", recording)
    run2 = train(train_config(cache, tmp_path / "run2", max_steps=3, init_from=str(run1))).output_dir
    saved = load_file(str(run1 / "model.safetensors"))
    assert saved.keys() <= loaded.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    state = TrainerState.read(run2)
    assert state.round == 2 and state.parent_run["path"] == str(run1.resolve())
    assert [s["rows"] for s in state.cache_segments] == [24, kept]

    html = write_report(run1, run2, output=tmp_path / "rounds").read_text()
    assert "<h2>Rounds</h2>" in html and html.index("<td>run1</td>") < html.index("<td>run2</td>")
