"""`kto-pipeline precompute`'s settings: stage 1, the reference pass into a cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kto_pipeline.config.fields import (
    DATA,
    DTYPES,
    MODEL,
    OUTPUT,
    PROCESSES,
    REFERENCE_PASS,
    ConfigMixin,
    check,
    check_compile_mode,
    check_kernel,
    described,
)
from kto_pipeline.quantization import (
    LOAD_IN_4BIT_HELP,
    LOAD_IN_8BIT_HELP,
    NESTED_HELP,
    QUANT_TYPE_HELP,
    STORAGE_HELP,
)
from kto_pipeline.runtime import STATIC_SHAPES_HELP, TORCH_COMPILE_HELP, TORCH_COMPILE_MODE_HELP
from kto_pipeline.scoring import ATTENTION_KERNEL_HELP


@dataclass
class PrecomputeConfig(ConfigMixin):
    """Stage 1: score every completion and its KL completion with the frozen reference model."""

    model: str = field(
        **described(
            "Reference model: a Hugging Face hub id or a local directory.", panel=MODEL, trl="model_name_or_path"
        )
    )
    dataset: str = field(
        **described(
            "Binary-feedback data: a hub id, a .json/.jsonl/.parquet/.csv/.arrow file, "
            "or a directory written by datasets.save_to_disk.",
            panel=DATA,
            trl="dataset_name",
        )
    )
    output: str = field(**described("Cache directory to write (manifest.json + shards/).", panel=OUTPUT))
    split: str = field(default="train", **described("Dataset split to read.", panel=DATA, trl="dataset_train_split"))
    dataset_config: str | None = field(
        default=None, **described("Dataset configuration name (hub datasets).", panel=DATA)
    )
    max_length: int = field(
        default=1024,
        **described(
            "Maximum prompt+completion tokens; longer sequences are truncated on the right, rows whose "
            "prompt alone reaches it are dropped. Training may later use any length up to this one.",
            panel=DATA,
        ),
    )
    kl_seed: int = field(
        default=0,
        **described(
            "Seed of the KL partners: which other row's completion forms each row's KL completion. Recorded in the "
            "manifest and kept by every append (train's --seed, the data order, is another seed). Formerly --seed.",
            panel=DATA,
            formerly="seed",
        ),
    )
    pairs_only: bool = field(
        default=False,
        **described(
            "Paired data only, for pair losses (DPO and its family): score each (chosen, rejected) pair as one "
            "tree, its prompt once, and skip the KL completions (KTO's loss needs them: train refuses such a "
            "cache). Rows without their pair partner are dropped.",
            panel=DATA,
        ),
    )
    num_proc: int = field(
        default=1,
        **described(
            "Processes that normalise and tokenize the data (datasets.map); the result is cached, so a second "
            "precompute of the same data, tokenizer and settings skips it.",
            panel=DATA,
            trl="dataset_num_proc",
        ),
    )
    dtype: str = field(
        default="auto",
        **described(
            "Dtype of the reference's weights: auto = float32 (bf16 compute comes from --bf16, as in train); "
            "bfloat16/float16 load the weights in that dtype.",
            panel=REFERENCE_PASS,
            trl="torch_dtype",
        ),
    )
    bf16: bool | None = field(
        default=None,
        **described(
            "Run the reference under bf16 autocast (the regime train --bf16 trains in: float32 weights, bf16 "
            "matmuls, float32 log-softmax and sums). Default: on where the GPU supports it, off on CPU.",
            panel=REFERENCE_PASS,
        ),
    )
    batch_size: int | None = field(
        default=None,
        **described(
            "Most sequences per reference forward pass (two per row: completion and KL completion). Default: no "
            "limit; each forward is filled to --max-tokens-per-batch.",
            panel=REFERENCE_PASS,
            trl="precompute_ref_batch_size",
        ),
    )
    max_tokens_per_batch: int | None = field(
        default=None,
        **described(
            "Token budget of one forward pass (rows are packed side by side, so passes carry little padding). "
            "Default: 1024 on the CPU (or --max-length), where small forwards run fastest; on a GPU what half the "
            "memory free after loading the reference holds, at most 65536. A packed row is never wider.",
            panel=REFERENCE_PASS,
        ),
    )
    attention_kernel: str = field(default="auto", **described(ATTENTION_KERNEL_HELP, panel=REFERENCE_PASS))
    torch_compile: bool | None = field(default=None, **described(TORCH_COMPILE_HELP, panel=REFERENCE_PASS))
    torch_compile_mode: str = field(default="default", **described(TORCH_COMPILE_MODE_HELP, panel=REFERENCE_PASS))
    static_shapes: bool = field(default=False, **described(STATIC_SHAPES_HELP, panel=REFERENCE_PASS))
    shard_size: int = field(default=2048, **described("Rows per Arrow shard.", panel=OUTPUT))
    revision: str | None = field(
        default=None,
        **described("Model revision (branch, tag or commit) on the hub.", panel=MODEL, trl="model_revision"),
    )
    trust_remote_code: bool = field(
        default=False, **described("Allow models and tokenizers that run their own code.", panel=MODEL)
    )
    load_in_4bit: bool = field(default=False, **described(LOAD_IN_4BIT_HELP, panel=MODEL))
    load_in_8bit: bool = field(default=False, **described(LOAD_IN_8BIT_HELP, panel=MODEL))
    bnb_4bit_quant_type: str = field(default="nf4", **described(QUANT_TYPE_HELP, panel=MODEL))
    use_bnb_nested_quant: bool = field(default=False, **described(NESTED_HELP, panel=MODEL))
    bnb_4bit_quant_storage: str | None = field(default=None, **described(STORAGE_HELP, panel=MODEL))
    overwrite: bool = field(
        default=False, **described("Replace an existing cache made with other inputs or settings.", panel=OUTPUT)
    )
    append: bool = field(
        default=False,
        **described(
            "Add to the complete cache at --output the rows of --dataset it does not hold yet (recognised by a "
            "content key over prompt, completion and label), scored into new shards; the rows it holds are not "
            "scored again. --dataset may be the whole grown log or only the new rows. The reference, tokenizer "
            "and settings must be the cache's.",
            panel=OUTPUT,
        ),
    )
    allow_missing: bool = field(
        default=False,
        **described(
            "With --append: go on when rows that the cache holds are missing from --dataset (a log that dropped "
            "or relabelled rows); they stay in the cache.",
            panel=OUTPUT,
        ),
    )
    ddp_timeout: int = field(
        default=1800,
        **described(
            "Seconds a process waits for the others in a collective before failing (as transformers' ddp_timeout).",
            panel=PROCESSES,
        ),
    )
    seed: dataclasses.InitVar[int | None] = None  # the former name of kl_seed (Python API; the CLI takes --seed)

    def __post_init__(self, seed: int | None = None) -> None:
        if seed is not None:  # PrecomputeConfig(seed=...) of an earlier release: the KL partners' seed
            self.kl_seed = seed
        check(self.max_length >= 2, "max_length", f"must be at least 2, got {self.max_length}")
        check(not (self.append and self.overwrite), "append", "cannot be combined with --overwrite")
        check(self.append or not self.allow_missing, "allow_missing", "only applies with --append")
        check(self.ddp_timeout >= 1, "ddp_timeout", f"must be at least 1 second, got {self.ddp_timeout}")
        check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_kernel(self.attention_kernel)
        check_compile_mode(self.torch_compile_mode, self.torch_compile)
        check(
            self.batch_size is None or self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}"
        )
        check(self.num_proc >= 1, "num_proc", f"must be at least 1, got {self.num_proc}")
        check(
            self.max_tokens_per_batch is None or self.max_tokens_per_batch >= self.max_length,
            "max_tokens_per_batch",
            f"must be at least --max-length ({self.max_length}) so any sequence fits, got {self.max_tokens_per_batch}",
        )
        check(self.shard_size >= 1, "shard_size", f"must be at least 1, got {self.shard_size}")
        check(
            not (self.pairs_only and self.shard_size % 2),
            "shard_size",
            f"must be even with --pairs-only (a pair's two rows stay in one shard), got {self.shard_size}",
        )
