"""`kto-pipeline train`'s settings: stage 2, the policy against a cache (the loss family's own checks are its
objective's, `kto_pipeline/objectives`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kto_pipeline.config.fields import (
    CHECKPOINTS,
    EVALUATION,
    FIXED_ON_RESUME,
    LISTED,
    LOGGING,
    LORA,
    MODEL_AND_DATA,
    NO_EFFECT,
    NOTED_ON_RESUME,
    OPTIMISATION,
    PROCESSES,
    REPORT_TO,
    SAMPLING,
    SCHEDULERS,
    SET_BY_SWEEP,
    ConfigMixin,
    check,
    check_compile_mode,
    check_kernel,
    described,
)
from kto_pipeline.objectives import check_loss_names, check_options
from kto_pipeline.objectives.pairs import F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCE_TYPES, PAIR_LOSS_TYPES
from kto_pipeline.quantization import (
    LOAD_IN_4BIT_HELP,
    LOAD_IN_8BIT_HELP,
    NESTED_HELP,
    QUANT_TYPE_HELP,
    STORAGE_HELP,
    TRL_LORA_R,
)
from kto_pipeline.runtime import STATIC_SHAPES_HELP, TORCH_COMPILE_HELP, TORCH_COMPILE_MODE_HELP
from kto_pipeline.scoring import ATTENTION_KERNEL_HELP

# train's quantization options default to the cache's: its reference's quantization is the policy's base
CACHES = " Default: the cache's (its reference's quantization); another is refused."
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")


@dataclass
class TrainConfig(ConfigMixin):
    """Stage 2: train the policy against a reference cache. Names follow trl.KTOConfig."""

    cache: str = field(
        **described(
            "Cache directory written by `kto-pipeline precompute`.",
            panel=MODEL_AND_DATA,
            role=(SET_BY_SWEEP, FIXED_ON_RESUME),
        )
    )
    output_dir: str = field(
        **described("Where metrics, checkpoints and the final model go.", panel=CHECKPOINTS, role=(SET_BY_SWEEP,))
    )
    model: str | None = field(
        default=None,
        **described(
            "Initial policy (hub id or directory). Default: the cache's reference model.",
            panel=MODEL_AND_DATA,
            role=(FIXED_ON_RESUME,),
        ),
    )
    init_from: str | None = field(
        default=None,
        **described(
            "Start from a previous run's trained policy (its --output-dir, or one of its checkpoint-N): the next "
            "round, against the same frozen reference (checked). Full weights are trained on; a LoRA adapter is "
            "trained on with --lora-r, merged into its base and fully trained without. Not --resume: a new run, "
            "its own schedule and optimizer.",
            panel=MODEL_AND_DATA,
        ),
    )
    beta: float = field(
        default=0.1,
        **described(
            "The loss's beta (KTO's, DPO's): higher stays closer to the reference, lower cares less about it.",
            panel=OPTIMISATION,
            role=(NOTED_ON_RESUME,),
        ),
    )
    loss_type: str = field(
        default="kto",
        **described(
            "KTO's, on rows: kto (with the KL reference point) or apo_zero_unpaired. Or trl.DPOTrainer's, on "
            f"(chosen, rejected) pairs of a paired cache: {', '.join(PAIR_LOSS_TYPES)}; several joined with + "
            "(sigmoid+bco_pair+sft: MPO) are summed, weighted by --loss-weights.",
            panel=OPTIMISATION,
            role=(NOTED_ON_RESUME,),
        ),
    )
    loss_weights: str | None = field(
        default=None,
        **described(
            "Pair losses: comma-separated weights of the --loss-type terms joined with + (trl's loss_weights). "
            "Default: 1 each.",
            panel=OPTIMISATION,
            role=(NOTED_ON_RESUME, LISTED),
        ),
    )
    label_smoothing: float = field(
        default=0.0,
        **described(
            "Pair losses: the probability that a pair's preference is flipped (robust, exo_pair, aot, aot_unpaired; "
            "exo_pair needs > 0, the EXO paper uses 1e-3).",
            panel=OPTIMISATION,
            role=(NOTED_ON_RESUME,),
        ),
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        **described(
            f"Pair losses: the divergence DPO's rewards come from: {', '.join(F_DIVERGENCE_TYPES)} (f-DPO). Other "
            f"than reverse_kl only with {', '.join(F_DIVERGENCE_LOSS_TYPES)}.",
            panel=OPTIMISATION,
        ),
    )
    f_alpha_divergence_coef: float = field(
        default=0.5, **described("Pair losses: alpha of --f-divergence-type alpha_divergence.", panel=OPTIMISATION)
    )
    discopop_tau: float = field(
        default=0.05,
        **described("Pair losses: the temperature of --loss-type discopop (the paper's 0.05).", panel=OPTIMISATION),
    )
    ld_alpha: float | None = field(
        default=None,
        **described(
            "Pair losses: LD-DPO's length desensitization. The tokens of the longer answer beyond the shorter one's "
            "length count alpha times in both log-probs (policy and reference). Default: off.",
            panel=OPTIMISATION,
        ),
    )
    desirable_weight: float = field(
        default=1.0, **described("Weight of desirable examples' losses.", panel=OPTIMISATION, role=(NOTED_ON_RESUME,))
    )
    undesirable_weight: float = field(
        default=1.0, **described("Weight of undesirable examples' losses.", panel=OPTIMISATION, role=(NOTED_ON_RESUME,))
    )
    learning_rate: float = field(
        default=1e-6,
        **described(
            "Peak AdamW learning rate (KTO: 5e-7 to 5e-6 at beta 0.1).", panel=OPTIMISATION, role=(NOTED_ON_RESUME,)
        ),
    )
    per_device_train_batch_size: int = field(
        default=8,
        **described(
            "Rows per forward pass and process (KTO needs >= 4 for a useful KL estimate); with a pair loss, pairs "
            "(as trl.DPOTrainer).",
            panel=OPTIMISATION,
            role=(FIXED_ON_RESUME,),
        ),
    )
    gradient_accumulation_steps: int = field(
        default=1, **described("Forward passes per optimizer step.", panel=OPTIMISATION, role=(FIXED_ON_RESUME,))
    )
    num_train_epochs: float = field(
        default=1.0, **described("Passes over the data (fractions allowed).", panel=OPTIMISATION)
    )
    max_steps: int = field(
        default=-1, **described("If > 0, the number of optimizer steps; overrides epochs.", panel=OPTIMISATION)
    )
    warmup_ratio: float = field(
        default=0.0,
        **described(
            "Fraction of the steps spent warming up the learning rate.", panel=OPTIMISATION, role=(NOTED_ON_RESUME,)
        ),
    )
    lr_scheduler_type: str = field(
        default="linear", **described(f"One of {', '.join(SCHEDULERS)}.", panel=OPTIMISATION, role=(NOTED_ON_RESUME,))
    )
    optim: str = field(
        default="adamw_torch_fused",
        **described(
            "The optimizer, as transformers names them: adamw_torch_fused (one fused kernel), adamw_torch, or "
            "bitsandbytes' adamw_bnb_8bit (alias adamw_8bit) and paged_adamw_8bit where bitsandbytes is installed.",
            panel=OPTIMISATION,
            role=(NOTED_ON_RESUME,),
        ),
    )
    weight_decay: float = field(
        default=0.0,
        **described(
            "AdamW weight decay (not applied to biases and norms).", panel=OPTIMISATION, role=(NOTED_ON_RESUME,)
        ),
    )
    max_grad_norm: float = field(
        default=1.0,
        **described("Gradient clipping norm; 0 disables clipping.", panel=OPTIMISATION, role=(NOTED_ON_RESUME,)),
    )
    max_length: int | None = field(
        default=None,
        **described(
            "Truncate sequences to this length (<= the cached max length). Default: the cached one.",
            panel=MODEL_AND_DATA,
            role=(FIXED_ON_RESUME,),
        ),
    )
    logging_steps: int = field(default=10, **described("Log metrics every this many optimizer steps.", panel=LOGGING))
    save_steps: int = field(
        default=0,
        **described(
            "Save a checkpoint every this many steps and at the last (a finished run can be extended with --resume); "
            "0 = only the final model.",
            panel=CHECKPOINTS,
        ),
    )
    seed: int = field(
        default=42,
        **described(
            "Seed of the data order and of any randomness in the model.", panel=MODEL_AND_DATA, role=(FIXED_ON_RESUME,)
        ),
    )
    bf16: bool | None = field(
        default=None,
        **described(
            "bf16 mixed precision: float32 weights under bf16 autocast. Default: on where the GPU supports it, "
            "off on CPU.",
            panel=OPTIMISATION,
        ),
    )
    strict: bool = field(
        default=False,
        **described(
            "Refuse, instead of warning, when the cache's reference ran in another precision regime (weights "
            "dtype, autocast) than this run's policy: then step-1 rewards and KL are not zero.",
            panel=MODEL_AND_DATA,
        ),
    )
    ddp_timeout: int = field(
        default=1800,
        **described(
            "Seconds a process waits for the others in a collective before failing (as transformers' ddp_timeout).",
            panel=PROCESSES,
        ),
    )
    train_sampling_strategy: str = field(
        default="random",
        **described(
            "random (seeded shuffle each epoch) or sequential (dataset order, as trl's default). KL partners "
            "are fixed in the cache, so shuffling is safe here.",
            panel=MODEL_AND_DATA,
            role=(FIXED_ON_RESUME,),
        ),
    )
    overwrite_output_dir: bool = field(
        default=False,
        **described("Allow writing into a non-empty --output-dir.", panel=CHECKPOINTS, role=(SET_BY_SWEEP, NO_EFFECT)),
    )
    trust_remote_code: bool = field(
        default=False, **described("Allow models and tokenizers that run their own code.", panel=MODEL_AND_DATA)
    )
    load_in_4bit: bool | None = field(default=None, **described(LOAD_IN_4BIT_HELP + CACHES, panel=MODEL_AND_DATA))
    load_in_8bit: bool | None = field(default=None, **described(LOAD_IN_8BIT_HELP + CACHES, panel=MODEL_AND_DATA))
    bnb_4bit_quant_type: str | None = field(default=None, **described(QUANT_TYPE_HELP + CACHES, panel=MODEL_AND_DATA))
    use_bnb_nested_quant: bool | None = field(default=None, **described(NESTED_HELP + CACHES, panel=MODEL_AND_DATA))
    bnb_4bit_quant_storage: str | None = field(default=None, **described(STORAGE_HELP + CACHES, panel=MODEL_AND_DATA))
    fp16: bool = field(default=False, **described("fp16 mixed precision (CUDA GPUs only).", panel=OPTIMISATION))
    gradient_checkpointing: bool = field(
        default=False,
        **described(
            "Recompute each layer's activations in the backward pass: less memory, more compute (a KTO step of "
            "Qwen2-1.5B's shape at max_length 2048: 1.2x the FLOPs without it).",
            panel=OPTIMISATION,
        ),
    )
    attention_kernel: str = field(default="auto", **described(ATTENTION_KERNEL_HELP, panel=OPTIMISATION))
    torch_compile: bool | None = field(default=None, **described(TORCH_COMPILE_HELP, panel=OPTIMISATION))
    torch_compile_mode: str = field(default="default", **described(TORCH_COMPILE_MODE_HELP, panel=OPTIMISATION))
    static_shapes: bool = field(default=False, **described(STATIC_SHAPES_HELP, panel=OPTIMISATION))
    dataloader_num_workers: int | None = field(
        default=None,
        **described(
            "Processes that collate the next micro-batches (pack, lay out) while the device computes the current "
            "one, as transformers' Trainer's. Default: 1 on an accelerator, 0 on the CPU (collated in the training "
            "process). The batches are the same whatever the number.",
            panel=OPTIMISATION,
            role=(NO_EFFECT,),
        ),
    )
    freeze_vision_tower: bool = field(
        default=True,
        **described(
            "A vision-language model: keep its vision tower frozen (the projector and the language model train). "
            "--no-freeze-vision-tower trains it too, as trl does. No effect on a text model.",
            panel=MODEL_AND_DATA,
        ),
    )
    save_total_limit: int | None = field(
        default=None, **described("Keep only the newest N checkpoints.", panel=CHECKPOINTS)
    )
    resume: bool = field(
        default=False,
        **described(
            "Resume from the newest checkpoint in --output-dir.", panel=CHECKPOINTS, role=(SET_BY_SWEEP, NO_EFFECT)
        ),
    )
    resume_from: str | None = field(
        default=None,
        **described(
            "Resume from this checkpoint directory (OUT/checkpoint-STEP), or from a run's OUT: its newest checkpoint.",
            panel=CHECKPOINTS,
            role=(SET_BY_SWEEP, NO_EFFECT),
            trl="resume_from_checkpoint",  # (TrainingArguments': trl's scripts pass it to trainer.train)
        ),
    )
    autoresume: bool = field(
        default=False,
        **described(
            "Resume from the newest complete checkpoint in --output-dir if there is one (else from --resume-from, "
            "else start): the same command starts a run and continues it after a preemption or a crash, so "
            "`torchrun --max-restarts N` brings a run back by itself. A run stopped by SIGTERM or SIGUSR1 writes a "
            "checkpoint and exits with status 75; Ctrl-C, at the end of its step, with status 130.",
            panel=CHECKPOINTS,
        ),
    )
    lora_r: int | None = field(
        default=None,
        **described("Train LoRA adapters of this rank instead of all weights.", panel=LORA, role=(FIXED_ON_RESUME,)),
    )
    use_peft: bool = field(
        default=False,
        **described("trl's switch for LoRA: adapters of --lora-r (16 when not given, trl's default).", panel=LORA),
    )
    lora_alpha: int = field(
        default=32, **described("LoRA scaling alpha (the update is scaled by alpha / r).", panel=LORA)
    )
    lora_dropout: float = field(default=0.05, **described("Dropout on the LoRA adapters' input.", panel=LORA))
    lora_target_modules: str = field(
        default="all-linear",
        **described(
            "all-linear, or comma-separated module names (q_proj,v_proj,...).",
            panel=LORA,
            role=(FIXED_ON_RESUME, LISTED),
        ),
    )
    merge: bool = field(
        default=False, **described("With LoRA, also write the merged full model to OUT/merged.", panel=LORA)
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        **described("MoE load-balancing loss weight. Default: the model config's; 0 disables it.", panel=OPTIMISATION),
    )
    eval_cache: str | None = field(
        default=None,
        **described("A cache of held-out rows (precompute --split test ...) to evaluate on.", panel=EVALUATION),
    )
    eval_steps: int | None = field(
        default=None,
        **described(
            "Evaluate every this many steps (and always at the end when --eval-cache is set).", panel=EVALUATION
        ),
    )
    per_device_eval_batch_size: int = field(
        default=8, **described("Rows per evaluation forward pass and process.", panel=EVALUATION)
    )
    report_to: str = field(
        default="none",
        **described(
            "Also log metrics to: none, tensorboard, wandb (comma-separated for several).",
            panel=LOGGING,
            role=(NO_EFFECT, LISTED),
        ),
    )
    run_name: str | None = field(
        default=None, **described("The run's name in the trackers (wandb's run name), as trl's.", panel=LOGGING)
    )
    push_to_hub: bool = field(
        default=False,
        **described(
            "At the end, upload the final model, tokenizer and model card (not the checkpoints) to the Hugging Face "
            "Hub with huggingface_hub (a logged-in token, or HF_TOKEN).",
            panel=CHECKPOINTS,
        ),
    )
    hub_model_id: str | None = field(
        default=None,
        **described("The Hub repository to push to (user/name). Default: --output-dir's name.", panel=CHECKPOINTS),
    )
    verify: bool = field(
        default=False,
        **described(
            "Check every shard's sha256 again before training (reads the whole cache), and every KL partner id. "
            "Without it the cheap checks run, and the sha256 of each shard not verified since it last changed.",
            panel=MODEL_AND_DATA,
            role=(NO_EFFECT,),
        ),
    )

    def __post_init__(self) -> None:
        if self.use_peft and self.lora_r is None:  # trl's ModelConfig: use_peft with its default rank
            self.lora_r = TRL_LORA_R
        check(self.beta > 0, "beta", f"must be > 0, got {self.beta}")
        check(not (self.init_from and self.model), "init_from", "cannot be combined with --model (choose one start)")
        self._check_loss()
        check_kernel(self.attention_kernel)
        check_compile_mode(self.torch_compile_mode, self.torch_compile)
        check(self.desirable_weight > 0, "desirable_weight", f"must be > 0, got {self.desirable_weight}")
        check(self.undesirable_weight > 0, "undesirable_weight", f"must be > 0, got {self.undesirable_weight}")
        check(self.learning_rate >= 0, "learning_rate", f"must be >= 0, got {self.learning_rate}")
        check(
            self.per_device_train_batch_size >= 1,
            "per_device_train_batch_size",
            f"must be at least 1, got {self.per_device_train_batch_size}",
        )
        check(
            self.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            f"must be at least 1, got {self.gradient_accumulation_steps}",
        )
        check(self.num_train_epochs > 0, "num_train_epochs", f"must be > 0, got {self.num_train_epochs}")
        check(self.max_steps == -1 or self.max_steps > 0, "max_steps", "must be -1 (use epochs) or > 0")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        check(
            self.lr_scheduler_type in SCHEDULERS,
            "lr_scheduler_type",
            f"must be one of {', '.join(SCHEDULERS)}",
        )
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(self.optim in OPTIMIZERS, "optim", f"must be one of {', '.join(OPTIMIZERS)}, got {self.optim!r}")
        check(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        check(self.max_length is None or self.max_length >= 2, "max_length", "must be at least 2")
        check(self.logging_steps >= 1, "logging_steps", f"must be at least 1, got {self.logging_steps}")
        check(self.save_steps >= 0, "save_steps", f"must be >= 0, got {self.save_steps}")
        check(not (self.resume and self.autoresume), "autoresume", "choose one of --resume and --autoresume")
        check(not (self.fp16 and self.bf16), "fp16", "choose one of --fp16 and --bf16")
        check(self.lora_r is None or self.lora_r >= 1, "lora_r", "must be >= 1")
        check(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        # (--merge without --lora-r: checked in train's setup, where a cache's quantized base implies LoRA)
        check(
            "lm_head" not in self.lora_target_modules.split(","),
            "lora_target_modules",
            "lm_head cannot carry an adapter: log-probs are computed from its weight directly (as in trl)",
        )
        check(self.eval_steps is None or self.eval_steps >= 1, "eval_steps", "must be >= 1")
        check(self.per_device_eval_batch_size >= 1, "per_device_eval_batch_size", "must be >= 1")
        workers = self.dataloader_num_workers
        check(workers is None or workers >= 0, "dataloader_num_workers", f"must be >= 0, got {workers}")
        trackers = [t.strip() for t in self.report_to.split(",") if t.strip()]
        unknown = [t for t in trackers if t not in REPORT_TO]
        check(not unknown, "report_to", f"unknown {unknown}; choose from {', '.join(REPORT_TO)}")
        for tracker in set(trackers) - {"none"}:
            import importlib.util

            module = {"tensorboard": "tensorboard", "wandb": "wandb"}[tracker]
            check(
                importlib.util.find_spec(module) is not None,
                "report_to",
                f"{tracker} is not installed: `pip install {module}`, or use --report-to none",
            )
        check(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit", "must be >= 1")
        check(
            self.train_sampling_strategy in SAMPLING,
            "train_sampling_strategy",
            f"must be one of {', '.join(SAMPLING)}",
        )

    @property
    def loss_types(self) -> tuple[str, ...]:
        """The --loss-type terms (one, or several joined with +)."""
        return tuple(t.strip() for t in self.loss_type.split("+"))

    @property
    def weights(self) -> tuple[float, ...]:
        """The weight of each --loss-type term (--loss-weights; 1 each by default)."""
        if self.loss_weights is None:
            return (1.0,) * len(self.loss_types)
        return tuple(float(w) for w in self.loss_weights.split(","))

    def _check_loss(self) -> None:
        check_loss_names(self.loss_type)
        check_options(self)  # the options of the other families keep their defaults, the family checks its own
