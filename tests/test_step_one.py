"""Step 1 (policy = reference) starts exactly at the reference for every loss family on every cache a user can make:
KTO on a cache of paired data, a pair loss on the same cache (precomputed with KL completions), and a pair loss on a
`--pairs-only` cache, in float32 and under bf16 autocast. The rewards are exactly 0 and `rewards/accuracies` is
trl's at step 1 (0: no margin is above 0).

This holds only if a sequence computes alike whatever the layout around it: the reference pass lays a row's
completion and its KL completion after its prompt, a pair loss's training lays a pair's two answers after theirs
(`scoring/attention.py`). The tiny model's weights are scaled (conftest's `scaled_model_dir`) so that precision
shows; tests/test_real_model.py checks the same on SmolLM2 in bf16."""

import dataclasses
import json

import pytest
from helpers import paired_conversational_rows, read_metrics, train_config, write_jsonl

from kto_pipeline import PrecomputeConfig, precompute, train

CACHES = ("with-kl", "pairs-only")
CASES = [("with-kl", "kto"), ("with-kl", "sigmoid"), ("with-kl", "sppo_hard"), ("pairs-only", "sigmoid")]
CASES += [("pairs-only", "sppo_hard")]


@pytest.fixture(scope="module", params=["float32", "bf16"])
def caches(request, tmp_path_factory, scaled_model_dir):
    root = tmp_path_factory.mktemp(f"step-one-{request.param}")
    data = write_jsonl(root / "pairs.jsonl", paired_conversational_rows(12))
    bf16 = request.param == "bf16"
    made = {
        name: precompute(
            PrecomputeConfig(
                model=str(scaled_model_dir),
                dataset=str(data),
                output=str(root / name),
                max_length=512,
                bf16=bf16,
                pairs_only=name == "pairs-only",
            )
        )
        for name in CACHES
    }
    return made, bf16


@pytest.mark.parametrize("cache, loss_type", CASES)
def test_step_one_is_exactly_the_reference(tmp_path, caches, cache, loss_type):
    made, bf16 = caches
    batch = 8 if loss_type == "kto" else 4  # rows or pairs; KTO's batch holds both answers of some prompts
    settings = dict(loss_type=loss_type, per_device_train_batch_size=batch, max_steps=1, bf16=bf16, learning_rate=1e-6)
    train(train_config(made[cache], tmp_path / "run", **settings))
    first = read_metrics(tmp_path / "run")[0]
    assert first["step"] == 1
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[key] == 0.0, (key, first)
    if loss_type == "kto":
        assert first["kl"] == 0.0, first
    else:
        assert first["rewards/accuracies"] == 0.0, first  # trl's at step 1: no margin is above 0


def test_step_one_is_exactly_the_reference_with_both_stages_compiled_in_bf16(tmp_path, scaled_model_dir):
    """`--torch-compile` in both stages, bf16 autocast, attention by tree: KTO and a pair loss on one cache. Attention
    by tree unrolls a forward's trees into the compiled layer's graph, and every distinct graph costs its kernels'
    compiling, so the cache holds what step 1 reads and no more: two pairs (KTO's batch of 4 rows, the pair loss's
    batch of 2 pairs), one with the longer chosen answer and one with the longer rejected (which answer comes first
    changes the layout), scored in one reference forward (one graph, where several forwards compile a static graph
    and then a dynamic one)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", paired_conversational_rows(6)[3::2])
    config = PrecomputeConfig(
        model=str(scaled_model_dir), dataset=str(data), output=str(tmp_path / "cache"), max_length=512
    )
    one_forward = dict(batch_size=8, max_tokens_per_batch=2048)  # (4 rows: 8 sequences, about 1,300 tokens)
    cache = precompute(dataclasses.replace(config, bf16=True, torch_compile=True, **one_forward))
    assert json.loads((cache / "manifest.json").read_text())["timing"]["forwards"] == 1
    for loss_type, batch in (("kto", 4), ("sigmoid", 2)):
        settings = dict(loss_type=loss_type, per_device_train_batch_size=batch, max_steps=1, learning_rate=1e-6)
        train(train_config(cache, tmp_path / loss_type, bf16=True, torch_compile=True, **settings))
        first = read_metrics(tmp_path / loss_type)[0]
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert first[key] == 0.0, (loss_type, key, first)
        assert first["kl"] == 0.0 if loss_type == "kto" else first["rewards/accuracies"] == 0.0, first


def test_step_one_is_exactly_the_reference_where_dropout_is_functional_or_read_from_the_config(tmp_path):
    """Dropout in every form is off in training: Starcoder2 drops with `nn.functional.dropout` at rates kept as
    attributes (`residual_dropout`, `embedding_dropout`) and hands the attention kernel `attention_dropout`, no
    `nn.Dropout` module among them (zeroing those, as trl's `disable_dropout_in_model` does, leaves all three on).
    Step 1 is exactly the reference; the saved model's config keeps its own rates."""
    import torch
    from transformers import AutoConfig, Starcoder2Config, Starcoder2ForCausalLM

    from kto_pipeline.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    rates = dict(residual_dropout=0.3, embedding_dropout=0.3, attention_dropout=0.3)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = Starcoder2Config(vocab_size=len(tokenizer), **sizes, num_key_value_heads=2, **rates)
    torch.manual_seed(0)
    model = Starcoder2ForCausalLM(config)
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = write_jsonl(tmp_path / "pairs.jsonl", paired_conversational_rows(6))
    cache = precompute(
        PrecomputeConfig(model=str(tmp_path / "model"), dataset=str(data), output=str(tmp_path / "c"), max_length=256)
    )
    for loss_type, batch in (("kto", 4), ("sigmoid", 2)):
        settings = dict(loss_type=loss_type, per_device_train_batch_size=batch, max_steps=1, learning_rate=1e-6)
        train(train_config(cache, tmp_path / loss_type, **settings))
        first = read_metrics(tmp_path / loss_type)[0]
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert first[key] == 0.0, (loss_type, key, first)
        assert first["kl"] == 0.0 if loss_type == "kto" else first["rewards/accuracies"] == 0.0, first
        saved = AutoConfig.from_pretrained(tmp_path / loss_type)
        assert {name: getattr(saved, name) for name in rates} == rates
