"""Quantized bases (QLoRA): the reference and the policy's frozen base loaded in 4 or 8 bits by bitsandbytes.

The options are trl's (its ModelConfig and `get_quantization_config`), in both stages: `--load-in-4bit` (NF4 or FP4
blocks, computing in the weights' dtype, --dtype, as trl's `bnb_4bit_compute_dtype`), `--load-in-8bit` (LLM.int8()),
`--bnb-4bit-quant-type`, `--use-bnb-nested-quant` (the blocks' scales quantized too), `--bnb-4bit-quant-storage`.
The cache records the quantization its reference ran in (`Quantization.record`); `train` builds the same quantized
base under its LoRA adapters, so that at step 1 the policy is the reference, and refuses another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kto_pipeline.errors import KTOPipelineError

TRL_LORA_R = 16  # trl ModelConfig.lora_r default: the rank --use-peft trains without --lora-r

QUANT_TYPES = ("nf4", "fp4")
STORAGE_DTYPES = ("uint8", "float16", "bfloat16", "float32")
INSTALL = "pip install 'kto-pipeline[qlora]' (or: pip install 'bitsandbytes>=0.50')"

LOAD_IN_4BIT_HELP = (
    "Load the model's linear layers in 4 bits with bitsandbytes (QLoRA, as trl's --load_in_4bit): the reference, "
    "and in train the frozen base under LoRA adapters (LoRA is implied). Computes in --dtype."
)
LOAD_IN_8BIT_HELP = "Load the model's linear layers in 8 bits with bitsandbytes (LLM.int8(), as trl's --load_in_8bit)."
QUANT_TYPE_HELP = "With --load-in-4bit: the 4-bit data type, nf4 (NormalFloat, QLoRA's) or fp4."
NESTED_HELP = "With --load-in-4bit: quantize the blocks' scales too (double quantization: 0.37 bit a weight less)."
STORAGE_HELP = "With --load-in-4bit: the dtype the packed 4-bit weights are stored in (default uint8)."


@dataclass(frozen=True)
class Quantization:
    """How a model's linear layers are quantized: `bits` 4 or 8; for 4 bits the data type, the compute dtype (the
    weights' --dtype), the storage dtype and nested quantization."""

    bits: int
    quant_type: str | None = None
    compute_dtype: str | None = None
    storage: str | None = None
    nested: bool = False

    def record(self) -> dict[str, Any]:
        """What manifest.json records (with the bitsandbytes version that quantized the weights)."""
        import bitsandbytes

        return {"method": "bitsandbytes", **asdict(self), "bitsandbytes_version": bitsandbytes.__version__}

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> Quantization | None:
        if not record:
            return None
        return cls(record["bits"], record["quant_type"], record["compute_dtype"], record["storage"], record["nested"])

    @staticmethod
    def describe(record: dict[str, Any]) -> str:
        """A manifest's record, as `inspect` and the model card show it."""
        return f"{Quantization.from_record(record)}; bitsandbytes {record['bitsandbytes_version']}"

    def transformers_config(self):
        """transformers' BitsAndBytesConfig, as trl's `get_quantization_config` builds it."""
        from transformers import BitsAndBytesConfig

        if self.bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=self.compute_dtype,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.nested,
            bnb_4bit_quant_storage=self.storage,
        )

    def __str__(self) -> str:
        if self.bits == 8:
            return "8-bit (bitsandbytes LLM.int8())"
        nested = ", nested" if self.nested else ""
        where = f"computing in {self.compute_dtype}, stored as {self.storage}{nested}"
        return f"4-bit {self.quant_type} (bitsandbytes, {where})"


def fingerprint_of(quantization: Quantization) -> dict[str, Any]:
    """What of a quantization a cache's fingerprint holds (a cache is reused only by a run quantized alike)."""
    return asdict(quantization)


def quantization_of(config, compute_dtype: str) -> Quantization | None:
    """The quantization a stage's config asks for (None: none), its options checked; `compute_dtype`: the weights'
    dtype the 4-bit layers compute in. Raises with the install line where bitsandbytes is missing."""
    if config.load_in_4bit and config.load_in_8bit:
        raise KTOPipelineError("--load-in-4bit and --load-in-8bit: choose one")
    if config.bnb_4bit_quant_type not in QUANT_TYPES:
        raise KTOPipelineError(
            f"--bnb-4bit-quant-type: must be one of {', '.join(QUANT_TYPES)}, got {config.bnb_4bit_quant_type!r}"
        )
    storage = config.bnb_4bit_quant_storage
    if storage is not None and storage not in STORAGE_DTYPES:
        raise KTOPipelineError(f"--bnb-4bit-quant-storage: must be one of {', '.join(STORAGE_DTYPES)}, got {storage!r}")
    if not (config.load_in_4bit or config.load_in_8bit):
        four_bit_only = [name for name in ("use_bnb_nested_quant", "bnb_4bit_quant_storage") if getattr(config, name)]
        if four_bit_only:
            raise KTOPipelineError(f"--{four_bit_only[0].replace('_', '-')}: only applies with --load-in-4bit")
        return None
    require_bitsandbytes("--load-in-4bit" if config.load_in_4bit else "--load-in-8bit")
    if config.load_in_8bit:
        return Quantization(8)
    return Quantization(4, config.bnb_4bit_quant_type, compute_dtype, storage or "uint8", config.use_bnb_nested_quant)


