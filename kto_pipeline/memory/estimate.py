"""The `estimate-memory` command: our step's peak and breakdown, the floor, and (--against-trl) trl online's."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kto_pipeline.config import MemoryEstimateConfig
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.memory.simulation import (
    CATEGORIES,
    GIB,
    StepMemory,
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
    bits = 4 if config.load_in_4bit else 8 if config.load_in_8bit else None
    change = None  # what a quantized base changes in the step's categories (`quantized_change`)
    if bits is not None:
        if image is not None:
            raise KTOPipelineError("--load-in-4bit/8bit: estimated for text models only")
        change = quantized_change(model_config, bits, config.use_bnb_nested_quant, config.bf16)
        ours = quantized_step(ours, change)
    # the tokens with gradients: each row's prompt and completion, or each pair's prompt and both answers
    objective = objective_for(config.loss_type)
    needed = sum(objective.tokens_with_grad(item) for item in objective.items_from_rows(rows))
    floor = floor_bytes(model_config, settings, needed)
    if change is not None:  # the floor's weights, gradients and moments as on the quantized base
        floor.update({k: floor[k] + change[k] for k in ("parameters", "gradients", "optimizer")})
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
        # trl with peft (LoRA, a quantized base) scores its reference with the adapters off: no second model (its
        # no-grad forwards' transients are gone by the policy's backward, the step's peak): its step without one
        online = settings.lora_r is None
        trl = simulate_trl(model_config, rows, dataclasses.replace(settings, freeze_vision_tower=False), online=online)
        if change is not None:
            trl = quantized_step(trl, change)
        result["trl_online_peak_bytes"] = trl.peak_bytes
        result["trl_online_breakdown"] = trl.breakdown
    return result


def quantized_linears(model_config) -> tuple[list[tuple[int, int]], int, int]:
    """(the (out, in) shapes of the linear layers bitsandbytes quantizes: every nn.Linear but the output layer, as
    transformers skips it; the parameters left in float; the LoRA parameters, rank 16 on every linear layer as
    `ready_to_train` adds them) of a text model, counted on the meta device."""
    import torch

    from kto_pipeline.models import auto_class

    with torch.device("meta"):
        model = auto_class(model_config).from_config(model_config, dtype=torch.float32)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    shapes = [(m.out_features, m.in_features) for m in linears]
    rest = sum(p.numel() for p in model.parameters()) - sum(o * i for o, i in shapes)
    return shapes, rest, sum(16 * (o + i) for o, i in shapes)


def quantized_bytes(shapes: list[tuple[int, int]], bits: int, nested: bool) -> int:
    """What bitsandbytes holds for linear weights of these (out, in) shapes: 4 bits, half a byte a weight and a
    float32 scale a block of 64 (nested: an 8-bit scale a block, and a float32 one a block of 256 of those); 8 bits,
    a byte a weight and a float32 scale a row."""
    total = 0
    for out, inp in shapes:
        n = out * inp
        if bits == 8:
            total += n + 4 * out
            continue
        blocks = -(-n // 64)
        total += -(-n // 2) + (blocks + 4 * -(-blocks // 256) if nested else 4 * blocks)
    return total


def quantized_step(memory: StepMemory, change: dict[str, int]) -> StepMemory:
    """A simulated LoRA step (float32 base, float32 adapters) as it runs on a quantized base (`change`:
    `quantized_change`; gradients and moments only where the step's peak holds them)."""
    change = {k: v if k not in ("gradients", "optimizer") or memory.breakdown[k] else 0 for k, v in change.items()}
    breakdown = {k: v + change.get(k, 0) for k, v in memory.breakdown.items()}
    before = memory.before_step_bytes + change["parameters"] + change["optimizer"]
    return dataclasses.replace(
        memory, peak_bytes=memory.peak_bytes + sum(change.values()), breakdown=breakdown, before_step_bytes=before
    )


def quantized_change(model_config, bits: int, nested: bool, bf16: bool) -> dict[str, int]:
    """What a quantized base changes in a LoRA step's categories (bytes): the linear layers' weights at
    bitsandbytes' sizes (`quantized_bytes`), the other weights and the adapters (their gradients and AdamW moments
    too) in bf16 under bf16 (as trl keeps adapters on a quantized base), plus the largest layer's weight dequantized
    for its product (a temporary)."""
    shapes, rest, lora = quantized_linears(model_config)
    sizes = [out * inp for out, inp in shapes]
    quantized = quantized_bytes(shapes, bits, nested)
    half = 2 if bf16 else 4
    return {
        "parameters": quantized - 4 * sum(sizes) + (half - 4) * (rest + lora),
        "gradients": (half - 4) * lora,
        "optimizer": 2 * (half - 4) * lora,
        "temporaries": max(sizes) * half,
    }


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
        + (", 4-bit base (NF4" + (", nested" if s["use_bnb_nested_quant"] else "") + ")" if s["load_in_4bit"] else "")
        + (", 8-bit base (LLM.int8())" if s["load_in_8bit"] else "")
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
        trl = "trl (peft)   " if s["load_in_4bit"] or s["load_in_8bit"] else "trl online   "
        lines.append(f"  {trl}     {gib(result['trl_online_peak_bytes'])}   (ours / trl = {ratio:.2f})")
    return "\n".join(lines)


def run(config: MemoryEstimateConfig) -> None:
    import warnings

    with warnings.catch_warnings():  # fake tensors' own (data_ptr of a FakeTensor, ...): not the user's concern
        warnings.simplefilter("ignore")
        result = estimate(config)
    print(json.dumps(result) if config.json else describe(result))
