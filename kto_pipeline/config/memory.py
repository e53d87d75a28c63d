"""`kto-pipeline estimate-memory`'s settings: one training step's peak accelerator memory, simulated."""

from __future__ import annotations

from dataclasses import dataclass, field

from kto_pipeline.config.fields import (
    DATA,
    LORA,
    MODEL,
    OPTIMISATION,
    OUTPUT,
    ConfigMixin,
    check,
    described,
)
from kto_pipeline.objectives import check_loss_names, objective_for
from kto_pipeline.quantization import TRL_LORA_R

LENGTHS = ("full", "kto-mix")  # estimate-memory --lengths


@dataclass
class MemoryEstimateConfig(ConfigMixin):
    """`kto-pipeline estimate-memory`: the peak accelerator memory per device of one `train` step. The flags
    that shape memory are named as `train`'s."""

    model: str = field(
        **described("Model: a local directory with config.json, or a hub id (only its config is read).", panel=MODEL)
    )
    per_device_train_batch_size: int = field(
        default=8, **described("Rows per forward pass and device; with a pair loss, pairs.", panel=DATA)
    )
    max_length: int = field(default=1024, **described("Tokens of prompt + completion per row, at most.", panel=DATA))
    loss_type: str = field(
        default="kto",
        **described(
            "As train's: KTO's (each row's completion with grad, then its KL completion without) or a pair loss "
            "(sigmoid, ipo, ...: each pair's prompt once and both answers with grad; the chosen answer is a row's "
            "completion, the rejected one the completion of another row, as --lengths draws them).",
            panel=OPTIMISATION,
        ),
    )
    lengths: str = field(
        default="full",
        **described(
            "Row lengths: full (every row and KL row at --max-length, a quarter of it prompt: the largest batch a "
            "run can meet) or kto-mix (the largest batch of an epoch of kto-mix-14k-like lengths, seeded).",
            panel=DATA,
        ),
    )
    bf16: bool = field(
        default=True, **described("bf16 autocast over float32 weights (else float32 throughout).", panel=OPTIMISATION)
    )
    gradient_checkpointing: bool = field(
        default=False, **described("Recompute activations in the backward pass.", panel=OPTIMISATION)
    )
    fsdp_world_size: int = field(
        default=1, **described("Shard with FSDP2 over this many devices (1: no sharding).", panel=OPTIMISATION)
    )
    cpu_offload: bool = field(
        default=False,
        **described(
            "With --fsdp-world-size > 1: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer "
            "state in host memory).",
            panel=OPTIMISATION,
        ),
    )
    lora_r: int | None = field(
        default=None,
        **described("Train LoRA adapters of this rank (all linear layers) instead of all weights.", panel=LORA),
    )
    load_in_4bit: bool = field(
        default=False,
        **described(
            "The frozen base's linear layers in 4 bits (QLoRA, bitsandbytes NF4): LoRA r 16 implied; its other "
            "weights and the adapters in bf16 under --bf16.",
            panel=LORA,
        ),
    )
    load_in_8bit: bool = field(
        default=False, **described("The frozen base's linear layers in 8 bits (LLM.int8()), LoRA implied.", panel=LORA)
    )
    use_bnb_nested_quant: bool = field(
        default=False, **described("With --load-in-4bit: the blocks' scales quantized too.", panel=LORA)
    )
    freeze_vision_tower: bool = field(
        default=True,
        **described(
            "A vision-language model (one picture a row, its image tokens in the prompt): its vision tower frozen, "
            "as train's default; --no-freeze-vision-tower trains it.",
            panel=OPTIMISATION,
        ),
    )
    against_trl: bool = field(
        default=False,
        **described(
            "Also simulate trl.KTOTrainer online (a reference model beside the policy; with LoRA, trl's reference is "
            "the base with the adapters off: no second model) on the same rows; a vision-language model's tower "
            "trains there, as in trl.",
            panel=OUTPUT,
        ),
    )
    json: bool = field(default=False, **described("Print one JSON line instead of a table.", panel=OUTPUT))

    def __post_init__(self) -> None:
        check(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be at least 1")
        check(self.max_length >= 8, "max_length", f"must be at least 8, got {self.max_length}")
        check(self.lengths in LENGTHS, "lengths", f"must be one of {', '.join(LENGTHS)}, got {self.lengths!r}")
        check(self.fsdp_world_size >= 1, "fsdp_world_size", "must be at least 1")
        check(not self.cpu_offload or self.fsdp_world_size > 1, "cpu_offload", "needs --fsdp-world-size > 1")
        check(not (self.load_in_4bit and self.load_in_8bit), "load_in_4bit", "and --load-in-8bit: choose one")
        check(not self.use_bnb_nested_quant or self.load_in_4bit, "use_bnb_nested_quant", "needs --load-in-4bit")
        if (self.load_in_4bit or self.load_in_8bit) and self.lora_r is None:
            self.lora_r = TRL_LORA_R  # a quantized base trains LoRA (trl's --use-peft rank)
        check(
            not ((self.load_in_4bit or self.load_in_8bit) and self.fsdp_world_size > 1),
            "fsdp_world_size",
            "not with a quantized base",
        )
        check(self.lora_r is None or self.lora_r >= 1, "lora_r", "must be >= 1")
        check(
            self.lora_r is None or self.fsdp_world_size == 1,
            "lora_r",
            "is simulated on one device only; drop --fsdp-world-size",
        )
        check(
            not (self.against_trl and self.fsdp_world_size > 1),
            "against_trl",
            "compares on one device only; drop --fsdp-world-size",
        )
        check_loss_names(self.loss_type)
        check(
            not (self.against_trl and objective_for(self.loss_type).name != "kto"),
            "against_trl",
            "simulates trl.KTOTrainer's step: use it with --loss-type kto or apo_zero_unpaired",
        )
