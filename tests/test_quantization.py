"""Quantized bases (QLoRA): bitsandbytes' 4-bit and 8-bit layers, which run on this CPU (bitsandbytes >= 0.50's CPU
backend). The reference pass scores with the quantized model, the manifest records it, train builds the same base
under LoRA adapters (step 1 exactly the reference), and matches trl.KTOTrainer given the same quantization."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import paired_conversational_rows, read_metrics, train_config, unpaired_rows, write_jsonl

from kto_pipeline import KTOPipelineError, PrecomputeConfig, TrainConfig, precompute, train

pytest.importorskip("bitsandbytes")

STEP_ONE = ("rewards/chosen", "rewards/rejected", "rewards/margins")


def _precompute(model_dir, tmp_path, name="cache", rows=None, max_length=64, **quantization):
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows or unpaired_rows(16))
    config = PrecomputeConfig(model=str(model_dir), dataset=str(data), output=str(tmp_path / name))
    config.max_length = max_length
    for key, value in quantization.items():
        setattr(config, key, value)
    return precompute(config)


@pytest.fixture(scope="module")
def nf4_cache(tiny_model_dir, tmp_path_factory):
    return _precompute(tiny_model_dir, tmp_path_factory.mktemp("nf4"), load_in_4bit=True)


def test_the_reference_runs_quantized_and_the_manifest_and_inspect_say_how(nf4_cache, tiny_model_dir, tmp_path):
    """The cached log-probs are the quantized model's (not the float model's), and the manifest records the
    quantization with the bitsandbytes version; `inspect` shows it."""
    import bitsandbytes
    from rich.console import Console

    from kto_pipeline.cache import open_cache
    from kto_pipeline.cache.inspect import inspect_cache

    manifest = json.loads((nf4_cache / "manifest.json").read_text())
    assert manifest["reference_model"]["quantization"] == {
        "method": "bitsandbytes",
        "bits": 4,
        "quant_type": "nf4",
        "compute_dtype": "float32",
        "storage": "uint8",
        "nested": False,
        "bitsandbytes_version": bitsandbytes.__version__,
    }
    assert manifest["fingerprint"]["quantization"]["bits"] == 4
    float_cache = _precompute(tiny_model_dir, tmp_path, "float")
    quantized, plain = (open_cache(c).table.column("ref_logp").to_pylist() for c in (nf4_cache, float_cache))
    differences = [abs(q - p) for q, p in zip(quantized, plain, strict=True)]
    assert max(differences) > 1e-4  # the 4-bit weights moved the log-probs
    assert "quantization" not in json.loads((float_cache / "manifest.json").read_text())["reference_model"]
    console = Console(record=True, width=300)
    assert inspect_cache(nf4_cache, console=console) == []
    assert "4-bit nf4 (bitsandbytes, computing in float32, stored as uint8); bitsandbytes" in console.export_text()


def test_a_4bit_layer_computes_its_product_alike_in_eval_and_training(tiny_model_dir):
    """The reference pass (eval mode, no gradient) and training compute a 4-bit layer's product alike, on every CPU:
    bitsandbytes would repack the weight for another kernel at the first eval-mode call on a CPU with AVX512-BF16
    (there, without this, step 1's rewards came 5.8e-4 off 0, its KL 2.8e-3). Checked on the loaded model: no layer
    takes that path, and an eval forward equals a training-mode one bit for bit."""
    from kto_pipeline.models import load_model
    from kto_pipeline.quantization import Quantization

    nested_nf4 = Quantization(4, "nf4", "float32", "uint8", True)
    model = load_model(str(tiny_model_dir), torch.float32, quantization=nested_nf4)
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        evaluated = model.eval()(ids).logits
    trained = model.train()(ids).logits
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    assert torch.equal(evaluated, trained.detach())


@pytest.mark.parametrize("loss_type", ["kto", "sigmoid"])
def test_train_builds_the_caches_quantized_base_under_lora_and_step_one_is_the_reference(
    loss_type, tiny_model_dir, tmp_path
):
    """train without quantization options: the cache's quantized base, LoRA implied (rank 16, trl's --use-peft),
    adapters trained in bf16 as trl's; step 1's rewards exactly 0, for KTO and a pair loss; the saved adapter is
    what peft loads."""
    rows = paired_conversational_rows(8) if loss_type == "sigmoid" else None
    cache = _precompute(
        tiny_model_dir, tmp_path, rows=rows, max_length=256, load_in_4bit=True, use_bnb_nested_quant=True
    )
    out = tmp_path / "run"
    batch = 4 if rows is None else 2
    train(
        train_config(
            cache,
            out,
            loss_type=loss_type,
            per_device_train_batch_size=batch,
            merge=rows is None,  # (no --lora-r: LoRA is implied by the cache's quantized base)
        )
    )
    first = read_metrics(out)[0]
    assert all(first[key] == 0.0 for key in STEP_ONE), first
    assert first["kl"] == 0.0 if loss_type == "kto" else first["rewards/accuracies"] == 0.0
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["peft_type"] == "LORA"
    state = json.loads((out / "run_config.json").read_text())
    assert state["lora_r"] == 16
    card = (out / "README.md").read_text()
    quantized = "4-bit nf4 (bitsandbytes, computing in float32, stored as uint8, nested)"
    assert f"| reference quantization (QLoRA base) | {quantized}" in card
    if rows is None:  # --merge: the adapters merged into the float base, as served (no quantization left)
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(out / "merged")
        assert getattr(merged.config, "quantization_config", None) is None
        assert {p.dtype for p in merged.parameters()} == {torch.float32}


def test_a_quantization_other_than_the_caches_is_refused_naming_both(nf4_cache, tiny_model_dir, tmp_path):
    cases = {
        "load_in_8bit": True,  # another method
        "bnb_4bit_quant_type": "fp4",  # another 4-bit type
        "use_bnb_nested_quant": True,  # nested where the cache's was not
        "load_in_4bit": False,  # none, on a quantized cache
    }
    for option, value in cases.items():
        with pytest.raises(KTOPipelineError, match=r"4-bit nf4 .*cache's reference was quantized|quantized 4-bit nf4"):
            train(TrainConfig(cache=str(nf4_cache), output_dir=str(tmp_path / option), **{option: value}))
    float_cache = _precompute(tiny_model_dir, tmp_path, "float")
    with pytest.raises(KTOPipelineError, match="cache's reference was quantized not at all"):
        train(TrainConfig(cache=str(float_cache), output_dir=str(tmp_path / "q"), load_in_4bit=True))
    with pytest.raises(KTOPipelineError, match="--merge: only applies with --lora-r"):  # (no base implies LoRA)
        train(TrainConfig(cache=str(float_cache), output_dir=str(tmp_path / "m"), merge=True))
    # the cache's own quantization given explicitly (a trl YAML serving both stages) is the cache's: it trains
    train(train_config(nf4_cache, tmp_path / "same", load_in_4bit=True, bnb_4bit_quant_type="nf4", max_steps=1))


def test_bad_quantization_options_are_refused_before_any_work(tiny_model_dir, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(4))
    base = dict(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"))
    refused = {
        "choose one": dict(load_in_4bit=True, load_in_8bit=True),
        "must be one of nf4, fp4, got 'nf5'": dict(load_in_4bit=True, bnb_4bit_quant_type="nf5"),
        "--use-bnb-nested-quant: only applies with --load-in-4bit": dict(use_bnb_nested_quant=True),
        "--torch-compile: not with --load-in-4bit": dict(load_in_4bit=True, torch_compile=True),
    }
    for message, options in refused.items():
        with pytest.raises(KTOPipelineError, match=message.replace("(", r"\(")):
            precompute(PrecomputeConfig(**base, **options))
    # an already quantized checkpoint
    config = json.loads((tiny_model_dir / "config.json").read_text())
    quantized = tmp_path / "gptq"
    quantized.mkdir()
    for f in tiny_model_dir.iterdir():
        (quantized / f.name).write_bytes(f.read_bytes())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(KTOPipelineError, match=r"already quantized \(gptq\)"):
        precompute(PrecomputeConfig(**{**base, "model": str(quantized)}, load_in_4bit=True))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(KTOPipelineError, match="a GGUF file is quantized by llama.cpp's own scheme"):
        precompute(PrecomputeConfig(**{**base, "model": str(gguf)}, load_in_4bit=True))
    # bitsandbytes missing: the install line
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(KTOPipelineError, match=r"bitsandbytes is not installed: pip install 'kto-pipeline\[qlora\]'"):
        precompute(PrecomputeConfig(**base, load_in_8bit=True))


def trl_with_one_product(monkeypatch) -> None:
    """trl's 4-bit layers as ours: on a CPU with AVX512-BF16 bitsandbytes repacks a 4-bit weight at its first
    eval-mode, gradient-free call (trl's reference pass, in the trainer's constructor) for a kernel whose products
    differ from training's and that passes no gradient to the layer's input (measured: trl's step-1 grad norm 0.101
    against 0.157); every layer built after this runs the dequantized product, as on every other machine."""
    import bitsandbytes.nn.modules

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: False)


def test_qlora_training_matches_trl_with_the_same_quantization(tiny_model_dir, tmp_path, monkeypatch):
    """trl.KTOTrainer given the model's path, BitsAndBytesConfig (NF4, nested, computing in float32) and a LoRA
    config, its reference precomputed (the base with the adapters off), against ours from a cache made with
    --load-in-4bit: the reference log-probs, then 3 steps of loss, grad norm and rewards."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from kto_pipeline.quantization import Quantization

    data = write_jsonl(tmp_path / "data.jsonl", unpaired_rows(24))
    settings = dict(learning_rate=3e-3, seed=42, beta=0.1, max_grad_norm=0.5, weight_decay=0.1, logging_steps=1)
    settings |= dict(lr_scheduler_type="linear", max_steps=3, max_length=64)
    quantization = Quantization(4, "nf4", "float32", "uint8", True)
    dataset = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(tmp_path / "hf"))
    trl_with_one_product(monkeypatch)
    trainer = KTOTrainer(
        model=str(tiny_model_dir),
        args=KTOConfig(
            output_dir=str(tmp_path / "trl"),
            precompute_ref_log_probs=True,
            bf16=False,
            per_device_train_batch_size=4,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            loss_type="apo_zero_unpaired",
            warmup_steps=0,
            model_init_kwargs={"dtype": torch.float32},
            **settings,
        ),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        quantization_config=quantization.transformers_config(),
        peft_config=LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    assert trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.uint8
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]

    cache = _precompute(
        tiny_model_dir, tmp_path, "ours", unpaired_rows(24), load_in_4bit=True, use_bnb_nested_quant=True
    )
    run = {k: v for k, v in settings.items() if k != "max_length"}
    train(
        TrainConfig(
            cache=str(cache),
            output_dir=str(tmp_path / "run"),
            loss_type="apo_zero_unpaired",
            per_device_train_batch_size=4,
            warmup_ratio=0.0,
            bf16=False,
            train_sampling_strategy="sequential",
            lora_r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            **run,
        )
    )
    ours = read_metrics(tmp_path / "run")
    assert len(ours) == len(theirs) == 3
    # the reference log-probs: at step 1 both policies are their reference (trl's: the base with the adapters off,
    # scored by trl; ours: the cache), so the rewards are 0 and the policies' summed log-probs are the references'
    assert ours[0]["rewards/chosen"] == 0.0 and abs(theirs[0]["rewards/chosen"]) < 1e-6
    for name in ("logps/chosen", "logps/rejected"):
        assert ours[0][name] == pytest.approx(theirs[0][name], rel=1e-4), name
    for step, (mine, expected) in enumerate(zip(ours, theirs, strict=True), start=1):
        for name in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            if name in expected:
                assert mine[name] == pytest.approx(expected[name], rel=2e-3, abs=1e-5), (step, name, mine, expected)
    assert abs(theirs[-1]["loss"] - theirs[0]["loss"]) > 1e-3  # the adapters moved the policy