def require_bitsandbytes(option: str) -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise KTOPipelineError(f"{option}: bitsandbytes is not installed: {INSTALL}") from None


def train_quantization(config, cached: dict[str, Any] | None) -> Quantization | None:
    """train's quantized base: the cache's (`cached`, its manifest's record) where train's options say nothing.
    Options given must ask for the cache's quantization (what they leave unset is the cache's, or trl's defaults
    on a cache made without): its log-probs are the quantized reference's, and at step 1 the policy must be that
    reference. Another, or one on a cache made without, is refused naming both."""
    cache = Quantization.from_record(cached)
    names = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")
    given = {name: getattr(config, name) for name in names if getattr(config, name) is not None}
    if not given:
        if cache is not None:
            require_bitsandbytes(f"the cache's reference ({cache})")
        return cache
    from types import SimpleNamespace

    unset = dict(load_in_4bit=False, load_in_8bit=False, bnb_4bit_quant_type="nf4", use_bnb_nested_quant=False)
    unset["bnb_4bit_quant_storage"] = None
    if cache is not None:
        unset |= dict(load_in_4bit=cache.bits == 4, load_in_8bit=cache.bits == 8)
        if cache.bits == 4:
            unset |= dict(bnb_4bit_quant_type=cache.quant_type, use_bnb_nested_quant=cache.nested)
            unset["bnb_4bit_quant_storage"] = cache.storage
    if given.get("load_in_8bit"):
        unset["load_in_4bit"] = False
    if given.get("load_in_4bit"):
        unset["load_in_8bit"] = False
    if not {**unset, **given}["load_in_4bit"]:  # (the cache's 4-bit details do not apply)
        unset |= dict(bnb_4bit_quant_type="nf4", use_bnb_nested_quant=False, bnb_4bit_quant_storage=None)
    compute = cache.compute_dtype if cache is not None and cache.bits == 4 else "float32"
    asked = quantization_of(SimpleNamespace(**{**unset, **given}), compute)
    if asked != cache:
        options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
        raise KTOPipelineError(
            f"{options}: asks for a base quantized {asked or 'not at all'}, and the cache's reference was quantized "
            f"{cache or 'not at all'}: its log-probs are the reference's as quantized, and at step 1 the policy "
            "must be that reference. Drop the option (the cache's is used), or precompute a cache with it."
        )
    return asked


def quantized_run(config, quantization: Quantization, engine):
    """train's config on a quantized base: LoRA implied (rank 16, trl's --use-peft default, where no --lora-r is
    given: a quantized base does not train); what does not run on bitsandbytes' layers here refused."""
    import dataclasses

    option = f"--load-in-{quantization.bits}bit (the cache's reference: {quantization})"
    if config.torch_compile:
        raise KTOPipelineError(f"--torch-compile: not with {option}; bitsandbytes' layers run eagerly")
    if engine.name not in ("single", "ddp"):
        raise KTOPipelineError(f"{option}: runs in one process or under DDP here, not under {engine.name}")
    if config.lora_r is None:
        config = dataclasses.replace(config, lora_r=TRL_LORA_R, use_peft=True)
    return config


def one_product_in_eval_and_training(model) -> None:
    """A 4-bit layer on a CPU with AVX512-BF16 computes its eval-mode, gradient-free products with another kernel
    (bitsandbytes repacks the weight for it at the first such call): the reference pass would then score with other
    products than training's forward, and step 1 would not be exactly the reference (trl's reference, computed in
    training mode, never takes that kernel). Every 4-bit layer here runs bitsandbytes' dequantized product in both."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


# LLM.int8() computes a product one way for the reference pass (eval mode) and another in training: on a CPU training
# runs bitsandbytes' dequantized float product (`MatMul8bitFp`), the reference pass the int8 one; on a GPU both run the
# int8 product, whose outlier columns (inputs above `llm_int8_threshold`) are chosen over the whole batch. The tiny
# Llama's step-1 rewards came 2.2e-4 off 0 on the CPU; 4-bit bases compute alike in both (exactly 0, tested).
INT8_STEP_ONE = (
    "note: an 8-bit base (LLM.int8()) computes its products otherwise in training than in the reference pass "
    "(bitsandbytes' training path; outlier columns chosen per batch), so step 1's rewards and KL are near 0, not "
    "exactly 0 as with a 4-bit base or none"
)
