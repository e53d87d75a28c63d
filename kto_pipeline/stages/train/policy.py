"""The policy as stage 2 trains it: loaded, made ready to train, and its optimizer.

`load_policy` loads the policy only (never a reference model) with the cache's tokenizer, starting from the cache's
reference, from --model, or from a previous round's weights or adapter (--init-from), and makes it ready to train
(`ready_to_train`: no KV cache, no dropout, gradient checkpointing, LoRA). `make_optimizer` builds the optimizer
over its trainable parameters. `train` calls them, and so does `estimate-memory` (`kto_pipeline/memory`), so that
what it measures is what train runs.
"""

from __future__ import annotations

import json

import torch

from kto_pipeline.cache import Manifest
from kto_pipeline.config import TrainConfig
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.files import tokenizer_hash
from kto_pipeline.models import (
    disable_dropout,
    language_model,
    load_balancing_coef,
    load_model,
    load_tokenizer,
    text_config,
)
from kto_pipeline.rundir import InitPoint, read_init_point
from kto_pipeline.runtime.launch import print0
from kto_pipeline.runtime.precision import WEIGHT_DTYPES
from kto_pipeline.scoring.attention import enable_checkpointing


def init_point(config: TrainConfig, manifest: Manifest, accelerator) -> InitPoint | None:
    """--init-from: the previous round's policy, checked to have trained against this cache's frozen reference."""
    if config.init_from is None:
        return None
    init = read_init_point(config.init_from)
    ours = manifest.reference["weights_hash"]
    if init.reference_hash is None:
        print0(
            accelerator, f"note: {init.run_dir} does not record its reference; it cannot be checked against the cache's"
        )
    elif init.reference_hash != ours:
        raise KTOPipelineError(
            f"--init-from {init.run_dir} trained against another reference (weights {init.reference_hash}) than the "
            f"cache's ({manifest.reference_model}, weights {ours}). A round continues against the same frozen "
            "reference: use a cache precomputed with that run's reference."
        )
    if init.kind == "adapter" and config.lora_r is not None:
        adapter = json.loads((init.run_dir / "adapter_config.json").read_text())
        if (adapter.get("r"), adapter.get("lora_alpha")) != (config.lora_r, config.lora_alpha):
            print0(
                accelerator,
                f"note: the adapter of {init.run_dir} trains on with its own r {adapter.get('r')} and alpha "
                f"{adapter.get('lora_alpha')} (--lora-r {config.lora_r} --lora-alpha {config.lora_alpha} not applied)",
            )
    what = "LoRA adapter" if init.kind == "adapter" else "weights"
    step = f" at step {init.global_step}" if init.global_step is not None else ""
    print0(accelerator, f"round {init.round + 1}: starting from the {what} of {init.run_dir}{step}")
    return init


def load_base(
    config: TrainConfig, manifest: Manifest, init: InitPoint | None = None, quantization=None, dtype: str | None = None
):
    """The full weights training started from, as loaded: the cache's reference unless --model, or --init-from's
    weights (an adapter's base for an adapter); in float32 (or `dtype`), or with `quantization` (the cache's)
    quantized as the reference was, its other weights in the reference's dtype."""
    if quantization is not None:
        dtype = manifest.precision[0]
    dtype = WEIGHT_DTYPES[dtype or "float32"]
    trust = config.trust_remote_code
    if init is not None:
        name = str(init.run_dir) if init.kind == "full" else init.base
        return load_model(name, dtype, None, trust, "--init-from", quantization)
    model_name = config.model or manifest.reference_model
    revision = None if config.model else manifest.reference_revision
    return load_model(model_name, dtype, revision, trust, "--model", quantization)


def load_policy(config: TrainConfig, manifest: Manifest, init: InitPoint | None = None, engine=None, quantization=None):
    """(tokenizer, policy, MoE aux-loss weight): the policy only, with the cache's tokenizer, ready to train. Its
    weights are loaded as `engine` loads a model (`Engine.load`: on a sharding engine, maybe by one process only);
    with `quantization`, its base quantized (QLoRA)."""
    if init is not None:
        model_name, revision = str(init.run_dir), None
    else:
        model_name = config.model or manifest.reference_model
        revision = None if config.model else manifest.reference_revision
    tokenizer = load_tokenizer(model_name, revision, config.trust_remote_code)
    if tokenizer_hash(tokenizer) != manifest.tokenizer_hash:
        raise KTOPipelineError(
            f"the tokenizer of --model {model_name} differs from the one the cache was made with "
            f"({manifest.tokenizer_name}): vocabulary, special tokens or chat template. Token ids "
            "would not mean the same thing. Train a model that shares the cache's tokenizer, or precompute a "
            "new cache with this model."
        )
    read = lambda: load_base(config, manifest, init, quantization)  # noqa: E731
    model = engine.load(read, config.trust_remote_code) if engine is not None else read()
    aux_coef = router_aux_coef(model, config)
    model = ready_to_train(model, config, init)
    if quantization is not None:
        adapters_in_bf16(model)
    return tokenizer, model, aux_coef


