"""train --init-from: the next round starts from a previous run's trained policy (full weights or LoRA adapter)
against the same frozen reference; its metadata, card and report name the parent and the cache segments."""

import json

import pytest
import torch
from helpers import cli_args, run_cli, train_config
from safetensors.torch import load_file

from kto_pipeline import KTOPipelineError, TrainConfig, train
from kto_pipeline.report import write_report
from kto_pipeline.rundir import TrainerState


def weights(run) -> dict[str, torch.Tensor]:
    return load_file(str(next(run.glob("*.safetensors"))))


@pytest.fixture(scope="module")
def round_one(small_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("rounds")
    full = train(train_config(small_cache, root / "full", max_steps=2)).output_dir
    lora = train(train_config(small_cache, root / "lora", max_steps=2, lora_r=4, lora_alpha=8)).output_dir
    return {"root": root, "full": full, "lora": lora}


def test_full_weights_continue_and_the_run_names_its_parent(round_one, small_cache, tmp_path):
    parent = round_one["full"]
    # learning rate 0: the policy must come out exactly as it went in, i.e. as round one left it
    run = train(train_config(small_cache, tmp_path / "r2", max_steps=1, learning_rate=0.0, init_from=str(parent)))
    ours, theirs = weights(run.output_dir), weights(parent)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    state = TrainerState.read(run.output_dir)
    assert state.round == 2
    assert state.parent_run == {"path": str(parent.resolve()), "global_step": 2, "round": 1, "kind": "full"}
    assert [s["rows"] for s in state.cache_segments] == [24] and state.cache_segments[0]["index"] == 0
    assert state.reference_hash == TrainerState.read(parent).reference_hash is not None
    card = (run.output_dir / "README.md").read_text()
    assert "## Round 2" in card and str(parent.resolve()) in card
    # the rounds side by side, in round order, each naming where it started
    html = write_report(parent, run.output_dir, output=tmp_path / "both").read_text()
    assert "<h2>Rounds</h2>" in html and html.index("<td>full</td>") < html.index("<td>r2</td>")
    assert "<td>reference</td>" in html


def test_an_adapter_trains_on_or_is_merged(round_one, small_cache, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    parent = round_one["lora"]
    run = train(
        train_config(small_cache, tmp_path / "lora2", max_steps=1, learning_rate=0.0, init_from=str(parent), lora_r=4)
    )
    ours, theirs = weights(run.output_dir), weights(parent)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (run.output_dir / "adapter_config.json").exists()
    assert TrainerState.read(run.output_dir).parent_run["kind"] == "adapter"
    # without --lora-r the adapter is merged into its base and the whole model trains
    merged = train(train_config(small_cache, tmp_path / "full2", max_steps=1, learning_rate=0.0, init_from=str(parent)))
    config = json.loads((parent / "adapter_config.json").read_text())
    expected = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), parent
    ).merge_and_unload()
    got = weights(merged.output_dir)
    for name, tensor in expected.state_dict().items():
        if name in got:
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)


def test_bad_init_from_is_refused(round_one, small_cache, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KTOPipelineError, match="holds no trained model"):
        train(train_config(small_cache, tmp_path / "a", init_from=str(empty)))
    with pytest.raises(KTOPipelineError, match="no such directory"):
        train(train_config(small_cache, tmp_path / "b", init_from=str(tmp_path / "nowhere")))
    with pytest.raises(KTOPipelineError, match="cannot be combined with --model"):
        TrainConfig(cache=str(small_cache), output_dir=str(tmp_path / "c"), init_from="x", model="y")
    # a run that trained against another reference
    import shutil

    other = tmp_path / "other"
    shutil.copytree(round_one["full"], other)
    state = json.loads((other / "trainer_state.json").read_text())
    (other / "trainer_state.json").write_text(json.dumps({**state, "reference_hash": "sha256:else"}))
    args = cli_args(cache=small_cache, output_dir=tmp_path / "d", init_from=other)
    code, _, err = run_cli(monkeypatch, capsys, "train", *args)
    assert code == 1 and "trained against another reference (weights sha256:else)" in err
    assert not (tmp_path / "d" / "metrics.jsonl").exists()
