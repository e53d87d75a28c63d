"""LoRA/PEFT training on the cached reference, adapters as --model, and mixture-of-experts models."""

import json
import shutil

import pytest
import torch
from helpers import cli_args, launch, read_metrics, train_config, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.demo.tiny import build_char_tokenizer


def lora_cfg(cache, out, **kw):
    """helpers.train_config with a LoRA (r 8, no dropout) at a learning rate it learns at in 3 steps."""
    return train_config(cache, out, **{**dict(learning_rate=1e-2, lora_r=8, lora_alpha=16, lora_dropout=0.0), **kw})


def test_lora_starts_at_the_reference_and_trains_only_adapters(small_cache, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    train(lora_cfg(small_cache, out, max_steps=4, save_steps=2, merge=True))
    first = read_metrics(out)[0]
    assert abs(first["rewards/chosen"]) < 1e-4 and abs(first["rewards/rejected"]) < 1e-4  # B = 0 at step 1
    assert abs(read_metrics(out)[-1]["rewards/margins"]) > 1e-3  # and then it learns

    # only adapter parameters have optimizer state
    opt = torch.load(out / "checkpoint-2" / "accelerate_state" / "optimizer.bin", weights_only=False)
    policy = AutoPeftModelForCausalLM.from_pretrained(out)
    lora_params = [n for n, _ in policy.named_parameters() if "lora_" in n]
    assert len(opt["state"]) == len(lora_params) == 2 * 7 * 2  # A and B, 7 linear layers, 2 layers
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists()  # the adapter, not a full copy

    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    ids = torch.randint(4, 100, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_lora_target_modules_and_lm_head_refusal(small_cache, tmp_path):
    from peft import AutoPeftModelForCausalLM

    train(lora_cfg(small_cache, tmp_path / "qv", lora_target_modules="q_proj,v_proj", max_steps=1))
    names = {
        n for n, _ in AutoPeftModelForCausalLM.from_pretrained(tmp_path / "qv").named_parameters() if "lora_A" in n
    }
    assert names and all(".q_proj." in n or ".v_proj." in n for n in names)
    with pytest.raises(KTOPipelineError, match="lm_head cannot carry an adapter"):
        lora_cfg(small_cache, tmp_path / "x", lora_target_modules="q_proj,lm_head")


def test_lora_resume_reproduces_the_run(small_cache, tmp_path):
    full = tmp_path / "full"
    train(lora_cfg(small_cache, full, max_steps=5, save_steps=2))
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    (resumed / "adapter_model.safetensors").unlink()
    train(lora_cfg(small_cache, resumed, max_steps=5, save_steps=2, resume_from=str(resumed / "checkpoint-4")))
    assert read_metrics(resumed) == read_metrics(full)


def test_adapter_directory_as_model_for_a_second_round(small_cache, tmp_path):
    """precompute and train accept a saved LoRA model; the reference is its base with the adapter merged."""
    first = tmp_path / "round1"
    train(lora_cfg(small_cache, first, max_steps=3))
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows())
    cache2 = precompute(
        PrecomputeConfig(model=str(first), dataset=str(data), output=str(tmp_path / "cache2"), max_length=64)
    )
    out = tmp_path / "round2"
    train(
        TrainConfig(cache=str(cache2), output_dir=str(out), per_device_train_batch_size=4, max_steps=1, logging_steps=1)
    )
    (m,) = read_metrics(out)  # policy (round-1 model) == reference (round-1 model)
    assert abs(m["rewards/chosen"]) < 1e-4 and abs(m["rewards/rejected"]) < 1e-4
    old = json.loads((small_cache / "manifest.json").read_text())["reference_model"]["weights_hash"]
    new = json.loads((cache2 / "manifest.json").read_text())["reference_model"]["weights_hash"]
    assert old != new  # the round-1 model, not the original base, is the new reference


@pytest.mark.slow
def test_lora_under_two_processes(small_cache, tmp_path):
    out = tmp_path / "lora2"
    args = cli_args(cache=small_cache, output_dir=out, lora_r=8, max_steps=3, per_device_train_batch_size=2)
    args += cli_args(logging_steps=1, learning_rate="1e-2", save_steps=2)
    proc = launch(2, "train", *args, env=dict(ACCELERATE_USE_CPU="1"), log_dir=tmp_path / "logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    assert (out / "adapter_model.safetensors").exists() and (
        out / "checkpoint-2" / "adapter_model.safetensors"
    ).exists()


@pytest.fixture(scope="module")
def moe_cache(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    root = tmp_path_factory.mktemp("moe")
    tok = build_char_tokenizer()
    config = MixtralConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    data = write_jsonl(root / "d.jsonl", unpaired_rows())
    return precompute(
        PrecomputeConfig(model=str(root / "model"), dataset=str(data), output=str(root / "cache"), max_length=64)
    )


def test_moe_adds_the_load_balancing_loss(moe_cache, tmp_path):
    base = dict(
        cache=str(moe_cache), per_device_train_batch_size=4, max_steps=2, logging_steps=1, seed=0, learning_rate=1e-3
    )
    train(TrainConfig(output_dir=str(tmp_path / "default"), **base))
    train(TrainConfig(output_dir=str(tmp_path / "off"), router_aux_loss_coef=0.0, **base))
    train(TrainConfig(output_dir=str(tmp_path / "strong"), router_aux_loss_coef=1.0, **base))
    default, off, strong = (read_metrics(tmp_path / n)[0] for n in ("default", "off", "strong"))
    assert "aux_loss" not in off and default["aux_loss"] > 0
    # at step 1 the KTO part is identical (policy == reference), so the loss differs by coef * aux_loss
    assert default["loss"] - off["loss"] == pytest.approx(0.02 * default["aux_loss"], rel=1e-4)
    assert strong["loss"] - off["loss"] == pytest.approx(1.0 * strong["aux_loss"], rel=1e-4)


def test_router_aux_loss_coef_on_a_dense_model_is_refused(small_cache, tmp_path):
    with pytest.raises(KTOPipelineError, match="not a mixture-of-experts model"):
        train(TrainConfig(cache=str(small_cache), output_dir=str(tmp_path / "x"), router_aux_loss_coef=0.1))