def adapters_in_bf16(model) -> None:
    """On a quantized base the trainable LoRA weights are kept in bf16, as trl does after the QLoRA paper (section
    3), but a DoRA magnitude vector (its updates can fall below bf16's resolution)."""
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)


def ready_to_train(model, config: TrainConfig, init: InitPoint | None = None):
    """`model` as train trains it, in this order: no KV cache, no dropout, gradient checkpointing, then the LoRA
    adapter (fresh with --lora-r, or --init-from's), or the whole model trainable."""
    model.config.use_cache = False
    disable_dropout(model)  # the base model's; LoRA's own dropout (--lora-dropout) is added after
    tower = vision_tower(model)
    if tower is not None and config.freeze_vision_tower:
        tower.requires_grad_(False)
    if config.gradient_checkpointing:
        # recompute each layer's activations in the backward instead of keeping them
        enable_checkpointing(model)
    if init is not None and init.kind == "adapter":
        from peft import PeftModel

        # with --lora-r the previous round's adapter trains on; without, it is merged and the whole model trains
        model = PeftModel.from_pretrained(model, init.run_dir, is_trainable=config.lora_r is not None)
        if config.lora_r is None:
            model = model.merge_and_unload().requires_grad_(True)  # (peft froze the base)
        elif config.gradient_checkpointing:
            model.enable_input_require_grads()
    elif config.lora_r is not None:
        model = add_lora(model, config)
    return model


def vision_tower(model):
    """A vision-language model's vision tower (the module that encodes images), or None for a text model."""
    body = getattr(model, "base_model", model)
    for name in ("vision_tower", "vision_model", "visual", "vision_encoder"):
        tower = getattr(body, name, None)
        if isinstance(tower, torch.nn.Module):
            return tower
    return None


def make_optimizer(config: TrainConfig, model) -> torch.optim.Optimizer:
    """--optim, no decay on biases and norm weights. transformers.Trainer's default is AdamW with its fused kernel
    (`adamw_torch_fused`, the update trl runs): one kernel for all parameters (see benchmarks/RESULTS.md for its
    speed); `adamw_torch` its per-tensor loop; bitsandbytes' 8-bit AdamW (moments in 8 bits) where installed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if config.optim in ("adamw_torch_fused", "adamw_torch"):
        return torch.optim.AdamW(groups, lr=config.learning_rate, fused=config.optim == "adamw_torch_fused")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise KTOPipelineError(
            f"--optim {config.optim}: bitsandbytes is not installed (pip install bitsandbytes); or choose "
            "adamw_torch_fused or adamw_torch."
        ) from None
    cls = bnb.optim.PagedAdamW8bit if config.optim.startswith("paged") else bnb.optim.AdamW8bit
    return cls(groups, lr=config.learning_rate)


def router_aux_coef(model, config: TrainConfig) -> float:
    """The MoE load-balancing weight (as trl): the flag's, else the model config's; 0 when not a MoE model."""
    if config.router_aux_loss_coef and not hasattr(text_config(model), "output_router_logits"):
        raise KTOPipelineError(
            f"--router-aux-loss-coef {config.router_aux_loss_coef}: {type(model).__name__} is not a "
            "mixture-of-experts model that returns router logits, so there is no load-balancing loss to weight."
        )
    return load_balancing_coef(model, config.router_aux_loss_coef)


def add_lora(model, config: TrainConfig):
    """Wrap the policy with fresh PEFT LoRA adapters (B = 0, so the policy starts equal to the reference)."""
    from peft import LoraConfig, get_peft_model

    targets = config.lora_target_modules
    names = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=language_model_targets(model, names),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if config.gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings: checkpointed layers still need a grad path
    return model


def language_model_targets(model, names: str | list[str]) -> str | list[str]:
    """LoRA's target modules: `names` ("all-linear" or module names) as peft takes them; for a vision-language model,
    only the linear layers of its language model (not the vision tower, whose layers share names such as q_proj,
    nor the projector), as full module names."""
    language = language_model(getattr(model, "base_model", model))
    if vision_tower(model) is None or language is None:
        return names
    prefix = next(name for name, module in model.named_modules() if module is language)
    linear = [f"{prefix}.{name}" for name, m in language.named_modules() if isinstance(m, torch.nn.Linear)]
    chosen = linear if names == "all-linear" else [n for n in linear if n.rsplit(".", 1)[-1] in names]
    if not chosen:
        raise KTOPipelineError(
            f"--lora-target-modules {','.join(names)}: no linear layer of {type(model).__name__}'s language model has "
            "these names."
        )
    return chosen