QLORA_YAML = """# written for `trl kto --config` (QLoRA), plus the one line `cache:`
model_name_or_path: {model}
dataset_name: {data}
output_dir: {out}
cache: {cache}
dtype: float32
load_in_4bit: true
bnb_4bit_quant_type: nf4
use_bnb_nested_quant: true
use_peft: true
lora_r: 8
lora_alpha: 16
lora_target_modules: all-linear
max_length: 64
learning_rate: 1.0e-3
per_device_train_batch_size: 4
max_steps: 2
logging_steps: 1
bf16: false
"""


def test_a_trl_qlora_yaml_runs_both_stages(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """The documented QLoRA YAML (trl's keys) plus `cache:` runs precompute, then train on the cache's quantized
    base, step 1 exactly the reference."""
    from helpers import run_cli

    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows(12))
    recipe = tmp_path / "qlora.yaml"
    recipe.write_text(QLORA_YAML.format(model=tiny_model_dir, data=data, out=tmp_path / "run", cache=tmp_path / "c"))
    code, _, err = run_cli(monkeypatch, capsys, "precompute", "--config", str(recipe))
    assert code == 0, err
    code, out, err = run_cli(monkeypatch, capsys, "train", "--config", str(recipe))
    assert code == 0, err
    assert "its base's linear layers 4-bit nf4 (bitsandbytes, computing in float32, stored as uint8, nested)" in out
    first = read_metrics(tmp_path / "run")[0]
    assert all(first[key] == 0.0 for key in STEP_ONE), first


