"""The model card: OUT/README.md parses as a Hub card, records the run and its cache, and its code runs."""

import re

import pytest
import torch
from helpers import train_config, unpaired_rows, write_jsonl

from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import open_cache
from kto_pipeline.model_card import build_model_card, is_hub_id

cfg = train_config


def load_card(path):
    from huggingface_hub import ModelCard

    return ModelCard.load(path)


def snippet(text: str) -> str:
    """The python block of the card's "How to load it" section."""
    section = text.split("## How to load it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_snippet(code: str, path, capsys) -> dict:
    """Run the card's loading code (its model id pointing at `path`); returns its variables."""
    code, n = re.subn(r'^model_id = "[^"]*"', f'model_id = "{path}"', code, flags=re.M)
    assert n == 1
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    capsys.readouterr()
    return namespace


@pytest.fixture(scope="module")
def eval_cache(tmp_path_factory, tiny_model_dir):
    """Held-out rows: indices 24-31 of the row generator, which the training cache (0-23) does not hold."""
    root = tmp_path_factory.mktemp("eval")
    data = write_jsonl(root / "eval.jsonl", unpaired_rows(32)[24:])
    return precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(data), output=str(root / "cache"), split="test", max_length=64
        )
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_cache, eval_cache):
    out = tmp_path_factory.mktemp("runs") / "kto-tiny"
    result = train(cfg(small_cache, out, beta=0.25, eval_cache=str(eval_cache), eval_steps=2))
    return out, result


def test_train_writes_a_hub_model_card(run, small_cache, eval_cache, tiny_model_dir):
    out, result = run
    card = load_card(out / "README.md")
    manifest = open_cache(small_cache).manifest
    assert card.data.library_name == "transformers"
    assert card.data.model_name == "kto-tiny"
    assert {"kto", "kto-pipeline"} <= set(card.data.tags) and "lora" not in card.data.tags
    # the base model and the data are local paths: the Hub refuses them as metadata, so the body names them
    assert card.data.base_model is None and card.data.datasets is None
    assert f"fine-tuned version of `{tiny_model_dir}`" in card.text
    assert f"`{manifest['dataset']['name_or_path']}`" in card.text

    final_eval = [m for m in result.metrics if "eval_reward_accuracy" in m]
    assert [m["step"] for m in final_eval] == [2, 3]  # evaluated twice: the card reports the last one
    accuracy = f"{100 * final_eval[-1]['eval_reward_accuracy']:.1f}%"
    assert f"Held-out evaluation at step 3 on the cache `{eval_cache}`" in card.text
    assert f"for **{accuracy}** of 8 rows" in card.text
    assert f"| eval_reward_accuracy | {accuracy} |" in card.text
    assert f"| eval_loss | {final_eval[-1]['eval_loss']:.4g} |" in card.text
    final_train = [m for m in result.metrics if "loss" in m][-1]
    assert f"| loss | {final_train['loss']:.4g} |" in card.text
    assert f"| rewards/margins | {final_train['rewards/margins']:.4g} |" in card.text

    assert f"`{manifest['reference_model']['weights_hash']}`" in card.text
    assert f"`{manifest['dataset']['content_hash']}`" in card.text
    assert f"`{manifest['tokenizer']['hash']}`" in card.text
    assert "| rows (desirable / undesirable) | 24 (16 / 8) |" in card.text
    assert "| beta | 0.25 |" in card.text
    assert "| optimizer steps run | 3 |" in card.text
    assert "| batch (per device x accumulation x processes) | 4 x 1 x 1 = 4 rows |" in card.text
    assert "| max_length | 64 (the cached one) |" in card.text
    assert "arXiv:2402.01306" in card.text and "- Transformers: " in card.text and "PEFT" not in card.text


