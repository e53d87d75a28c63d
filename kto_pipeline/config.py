"""One config dataclass per stage. Each field is a command-line option: its name, type, default, `help`
and `panel` (its --help panel) are the CLI's, which kto_pipeline/recipe.py builds from them, so the Python
API and the command line are documented in one place. `__post_init__` rejects bad values naming the
flag; the config is printed at the start of a run and saved next to its outputs."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import NoneType, UnionType
from typing import Any

from kto_pipeline.errors import KTOPipelineError

LOSS_TYPES = ("kto", "apo_zero_unpaired")  # KTO's: each row alone, desirable or undesirable
# trl.DPOTrainer's (1.16): each (prompt, chosen, rejected) pair (see loss.pair_loss); several joined with "+"
PAIR_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the pair losses that take another f-divergence than reverse KL (trl: the others have no valid generalization)
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def is_pair_loss(loss_type: str) -> bool:
    """Whether a --loss-type (one term, or several joined with +) is a pair loss (trl.DPOTrainer's), not KTO's."""
    return loss_type.split("+")[0].strip() in PAIR_LOSS_TYPES


DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_KERNELS = ("auto", "by-tree", "block-mask", "dense")  # see kto_pipeline/scoring/attention.py
_ATTENTION_KERNEL_HELP = (
    "How packed rows attend: by-tree (sequence by sequence, sdpa), block-mask (torch's FlexAttention under a "
    "block mask: only the (query, key) tiles each row's trees need), dense (sdpa under the whole row's mask). "
    "auto: by-tree on the CPU, block-mask on accelerators; a kernel the model or device cannot take falls back, "
    "and the run says why."
)
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)
SAMPLING = ("random", "sequential")
REPORT_TO = ("none", "tensorboard", "wandb")


# The command line's --help panels. Each field names its panel; a command shows its panels in this order.
MODEL = "Model"
MODELS = "Models"
MODEL_AND_DATA = "Model and data"
DATA = "Data"
PROMPTS = "Prompts"
REFERENCE_PASS = "Reference pass"
OPTIMISATION = "Optimisation"
DECODING = "Decoding"
ROUNDS = "Rounds: completions to label"
LORA = "LoRA"
EVALUATION = "Evaluation"
CHECKPOINTS = "Checkpoints"
OUTPUT = "Output"
LOGGING = "Logging"
PROCESSES = "More than one process"
PANELS = (
    MODEL,
    MODELS,
    MODEL_AND_DATA,
    DATA,
    PROMPTS,
    REFERENCE_PASS,
    OPTIMISATION,
    DECODING,
    ROUNDS,
    LORA,
    EVALUATION,
    CHECKPOINTS,
    OUTPUT,
    LOGGING,
    PROCESSES,
)


def _help(text: str, *, panel: str, formerly: str | None = None, **kw: Any) -> dict[str, Any]:
    """A field's help text and --help panel; `formerly`: the name it had in earlier releases, still read from
    recipes (on the command line click names the new flag: "No such option: --seed Did you mean --kl-seed?")."""
    return {"metadata": {"help": text, "panel": panel, "formerly": formerly}, **kw}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise KTOPipelineError(f"{_flag(name)}: {message}")


# ------------------------------------------------------------------------------------------ typed values

# str fields whose value is a comma-separated list itself
LIST_FIELDS = ("lora_target_modules", "report_to", "loss_weights")


def base_type(value_type: Any) -> tuple[type, bool]:
    """(the type, whether None is allowed) of a field annotation such as `int | None`."""
    if typing.get_origin(value_type) in (UnionType, typing.Union):
        args = typing.get_args(value_type)
        return next(a for a in args if a is not NoneType), NoneType in args
    return value_type, False


def parse_value(value_type: Any, text: str, name: str) -> Any:
    """One command-line value (`text`, of field `name`) as its type: the one parser of sweep grids and recipes."""
    base, optional = base_type(value_type)
    text = text.strip()
    if text.lower() in ("none", "null", "") and optional:
        return None
    try:
        if base is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError(text)
        if base in (int, float):
            return base(text)
    except ValueError:
        raise KTOPipelineError(f"{_flag(name)}: cannot read {text!r} as {base.__name__}") from None
    return text


class _ConfigMixin:
    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def describe(self) -> str:
        width = max(len(f.name) for f in dataclasses.fields(self))
        return "\n".join(f"  {f.name:<{width}}  {getattr(self, f.name)}" for f in dataclasses.fields(self))


def _check_kernel(kernel: str) -> None:
    _check(
        kernel in ATTENTION_KERNELS,
        "attention_kernel",
        f"must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}",
    )


def field_help(cls: type, name: str) -> str:
    """The help text of a config field (used by the CLI)."""
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)


def field_panel(cls: type, name: str) -> str:
    """The --help panel of a config field (used by the CLI)."""
    return next(f.metadata["panel"] for f in dataclasses.fields(cls) if f.name == name)


@dataclass
class PrecomputeConfig(_ConfigMixin):
    """Stage 1: score every completion and its KL completion with the frozen reference model."""

    model: str = field(**_help("Reference model: a Hugging Face hub id or a local directory.", panel=MODEL))
    dataset: str = field(
        **_help(
            "Binary-feedback data: a hub id, a .json/.jsonl/.parquet/.csv/.arrow file, "
            "or a directory written by datasets.save_to_disk.",
            panel=DATA,
        )
    )
    output: str = field(**_help("Cache directory to write (manifest.json + shards/).", panel=OUTPUT))
    split: str = field(default="train", **_help("Dataset split to read.", panel=DATA))
    dataset_config: str | None = field(default=None, **_help("Dataset configuration name (hub datasets).", panel=DATA))
    max_length: int = field(
        default=1024,
        **_help(
            "Maximum prompt+completion tokens; longer sequences are truncated on the right, rows whose "
            "prompt alone reaches it are dropped. Training may later use any length up to this one.",
            panel=DATA,
        ),
    )
    kl_seed: int = field(
        default=0,
        **_help(
            "Seed of the KL partners: which other row's completion forms each row's KL completion. Recorded in the "
            "manifest and kept by every append (train's --seed, the data order, is another seed). Formerly --seed.",
            panel=DATA,
            formerly="seed",
        ),
    )
    pairs_only: bool = field(
        default=False,
        **_help(
            "Paired data only, for pair losses (DPO and its family): score each (chosen, rejected) pair as one "
            "tree, its prompt once, and skip the KL completions (KTO's loss needs them: train refuses such a "
            "cache). Rows without their pair partner are dropped.",
            panel=DATA,
        ),
    )
    num_proc: int = field(
        default=1,
        **_help(
            "Processes that normalise and tokenize the data (datasets.map); the result is cached, so a second "
            "precompute of the same data, tokenizer and settings skips it.",
            panel=DATA,
        ),
    )
    dtype: str = field(
        default="auto",
        **_help(
            "Dtype of the reference's weights: auto = float32 (bf16 compute comes from --bf16, as in train); "
            "bfloat16/float16 load the weights in that dtype.",
            panel=REFERENCE_PASS,
        ),
    )
    bf16: bool | None = field(
        default=None,
        **_help(
            "Run the reference under bf16 autocast (the regime train --bf16 trains in: float32 weights, bf16 "
            "matmuls, float32 log-softmax and sums). Default: on where the GPU supports it, off on CPU.",
            panel=REFERENCE_PASS,
        ),
    )
    batch_size: int = field(
        default=16,
        **_help(
            "Most sequences per reference forward pass (two per row: completion and KL completion).",
            panel=REFERENCE_PASS,
        ),
    )
    max_tokens_per_batch: int = field(
        default=16384,
        **_help(
            "Token budget of one forward pass (rows are packed side by side, so passes carry little padding).",
            panel=REFERENCE_PASS,
        ),
    )
    attention_kernel: str = field(default="auto", **_help(_ATTENTION_KERNEL_HELP, panel=REFERENCE_PASS))
    shard_size: int = field(default=2048, **_help("Rows per Arrow shard.", panel=OUTPUT))
    revision: str | None = field(
        default=None, **_help("Model revision (branch, tag or commit) on the hub.", panel=MODEL)
    )
    trust_remote_code: bool = field(
        default=False, **_help("Allow models and tokenizers that run their own code.", panel=MODEL)
    )
    overwrite: bool = field(
        default=False, **_help("Replace an existing cache made with other inputs or settings.", panel=OUTPUT)
    )
    append: bool = field(
        default=False,
        **_help(
            "Add to the complete cache at --output the rows of --dataset it does not hold yet (recognised by a "
            "content key over prompt, completion and label), scored into new shards; the rows it holds are not "
            "scored again. --dataset may be the whole grown log or only the new rows. The reference, tokenizer "
            "and settings must be the cache's.",
            panel=OUTPUT,
        ),
    )
    allow_missing: bool = field(
        default=False,
        **_help(
            "With --append: go on when rows that the cache holds are missing from --dataset (a log that dropped "
            "or relabelled rows); they stay in the cache.",
            panel=OUTPUT,
        ),
    )
    ddp_timeout: int = field(
        default=1800,
        **_help(
            "Seconds a process waits for the others in a collective before failing (as transformers' ddp_timeout).",
            panel=PROCESSES,
        ),
    )
    seed: dataclasses.InitVar[int | None] = None  # the former name of kl_seed (Python API; the CLI takes --seed)

    def __post_init__(self, seed: int | None = None) -> None:
        if seed is not None:  # PrecomputeConfig(seed=...) of an earlier release: the KL partners' seed
            self.kl_seed = seed
        _check(self.max_length >= 2, "max_length", f"must be at least 2, got {self.max_length}")
        _check(not (self.append and self.overwrite), "append", "cannot be combined with --overwrite")
        _check(self.append or not self.allow_missing, "allow_missing", "only applies with --append")
        _check(self.ddp_timeout >= 1, "ddp_timeout", f"must be at least 1 second, got {self.ddp_timeout}")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check_kernel(self.attention_kernel)
        _check(self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}")
        _check(self.num_proc >= 1, "num_proc", f"must be at least 1, got {self.num_proc}")
        _check(
            self.max_tokens_per_batch >= self.max_length,
            "max_tokens_per_batch",
            f"must be at least --max-length ({self.max_length}) so any sequence fits, got {self.max_tokens_per_batch}",
        )
        _check(self.shard_size >= 1, "shard_size", f"must be at least 1, got {self.shard_size}")
        _check(
            not (self.pairs_only and self.shard_size % 2),
            "shard_size",
            f"must be even with --pairs-only (a pair's two rows stay in one shard), got {self.shard_size}",
        )


@dataclass
class TrainConfig(_ConfigMixin):
    """Stage 2: train the policy against a reference cache. Names follow trl.KTOConfig."""

    cache: str = field(**_help("Cache directory written by `kto-pipeline precompute`.", panel=MODEL_AND_DATA))
    output_dir: str = field(**_help("Where metrics, checkpoints and the final model go.", panel=CHECKPOINTS))
    model: str | None = field(
        default=None,
        **_help("Initial policy (hub id or directory). Default: the cache's reference model.", panel=MODEL_AND_DATA),
    )
    init_from: str | None = field(
        default=None,
        **_help(
            "Start from a previous run's trained policy (its --output-dir, or one of its checkpoint-N): the next "
            "round, against the same frozen reference (checked). Full weights are trained on; a LoRA adapter is "
            "trained on with --lora-r, merged into its base and fully trained without. Not --resume: a new run, "
            "its own schedule and optimizer.",
            panel=MODEL_AND_DATA,
        ),
    )
    beta: float = field(
        default=0.1,
        **_help(
            "The loss's beta (KTO's, DPO's): higher stays closer to the reference, lower cares less about it.",
            panel=OPTIMISATION,
        ),
    )
    loss_type: str = field(
        default="kto",
        **_help(
            "KTO's, on rows: kto (with the KL reference point) or apo_zero_unpaired. Or trl.DPOTrainer's, on "
            f"(chosen, rejected) pairs of a paired cache: {', '.join(PAIR_LOSS_TYPES)}; several joined with + "
            "(sigmoid+bco_pair+sft: MPO) are summed, weighted by --loss-weights.",
            panel=OPTIMISATION,
        ),
    )
    loss_weights: str | None = field(
        default=None,
        **_help(
            "Pair losses: comma-separated weights of the --loss-type terms joined with + (trl's loss_weights). "
            "Default: 1 each.",
            panel=OPTIMISATION,
        ),
    )
    label_smoothing: float = field(
        default=0.0,
        **_help(
            "Pair losses: the probability that a pair's preference is flipped (robust, exo_pair, aot, aot_unpaired; "
            "exo_pair needs > 0, the EXO paper uses 1e-3).",
            panel=OPTIMISATION,
        ),
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        **_help(
            f"Pair losses: the divergence DPO's rewards come from: {', '.join(F_DIVERGENCE_TYPES)} (f-DPO). Other "
            f"than reverse_kl only with {', '.join(F_DIVERGENCE_LOSS_TYPES)}.",
            panel=OPTIMISATION,
        ),
    )
    f_alpha_divergence_coef: float = field(
        default=0.5, **_help("Pair losses: alpha of --f-divergence-type alpha_divergence.", panel=OPTIMISATION)
    )
    discopop_tau: float = field(
        default=0.05,
        **_help("Pair losses: the temperature of --loss-type discopop (the paper's 0.05).", panel=OPTIMISATION),
    )
    ld_alpha: float | None = field(
        default=None,
        **_help(
            "Pair losses: LD-DPO's length desensitization. The tokens of the longer answer beyond the shorter one's "
            "length count alpha times in both log-probs (policy and reference). Default: off.",
            panel=OPTIMISATION,
        ),
    )
    desirable_weight: float = field(default=1.0, **_help("Weight of desirable examples' losses.", panel=OPTIMISATION))
    undesirable_weight: float = field(
        default=1.0, **_help("Weight of undesirable examples' losses.", panel=OPTIMISATION)
    )
    learning_rate: float = field(
        default=1e-6, **_help("Peak AdamW learning rate (KTO: 5e-7 to 5e-6 at beta 0.1).", panel=OPTIMISATION)
    )
    per_device_train_batch_size: int = field(
        default=8,
        **_help(
            "Rows per forward pass and process (KTO needs >= 4 for a useful KL estimate); with a pair loss, pairs "
            "(as trl.DPOTrainer).",
            panel=OPTIMISATION,
        ),
    )
    gradient_accumulation_steps: int = field(
        default=1, **_help("Forward passes per optimizer step.", panel=OPTIMISATION)
    )
    num_train_epochs: float = field(
        default=1.0, **_help("Passes over the data (fractions allowed).", panel=OPTIMISATION)
    )
    max_steps: int = field(
        default=-1, **_help("If > 0, the number of optimizer steps; overrides epochs.", panel=OPTIMISATION)
    )
    warmup_ratio: float = field(
        default=0.0, **_help("Fraction of the steps spent warming up the learning rate.", panel=OPTIMISATION)
    )
    lr_scheduler_type: str = field(default="linear", **_help(f"One of {', '.join(SCHEDULERS)}.", panel=OPTIMISATION))
    weight_decay: float = field(
        default=0.0, **_help("AdamW weight decay (not applied to biases and norms).", panel=OPTIMISATION)
    )
    max_grad_norm: float = field(
        default=1.0, **_help("Gradient clipping norm; 0 disables clipping.", panel=OPTIMISATION)
    )
    max_length: int | None = field(
        default=None,
        **_help(
            "Truncate sequences to this length (<= the cached max length). Default: the cached one.",
            panel=MODEL_AND_DATA,
        ),
    )
    logging_steps: int = field(default=10, **_help("Log metrics every this many optimizer steps.", panel=LOGGING))
    save_steps: int = field(
        default=0,
        **_help(
            "Save a checkpoint every this many steps and at the last (a finished run can be extended with --resume); "
            "0 = only the final model.",
            panel=CHECKPOINTS,
        ),
    )
    seed: int = field(
        default=42, **_help("Seed of the data order and of any randomness in the model.", panel=MODEL_AND_DATA)
    )
    bf16: bool | None = field(
        default=None,
        **_help(
            "bf16 mixed precision: float32 weights under bf16 autocast. Default: on where the GPU supports it, "
            "off on CPU.",
            panel=OPTIMISATION,
        ),
    )
    strict: bool = field(
        default=False,
        **_help(
            "Refuse, instead of warning, when the cache's reference ran in another precision regime (weights "
            "dtype, autocast) than this run's policy: then step-1 rewards and KL are not zero.",
            panel=MODEL_AND_DATA,
        ),
    )
    ddp_timeout: int = field(
        default=1800,
        **_help(
            "Seconds a process waits for the others in a collective before failing (as transformers' ddp_timeout).",
            panel=PROCESSES,
        ),
    )
    train_sampling_strategy: str = field(
        default="random",
        **_help(
            "random (seeded shuffle each epoch) or sequential (dataset order, as trl's default). KL partners "
            "are fixed in the cache, so shuffling is safe here.",
            panel=MODEL_AND_DATA,
        ),
    )
    overwrite_output_dir: bool = field(
        default=False, **_help("Allow writing into a non-empty --output-dir.", panel=CHECKPOINTS)
    )
    trust_remote_code: bool = field(
        default=False, **_help("Allow models and tokenizers that run their own code.", panel=MODEL_AND_DATA)
    )
    fp16: bool = field(default=False, **_help("fp16 mixed precision (CUDA GPUs only).", panel=OPTIMISATION))
    gradient_checkpointing: bool = field(
        default=False,
        **_help("Recompute activations in the backward pass: less memory, about 30% more compute.", panel=OPTIMISATION),
    )
    attention_kernel: str = field(default="auto", **_help(_ATTENTION_KERNEL_HELP, panel=OPTIMISATION))
    save_total_limit: int | None = field(
        default=None, **_help("Keep only the newest N checkpoints.", panel=CHECKPOINTS)
    )
    resume: bool = field(
        default=False, **_help("Resume from the newest checkpoint in --output-dir.", panel=CHECKPOINTS)
    )
    resume_from: str | None = field(default=None, **_help("Resume from this checkpoint directory.", panel=CHECKPOINTS))
    autoresume: bool = field(
        default=False,
        **_help(
            "Resume from the newest complete checkpoint in --output-dir if there is one (else from --resume-from, "
            "else start): the same command starts a run and continues it after a preemption or a crash, so "
            "`torchrun --max-restarts N` brings a run back by itself. A run stopped by SIGTERM or SIGUSR1 writes a "
            "checkpoint and exits with status 75.",
            panel=CHECKPOINTS,
        ),
    )
    lora_r: int | None = field(
        default=None, **_help("Train LoRA adapters of this rank instead of all weights.", panel=LORA)
    )
    lora_alpha: int = field(default=32, **_help("LoRA scaling alpha (the update is scaled by alpha / r).", panel=LORA))
    lora_dropout: float = field(default=0.05, **_help("Dropout on the LoRA adapters' input.", panel=LORA))
    lora_target_modules: str = field(
        default="all-linear", **_help("all-linear, or comma-separated module names (q_proj,v_proj,...).", panel=LORA)
    )
    merge: bool = field(
        default=False, **_help("With LoRA, also write the merged full model to OUT/merged.", panel=LORA)
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        **_help("MoE load-balancing loss weight. Default: the model config's; 0 disables it.", panel=OPTIMISATION),
    )
    eval_cache: str | None = field(
        default=None,
        **_help("A cache of held-out rows (precompute --split test ...) to evaluate on.", panel=EVALUATION),
    )
    eval_steps: int | None = field(
        default=None,
        **_help("Evaluate every this many steps (and always at the end when --eval-cache is set).", panel=EVALUATION),
    )
    per_device_eval_batch_size: int = field(
        default=8, **_help("Rows per evaluation forward pass and process.", panel=EVALUATION)
    )
    report_to: str = field(
        default="none",
        **_help("Also log metrics to: none, tensorboard, wandb (comma-separated for several).", panel=LOGGING),
    )
    verify: bool = field(
        default=False,
        **_help(
            "Check every shard's sha256 before training (reads the whole cache once). Cheap checks always run.",
            panel=MODEL_AND_DATA,
        ),
    )

    def __post_init__(self) -> None:
        _check(self.beta > 0, "beta", f"must be > 0, got {self.beta}")
        _check(not (self.init_from and self.model), "init_from", "cannot be combined with --model (choose one start)")
        self._check_loss()
        _check_kernel(self.attention_kernel)
        _check(self.desirable_weight > 0, "desirable_weight", f"must be > 0, got {self.desirable_weight}")
        _check(self.undesirable_weight > 0, "undesirable_weight", f"must be > 0, got {self.undesirable_weight}")
        _check(self.learning_rate >= 0, "learning_rate", f"must be >= 0, got {self.learning_rate}")
        _check(
            self.per_device_train_batch_size >= 1,
            "per_device_train_batch_size",
            f"must be at least 1, got {self.per_device_train_batch_size}",
        )
        if self.loss_type == "kto":
            _check(
                self.per_device_train_batch_size > 1,
                "per_device_train_batch_size",
                "must be > 1 with --loss-type kto: with one row the KL estimate is that row's own reward "
                "(use >= 4, or --loss-type apo_zero_unpaired)",
            )
        _check(
            self.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            f"must be at least 1, got {self.gradient_accumulation_steps}",
        )
        _check(self.num_train_epochs > 0, "num_train_epochs", f"must be > 0, got {self.num_train_epochs}")
        _check(self.max_steps == -1 or self.max_steps > 0, "max_steps", "must be -1 (use epochs) or > 0")
        _check(0 <= self.warmup_ratio < 1, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        _check(
            self.lr_scheduler_type in SCHEDULERS,
            "lr_scheduler_type",
            f"must be one of {', '.join(SCHEDULERS)}",
        )
        _check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        _check(self.max_length is None or self.max_length >= 2, "max_length", "must be at least 2")
        _check(self.logging_steps >= 1, "logging_steps", f"must be at least 1, got {self.logging_steps}")
        _check(self.save_steps >= 0, "save_steps", f"must be >= 0, got {self.save_steps}")
        _check(not (self.resume and self.autoresume), "autoresume", "choose one of --resume and --autoresume")
        _check(not (self.fp16 and self.bf16), "fp16", "choose one of --fp16 and --bf16")
        _check(self.lora_r is None or self.lora_r >= 1, "lora_r", "must be >= 1")
        _check(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        _check(not self.merge or self.lora_r is not None, "merge", "only applies with --lora-r")
        _check(
            "lm_head" not in self.lora_target_modules.split(","),
            "lora_target_modules",
            "lm_head cannot carry an adapter: log-probs are computed from its weight directly (as in trl)",
        )
        _check(self.eval_steps is None or self.eval_steps >= 1, "eval_steps", "must be >= 1")
        _check(self.per_device_eval_batch_size >= 1, "per_device_eval_batch_size", "must be >= 1")
        trackers = [t.strip() for t in self.report_to.split(",") if t.strip()]
        unknown = [t for t in trackers if t not in REPORT_TO]
        _check(not unknown, "report_to", f"unknown {unknown}; choose from {', '.join(REPORT_TO)}")
        for tracker in set(trackers) - {"none"}:
            import importlib.util

            module = {"tensorboard": "tensorboard", "wandb": "wandb"}[tracker]
            _check(
                importlib.util.find_spec(module) is not None,
                "report_to",
                f"{tracker} is not installed: `pip install {module}`, or use --report-to none",
            )
        _check(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit", "must be >= 1")
        _check(
            self.train_sampling_strategy in SAMPLING,
            "train_sampling_strategy",
            f"must be one of {', '.join(SAMPLING)}",
        )

    @property
    def loss_types(self) -> tuple[str, ...]:
        """The --loss-type terms (one, or several joined with +)."""
        return tuple(t.strip() for t in self.loss_type.split("+"))

    @property
    def pair_loss(self) -> bool:
        """Whether the run trains a pair loss (trl.DPOTrainer's, on (chosen, rejected) pairs), not KTO's."""
        return is_pair_loss(self.loss_type)

    @property
    def weights(self) -> tuple[float, ...]:
        """The weight of each --loss-type term (--loss-weights; 1 each by default)."""
        if self.loss_weights is None:
            return (1.0,) * len(self.loss_types)
        return tuple(float(w) for w in self.loss_weights.split(","))

    def _check_loss(self) -> None:
        check_loss_names(self.loss_type)
        types = self.loss_types
        if self.loss_weights is not None:
            _check(self.pair_loss, "loss_weights", "weights the terms of a pair loss (--loss-type a+b)")
            try:
                weights = self.weights
            except ValueError:
                raise KTOPipelineError(
                    f"--loss-weights: cannot read {self.loss_weights!r} as comma-separated numbers"
                ) from None
            _check(
                len(weights) == len(types),
                "loss_weights",
                f"{len(weights)} weights for the {len(types)} terms of --loss-type {self.loss_type}",
            )
        if not self.pair_loss:
            for name, default in PAIR_OPTIONS.items():
                _check(
                    getattr(self, name) == default,
                    name,
                    f"applies to pair losses only, not to --loss-type {self.loss_type}",
                )
            return
        for name, default in KTO_OPTIONS.items():
            _check(getattr(self, name) == default, name, f"applies to KTO only, not to --loss-type {self.loss_type}")
        _check(
            self.f_divergence_type in F_DIVERGENCE_TYPES,
            "f_divergence_type",
            f"must be one of {', '.join(F_DIVERGENCE_TYPES)}",
        )
        _check(
            self.f_divergence_type == "reverse_kl" or set(types) <= set(F_DIVERGENCE_LOSS_TYPES),
            "f_divergence_type",
            f"{self.f_divergence_type} applies to {', '.join(F_DIVERGENCE_LOSS_TYPES)} only (the other losses have "
            f"no valid f-divergence generalization); --loss-type {self.loss_type} needs reverse_kl",
        )
        _check(0 <= self.label_smoothing < 1, "label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")
        _check(
            "exo_pair" not in types or self.label_smoothing > 0,
            "label_smoothing",
            "must be > 0 with exo_pair (the EXO paper uses 1e-3)",
        )
        _check(
            "robust" not in types or self.label_smoothing < 0.5,
            "label_smoothing",
            f"must be in [0, 0.5) with robust, got {self.label_smoothing}",
        )
        _check(self.discopop_tau > 0, "discopop_tau", f"must be > 0, got {self.discopop_tau}")
        _check(self.ld_alpha is None or 0 <= self.ld_alpha <= 1, "ld_alpha", f"must be in [0, 1], got {self.ld_alpha}")


def check_loss_names(loss_type: str) -> None:
    """A --loss-type names known losses: one of KTO's, or pair losses joined with + (each once)."""
    names = f"{', '.join(LOSS_TYPES)} (KTO), or of {', '.join(PAIR_LOSS_TYPES)} (pairs)"
    _check(
        "," not in loss_type,
        "loss_type",
        f"{loss_type!r}: join the terms of a combination with + (sigmoid+bco_pair+sft); commas separate "
        "a sweep's values",
    )
    types = [t.strip() for t in loss_type.split("+")]
    unknown = [t for t in types if t not in LOSS_TYPES + PAIR_LOSS_TYPES]
    _check(not unknown, "loss_type", f"unknown {', '.join(map(repr, unknown))}: each term must be one of {names}")
    _check(
        len(types) == 1 or all(t in PAIR_LOSS_TYPES for t in types),
        "loss_type",
        f"{loss_type!r}: only pair losses combine (KTO's {', '.join(LOSS_TYPES)} train alone)",
    )
    _check(len(set(types)) == len(types), "loss_type", f"{loss_type!r} names a term twice")


# each family's own options and their defaults (refused with the other family's losses; a sweep leaves them out
# of the other family's runs)
PAIR_OPTIONS = {
    "loss_weights": None,
    "label_smoothing": 0.0,
    "f_divergence_type": "reverse_kl",
    "f_alpha_divergence_coef": 0.5,
    "discopop_tau": 0.05,
    "ld_alpha": None,
}
KTO_OPTIONS = {"desirable_weight": 1.0, "undesirable_weight": 1.0}


@dataclass
class GenerateConfig(_ConfigMixin):
    """Side by side: the reference model's and the trained policy's answers to the same prompts. With
    `num_return_sequences`: that many sampled completions per prompt of a file, by the policy alone, written as
    dataset rows to label."""

    run: str = field(
        **_help(
            "A `kto-pipeline train --output-dir` (full model or LoRA adapter): the policy and its tokenizer are "
            "loaded from it.",
            panel=MODELS,
        )
    )
    reference: str | None = field(
        default=None,
        **_help(
            "Reference model (hub id or directory). Default: the reference model of the cache the run trained on.",
            panel=MODELS,
        ),
    )
    cache: str | None = field(
        default=None,
        **_help(
            "A precompute cache whose prompts to answer (its token ids, chat template included), with its labelled "
            "completions shown alongside. Default: the run's --eval-cache.",
            panel=PROMPTS,
        ),
    )
    prompts: str | None = field(
        default=None,
        **_help(
            "Instead of a cache: a .jsonl file whose rows have `prompt`, a string or a list of {role, content} "
            "messages (rendered with the chat template and the generation prompt).",
            panel=PROMPTS,
        ),
    )
    num_prompts: int | None = field(
        default=None,
        **_help(
            "How many prompts to answer: the first ones, in order. Default: 8 distinct prompts side by side; "
            "with --num-return-sequences, every row of --prompts.",
            panel=PROMPTS,
        ),
    )
    max_new_tokens: int = field(
        default=128, **_help("Most tokens of each answer (answers stop earlier at EOS).", panel=DECODING)
    )
    do_sample: bool | None = field(
        default=None,
        **_help(
            "Sample the answers; without it decoding is greedy (the most likely token each step). Default: greedy "
            "side by side, sampled with --num-return-sequences.",
            panel=DECODING,
        ),
    )
    temperature: float = field(default=1.0, **_help("Sampling temperature (when sampling).", panel=DECODING))
    top_p: float = field(
        default=1.0,
        **_help("Nucleus sampling: sample among the most likely tokens of this total probability.", panel=DECODING),
    )
    seed: int = field(
        default=0,
        **_help("Seed of the sampling: the same seed, prompts and --batch-size give the same answers.", panel=DECODING),
    )
    batch_size: int = field(
        default=8,
        **_help(
            "Sequences per generate call (left-padded): prompts, or with --num-return-sequences, completions.",
            panel=DECODING,
        ),
    )
    num_return_sequences: int | None = field(
        default=None,
        **_help(
            "Rounds: sample this many completions of each --prompts row with the policy alone (no reference) and "
            "write them as prompt/completion rows, unlabeled (label null) unless --label-with labels them, for "
            "`precompute --append`. Sampling is on; greedy is refused when it is above 1.",
            panel=ROUNDS,
        ),
    )
    label_with: str | None = field(
        default=None,
        **_help(
            "With --num-return-sequences: label each row with your Python function, MODULE:FUNCTION (MODULE a "
            "dotted module name importable from the current directory, or a path to a .py file). It is called "
            "as FUNCTION(row) with the row dict (prompt, completion, policy, sample_index, ...) and must return "
            "True (desirable) or False (undesirable): a bool or numpy bool, nothing else.",
            panel=ROUNDS,
        ),
    )
    output: str | None = field(
        default=None,
        **_help(
            "The file to write (JSON lines). Default: RUN/samples.jsonl, which `report` shows; with "
            "--num-return-sequences, RUN/rounds/completions.jsonl.",
            panel=OUTPUT,
        ),
    )
    overwrite: bool = field(
        default=False,
        **_help(
            "With --num-return-sequences: replace an existing --output (else refused). The side-by-side samples "
            "file is always replaced.",
            panel=OUTPUT,
        ),
    )
    dtype: str = field(
        default="auto",
        **_help("Dtype of both models: auto = bfloat16 on a GPU that supports it, else float32.", panel=MODELS),
    )
    trust_remote_code: bool = field(
        default=False, **_help("Allow models and tokenizers that run their own code.", panel=MODELS)
    )

    @property
    def rounds(self) -> bool:
        """Sampled completions of a prompts file, written as rows to label (--num-return-sequences)."""
        return self.num_return_sequences is not None

    @property
    def sampling(self) -> bool:
        """Whether decoding samples: --do-sample / --no-do-sample, else on in rounds and off side by side."""
        return self.do_sample if self.do_sample is not None else self.rounds

    def __post_init__(self) -> None:
        _check(
            self.cache is None or self.prompts is None,
            "prompts",
            "choose one prompt source: --cache (a precompute cache) or --prompts (a .jsonl file), not both",
        )
        _check(
            self.num_prompts is None or self.num_prompts >= 1,
            "num_prompts",
            f"must be at least 1, got {self.num_prompts}",
        )
        _check(self.max_new_tokens >= 1, "max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        _check(self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}")
        _check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        for name in ("temperature", "top_p"):
            _check(
                self.sampling or getattr(self, name) == 1.0,
                name,
                "only applies with --do-sample (greedy decoding ignores it)",
            )
        _check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        n = self.num_return_sequences
        if n is None:
            for name in ("label_with", "overwrite"):
                _check(not getattr(self, name), name, "only applies with --num-return-sequences")
            return
        _check(n >= 1, "num_return_sequences", f"must be at least 1, got {n}")
        _check(
            self.prompts is not None,
            "num_return_sequences",
            "samples completions of the rows of a prompts file, written with each row's prompt as given: pass "
            "--prompts FILE.jsonl" + (" instead of --cache" if self.cache is not None else ""),
        )
        _check(
            self.reference is None,
            "reference",
            "does not apply with --num-return-sequences: completions are sampled with the policy (--run) alone",
        )
        _check(
            self.sampling or n == 1,
            "num_return_sequences",
            f"{n} greedy completions of a prompt are one completion {n} times: drop --no-do-sample (completions "
            "are sampled by default) or ask for --num-return-sequences 1",
        )
        if self.label_with is not None:
            module, _, function = self.label_with.rpartition(":")
            _check(
                bool(module.strip()) and function.strip().isidentifier(),
                "label_with",
                f"expected MODULE:FUNCTION (e.g. rules.py:label or my_package.rules:label), got {self.label_with!r}",
            )


LENGTHS = ("full", "kto-mix")  # estimate-memory --lengths


@dataclass
class MemoryEstimateConfig(_ConfigMixin):
    """`kto-pipeline estimate-memory`: the peak accelerator memory per device of one `train` step. The flags
    that shape memory are named as `train`'s."""

    model: str = field(
        **_help("Model: a local directory with config.json, or a hub id (only its config is read).", panel=MODEL)
    )
    per_device_train_batch_size: int = field(
        default=8, **_help("Rows per forward pass and device; with a pair loss, pairs.", panel=DATA)
    )
    max_length: int = field(default=1024, **_help("Tokens of prompt + completion per row, at most.", panel=DATA))
    loss_type: str = field(
        default="kto",
        **_help(
            "As train's: KTO's (each row's completion with grad, then its KL completion without) or a pair loss "
            "(sigmoid, ipo, ...: each pair's prompt once and both answers with grad; the chosen answer is a row's "
            "completion, the rejected one the completion of another row, as --lengths draws them).",
            panel=OPTIMISATION,
        ),
    )
    lengths: str = field(
        default="full",
        **_help(
            "Row lengths: full (every row and KL row at --max-length, a quarter of it prompt: the largest batch a "
            "run can meet) or kto-mix (the largest batch of an epoch of kto-mix-14k-like lengths, seeded).",
            panel=DATA,
        ),
    )
    bf16: bool = field(
        default=True, **_help("bf16 autocast over float32 weights (else float32 throughout).", panel=OPTIMISATION)
    )
    gradient_checkpointing: bool = field(
        default=False, **_help("Recompute activations in the backward pass.", panel=OPTIMISATION)
    )
    fsdp_world_size: int = field(
        default=1, **_help("Shard with FSDP2 over this many devices (1: no sharding).", panel=OPTIMISATION)
    )
    cpu_offload: bool = field(
        default=False,
        **_help(
            "With --fsdp-world-size > 1: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer "
            "state in host memory).",
            panel=OPTIMISATION,
        ),
    )
    lora_r: int | None = field(
        default=None,
        **_help("Train LoRA adapters of this rank (all linear layers) instead of all weights.", panel=LORA),
    )
    against_trl: bool = field(
        default=False,
        **_help(
            "Also simulate trl.KTOTrainer online (a reference model beside the policy) on the same rows.", panel=OUTPUT
        ),
    )
    json: bool = field(default=False, **_help("Print one JSON line instead of a table.", panel=OUTPUT))

    def __post_init__(self) -> None:
        _check(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be at least 1")
        _check(self.max_length >= 8, "max_length", f"must be at least 8, got {self.max_length}")
        _check(self.lengths in LENGTHS, "lengths", f"must be one of {', '.join(LENGTHS)}, got {self.lengths!r}")
        _check(self.fsdp_world_size >= 1, "fsdp_world_size", "must be at least 1")
        _check(not self.cpu_offload or self.fsdp_world_size > 1, "cpu_offload", "needs --fsdp-world-size > 1")
        _check(self.lora_r is None or self.lora_r >= 1, "lora_r", "must be >= 1")
        _check(
            self.lora_r is None or self.fsdp_world_size == 1,
            "lora_r",
            "is simulated on one device only; drop --fsdp-world-size",
        )
        _check(
            not (self.against_trl and self.fsdp_world_size > 1),
            "against_trl",
            "compares on one device only; drop --fsdp-world-size",
        )
        check_loss_names(self.loss_type)
        _check(
            not (self.against_trl and self.pair_loss),
            "against_trl",
            "simulates trl.KTOTrainer's step: use it with --loss-type kto or apo_zero_unpaired",
        )

    @property
    def pair_loss(self) -> bool:
        return is_pair_loss(self.loss_type)