def test_an_8bit_base_trains_and_says_step_one_is_near_zero_not_exact(tiny_model_dir, tmp_path, capsys):
    """LLM.int8(): the reference pass and train run on an 8-bit base; bitsandbytes computes training's products
    otherwise than the reference pass's (on a CPU its dequantized float product), which train says; step 1 is then
    near 0 (within 1e-3 here), not exactly."""
    cache = _precompute(tiny_model_dir, tmp_path, load_in_8bit=True)
    assert json.loads((cache / "manifest.json").read_text())["reference_model"]["quantization"]["bits"] == 8
    train(train_config(cache, tmp_path / "run", max_steps=1))
    assert "an 8-bit base (LLM.int8()) computes its products otherwise in training" in capsys.readouterr().out
    first = read_metrics(tmp_path / "run")[0]
    assert all(abs(first[key]) < 1e-3 for key in STEP_ONE), first


@pytest.mark.parametrize("bits,nested", [(4, False), (4, True), (8, False)], ids=["nf4", "nf4-nested", "int8"])
def test_estimate_memory_counts_the_quantized_weights_bitsandbytes_holds(tiny_model_dir, bits, nested):
    """estimate-memory's size of a quantized base's linear layers is what bitsandbytes holds for them (weights,
    scales, nested scales), counted on a real quantized model; a QLoRA estimate keeps the LoRA step's activations
    and moves its weights by exactly that."""
    import dataclasses

    import bitsandbytes as bnb
    from transformers import AutoConfig, AutoModelForCausalLM

    from kto_pipeline.config import MemoryEstimateConfig
    from kto_pipeline.memory.estimate import estimate, quantized_bytes, quantized_linears
    from kto_pipeline.quantization import Quantization

    quantization = Quantization(bits, "nf4", "float32", "uint8", nested)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, quantization_config=quantization.transformers_config(), dtype=torch.float32
    )
    held = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            held += module.weight.numel() + state.absmax.numel() * state.absmax.element_size()
            held += state.state2.absmax.numel() * state.state2.absmax.element_size() if state.nested else 0
        elif isinstance(module, bnb.nn.Linear8bitLt):
            held += module.weight.numel() + module.weight.SCB.numel() * module.weight.SCB.element_size()
    shapes, _, _ = quantized_linears(AutoConfig.from_pretrained(tiny_model_dir))
    assert quantized_bytes(shapes, bits, nested) == held > 0
    config = MemoryEstimateConfig(model=str(tiny_model_dir), per_device_train_batch_size=2, max_length=64, bf16=True)
    lora = estimate(dataclasses.replace(config, lora_r=16))
    quantized = estimate(
        dataclasses.replace(config, load_in_4bit=bits == 4, load_in_8bit=bits == 8, use_bnb_nested_quant=nested)
    )
    assert quantized["settings"]["lora_r"] == 16
    assert quantized["breakdown"]["activations"] == lora["breakdown"]["activations"]
    assert quantized["breakdown"]["parameters"] < lora["breakdown"]["parameters"]


