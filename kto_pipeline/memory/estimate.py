"""The `estimate-memory` command: our step's peak and breakdown, the floor, and (--against-trl) trl online's."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kto_pipeline.config import MemoryEstimateConfig
from kto_pipeline.memory.simulation import (
    CATEGORIES,
    GIB,
    StepSettings,
    image_shape,
    load_model_config,
    synthetic_rows,
)
from kto_pipeline.memory.step import floor_bytes, simulate_ours
from kto_pipeline.memory.trl_step import simulate_trl
from kto_pipeline.objectives import objective_for

# ------------------------------------------------------------------------------------------ the command


def estimate(config: MemoryEstimateConfig) -> dict[str, Any]:
    """The answer of `estimate-memory`: our step's peak and breakdown, the floor, and trl online's peak."""
    model_config = load_model_config(config.model)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    image = image_shape(model_config)
    rows = synthetic_rows(
        config.per_device_train_batch_size, config.max_length, config.lengths, text.vocab_size, image=image
    )
    settings = StepSettings(
        bf16=config.bf16,
        gradient_checkpointing=config.gradient_checkpointing,
        lora_r=config.lora_r,
        fsdp_world_size=config.fsdp_world_size,
        cpu_offload=config.cpu_offload,
        freeze_vision_tower=config.freeze_vision_tower,
    )
    ours = simulate_ours(model_config, rows, settings, loss_type=config.loss_type)
    # the tokens with gradients: each row's prompt and completion, or each pair's prompt and both answers
    objective = objective_for(config.loss_type)
    needed = sum(objective.tokens_with_grad(item) for item in objective.items_from_rows(rows))
    floor = floor_bytes(model_config, settings, needed)
    if config.cpu_offload:  # the device holds no sharded weights, gradients or moments
        floor.update(parameters=0, gradients=0, optimizer=0)
    result: dict[str, Any] = {
        "model": config.model,
        "settings": {k: v for k, v in config.to_dict().items() if k not in ("model", "json", "against_trl")},
        "peak_bytes": ours.peak_bytes,
        "breakdown": ours.breakdown,
        "floor_bytes": sum(floor.values()),
        "floor": floor,
        "tokens_needed": needed,
        "tokens_with_grad": ours.tokens_with_grad,
        "kl_forward": ours.kl_forward,
        "trl_online_peak_bytes": None,
        **({"image_tokens": image.tokens, "image_size": image.size} if image is not None else {}),
    }
    if config.against_trl:  # (trl trains a vision tower: it has no option to freeze it)
        trl = simulate_trl(model_config, rows, dataclasses.replace(settings, freeze_vision_tower=False), online=True)
        result["trl_online_peak_bytes"] = trl.peak_bytes
        result["trl_online_breakdown"] = trl.breakdown
    return result


def describe(result: dict[str, Any]) -> str:
    """The table `estimate-memory` prints."""

    def gib(x: int) -> str:
        return f"{x / GIB:8.2f} GiB"

    s = result["settings"]
    lines = [
        f"{result['model']}: one training step, "
        + (
            f"{s['per_device_train_batch_size']} rows x {s['max_length']} tokens"
            if objective_for(s["loss_type"]).unit == "rows"
            else f"{s['per_device_train_batch_size']} pairs x 2 answers of {s['max_length']} tokens, {s['loss_type']}"
        )
        + f" ({s['lengths']}), {'bf16 autocast' if s['bf16'] else 'float32'}"
        + (
            f", one {result['image_size']}px picture a row ({result['image_tokens']} image tokens of the prompt), "
            f"vision tower {'frozen' if s['freeze_vision_tower'] else 'trained'}"
            if "image_tokens" in result
            else ""
        )
        + (", gradient checkpointing" if s["gradient_checkpointing"] else "")
        + (f", LoRA r={s['lora_r']}" if s["lora_r"] else "")
        + (f", FSDP2 x{s['fsdp_world_size']}" if s["fsdp_world_size"] > 1 else "")
        + (" + CPU offload" if s["cpu_offload"] else ""),
        f"  peak per device   {gib(result['peak_bytes'])}   (simulated; allocated tensors, no allocator slack)",
    ]
    for name in CATEGORIES:
        lines.append(f"    {name:<15} {gib(result['breakdown'][name])}")
    lines.append(f"  floor             {gib(result['floor_bytes'])}   (weights, grads, AdamW, needed activations)")
    lines.append(f"  KL forward        {result['kl_forward']}")
    if result.get("trl_online_peak_bytes") is not None:
        ratio = result["peak_bytes"] / result["trl_online_peak_bytes"]
        lines.append(f"  trl online        {gib(result['trl_online_peak_bytes'])}   (ours / trl = {ratio:.2f})")
    return "\n".join(lines)


def run(config: MemoryEstimateConfig) -> None:
    import warnings

    with warnings.catch_warnings():  # fake tensors' own (data_ptr of a FakeTensor, ...): not the user's concern
        warnings.simplefilter("ignore")
        result = estimate(config)
    print(json.dumps(result) if config.json else describe(result))