def test_loading_snippet_loads_the_trained_model(run, tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM

    out, _ = run
    code = snippet((out / "README.md").read_text())
    assert f'model_id = "{out.resolve()}"' in code and "apply_chat_template" in code
    ns = run_snippet(code, out, capsys)
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    loaded = ns["model"].state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(loaded[name], trained[name])
    assert not torch.equal(loaded[name], initial[name])  # the trained weights, not the base model's
    assert ns["output"].shape[1] > ns["inputs"]["input_ids"].shape[1]  # it generated


def test_lora_card_and_merged_card(small_cache, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora-run"
    train(cfg(small_cache, out, max_steps=2, lora_r=8, lora_alpha=16, lora_dropout=0.0, merge=True))
    card = load_card(out / "README.md")
    assert {"kto", "kto-pipeline", "lora", "peft"} <= set(card.data.tags)
    assert card.data.library_name == "peft"
    assert "This folder holds LoRA adapters (not a full model)" in card.text
    assert "| LoRA r / alpha / dropout / targets | 8 / 16 / 0 / `all-linear` |" in card.text
    assert f"`{out.resolve() / 'merged'}`" in card.text
    assert "- PEFT: " in card.text and "No held-out evaluation was run" in card.text
    code = snippet(card.text)
    assert "AutoPeftModelForCausalLM.from_pretrained" in code
    ns = run_snippet(code, out, capsys)
    assert isinstance(ns["model"], PeftModel) and any("lora_B" in n for n, _ in ns["model"].named_parameters())

    merged = load_card(out / "merged" / "README.md")
    assert merged.data.library_name == "transformers" and merged.data.model_name == "lora-run-merged"
    assert "lora" not in merged.data.tags and "(LoRA adapters merged into its weights)" in merged.text
    code = snippet(merged.text)
    assert "AutoModelForCausalLM.from_pretrained" in code and "peft" not in code
    ns = run_snippet(code, out / "merged", capsys)
    expected = AutoModelForCausalLM.from_pretrained(out / "merged").state_dict()
    for name, value in ns["model"].state_dict().items():
        torch.testing.assert_close(value, expected[name])


# ------------------------------------------------------------------------------ the builder, unit-tested


def fake_manifest(model: str, dataset: str) -> dict:
    return {
        "format_version": 1,
        "tool": {"name": "kto-pipeline", "version": "0.1.0"},
        "reference_model": {
            "name_or_path": model,
            "revision": None,
            "weights_hash": "sha256:" + "a" * 64,
            "architecture": "Qwen2ForCausalLM",
        },
        "tokenizer": {"name_or_path": model, "hash": "sha256:" + "b" * 64},
        "dataset": {"name_or_path": dataset, "config": None, "split": "train", "content_hash": "fingerprint:c0ffee"},
        "settings": {"max_length": 1024, "dtype": "bfloat16", "kl_seed": 0},
        "counts": {"rows": 1000, "desirable": 600, "undesirable": 400, "dropped": {"prompt_too_long": 3}},
    }


def card_for(model: str, dataset: str, history=(), **kw) -> str:
    config = TrainConfig(cache="/caches/c", output_dir="/runs/my-kto-run").to_dict()
    return build_model_card(
        config, fake_manifest(model, dataset), list(history), adapter=False, model_path="/runs/my-kto-run", **kw
    )


def test_hub_ids_go_in_the_metadata_local_paths_in_the_body(tmp_path):
    from huggingface_hub import ModelCard

    hub = ModelCard(card_for("Qwen/Qwen2.5-0.5B-Instruct", "trl-lib/kto-mix-14k"))
    assert hub.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert hub.data.datasets == ["trl-lib/kto-mix-14k"]
    assert "[trl-lib/kto-mix-14k](https://huggingface.co/datasets/trl-lib/kto-mix-14k)" in hub.text
    assert "| rows dropped | 3 (prompt_too_long: 3) |" in hub.text

    text = card_for("/models/sft-7b", "/data/feedback.jsonl")
    front_matter = text.split("---")[1]
    assert "datasets" not in front_matter and "base_model" not in front_matter
    local = ModelCard(text)
    assert local.data.datasets is None and local.data.base_model is None
    assert "`/data/feedback.jsonl`" in local.text and "fine-tuned version of `/models/sft-7b`" in local.text


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("trl-lib/kto-mix-14k", True),
        ("imdb", True),
        ("/data/feedback.jsonl", False),
        ("feedback.jsonl", False),
        ("./data", False),
        ("a/b/c", False),
        ("", False),
    ],
)
def test_is_hub_id(name, expected):
    assert is_hub_id(name) is expected


def test_an_existing_relative_directory_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "runs" / "sft").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("runs/sft")  # reads like "org/name", but from_pretrained would load the directory


def test_plain_tokenizer_snippet_runs_and_processes_are_counted(tiny_model_dir, capsys):
    """Without a chat template the card uses transformers.pipeline on plain text, as trl's quick start."""
    history = [{"loss": 0.4, "rewards/chosen": 0.1, "kl": 0.0, "step": 7, "epoch": 1.0}]
    text = card_for("Qwen/Qwen2.5-0.5B", "trl-lib/kto-mix-14k", history, chat_template=False, num_processes=2)
    assert "| batch (per device x accumulation x processes) | 8 x 1 x 2 = 16 rows |" in text
    assert "| optimizer steps run | 7 |" in text and "No held-out evaluation was run" in text
    code = snippet(text)
    assert 'pipeline("text-generation"' in code and "apply_chat_template" not in code
    ns = run_snippet(code, tiny_model_dir, capsys)
    assert ns["generator"].model.config.num_hidden_layers == 2


def test_a_local_copy_of_a_hub_model_passes_its_declared_base_model_on(tmp_path):
    """The demo's SmolLM2 is a local conversion whose own card declares the hub model: the run's card names it."""
    from huggingface_hub import ModelCard

    local = tmp_path / "SmolLM2-135M-Instruct"
    local.mkdir()
    (local / "README.md").write_text("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n---\n# converted\n")
    card = ModelCard(card_for(str(local), "/data/feedback.jsonl"))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert f"`{local}`" in card.text  # the body still names the directory it was trained from

    (local / "README.md").write_text("# no front matter\n")
    assert ModelCard(card_for(str(local), "/data/feedback.jsonl")).data.base_model is None


def test_every_loss_family_has_its_card_text_and_every_loss_its_sentence():
    """A family added to the registry without its `FAMILY_CARDS` entry fails here, not on a user's first card; each
    of its losses gets a first sentence naming it and rows of the family's options."""
    from kto_pipeline.model_card import FAMILY_CARDS
    from kto_pipeline.objectives import OBJECTIVES

    assert sorted(o.name for o in OBJECTIVES) == sorted(FAMILY_CARDS)
    for objective in OBJECTIVES:
        card = FAMILY_CARDS[objective.name]
        for loss_type in objective.loss_types:
            smoothing = 1e-3 if loss_type == "exo_pair" else 0.0  # exo_pair needs > 0
            config = TrainConfig(cache="/c", output_dir="/o", loss_type=loss_type, label_smoothing=smoothing).to_dict()
            sentence = card.sentence(config, "This model", "the data")
            assert f"`{loss_type}`" in sentence and card.paper["id"] in sentence, sentence
            assert all(
                isinstance(name, str) and isinstance(value, str) for name, value in card.rows(config, objective.options)
            )