def test_qlora_sigmoid_matches_trl_dpo_with_the_same_quantization(tiny_model_dir, tmp_path, monkeypatch):
    """trl.DPOTrainer (sigmoid) given the model's path, the same BitsAndBytesConfig (NF4 computing in float32) and
    LoRA config, its reference precomputed, against ours from a --load-in-4bit cache of the same pairs: step 1's
    rewards 0 and log-probs equal (the reference), then 3 steps of loss, grad norm and rewards."""
    import datasets
    from peft import LoraConfig
    from test_dpo_parity import paired_rows
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from kto_pipeline.quantization import Quantization

    data = write_jsonl(tmp_path / "pairs.jsonl", paired_rows())
    settings = dict(learning_rate=3e-3, seed=42, beta=0.1, max_grad_norm=0.5, weight_decay=0.1, logging_steps=1)
    settings |= dict(lr_scheduler_type="linear", max_steps=3)
    dataset = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(tmp_path / "hf"))
    trl_with_one_product(monkeypatch)
    trainer = DPOTrainer(
        model=str(tiny_model_dir),
        args=DPOConfig(
            output_dir=str(tmp_path / "trl"),
            precompute_ref_log_probs=True,
            bf16=False,
            per_device_train_batch_size=4,
            train_sampling_strategy="sequential",
            max_length=48,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            warmup_steps=0,
            model_init_kwargs={"dtype": torch.float32},
            **settings,
        ),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        quantization_config=Quantization(4, "nf4", "float32", "uint8", False).transformers_config(),
        peft_config=LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    cache = _precompute(tiny_model_dir, tmp_path, "ours", paired_rows(), max_length=48, load_in_4bit=True)
    train(
        TrainConfig(
            cache=str(cache),
            output_dir=str(tmp_path / "run"),
            loss_type="sigmoid",
            per_device_train_batch_size=4,
            warmup_ratio=0.0,
            bf16=False,
            train_sampling_strategy="sequential",
            lora_r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            **settings,
        )
    )
    ours = read_metrics(tmp_path / "run")
    assert len(ours) == len(theirs) == 3
    assert ours[0]["rewards/chosen"] == 0.0 and abs(theirs[0]["rewards/chosen"]) < 1e-6
    for step, (mine, expected) in enumerate(zip(ours, theirs, strict=True), start=1):
        for name in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
            assert mine[name] == pytest.approx(expected[name], rel=2e-3, abs=1e-5), (step, name, mine, expected)
    assert abs(theirs[-1]["loss"] - theirs[0]["loss"]) > 1e-3
