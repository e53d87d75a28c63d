"""Precision regimes: how a model computes, resolved once from the config and the device, recorded by both stages
and compared.

A regime is the dtype of the weights and the autocast dtype (or none). The log-softmax and every sum are float32 in
both stages whatever the regime (`scoring/head.py`). KTO's rewards are differences between the policy's
log-probs and the cached reference's, so at step 1 (policy = reference) they are zero only when both stages ran in
the same regime; in another one they start off by the difference of two roundings. "float32 weights under bf16
autocast" is the regime every engine can reproduce (one process, DDP, FSDP2, DeepSpeed's torch autocast), because
no engine casts the weights: it is the default of both stages on a GPU that supports bf16.

The stages ask: `policy_regime` (train: float32 weights), `reference_regime` (precompute: --dtype), `check_regime`
(train against its cache), `autocast_forward` (the engines apply it where accelerate does not). How a regime's
products compute (a CPU's half-precision products in blocks of rows, `rows_alike`; the decoder layers' weights cast
once an optimizer step, `StepCasts`) is `scoring/products.py`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kto_pipeline.errors import KTOPipelineError

AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "no": None}
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Regime:
    weights: str  # "float32", "bfloat16", "float16"
    autocast: str | None = None  # "bfloat16", "float16", or None

    @property
    def mixed_precision(self) -> str:
        """accelerate's name for the autocast: "bf16", "fp16" or "no"."""
        return next(name for name, dtype in AUTOCAST_DTYPES.items() if dtype == self.autocast)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' torch dtype."""
        return WEIGHT_DTYPES[self.weights]

    def record(self) -> dict[str, str | None]:
        """What manifest.json records of the reference's regime (fingerprint keys `dtype`, `autocast`)."""
        return {"dtype": self.weights, "autocast": self.autocast}

    def __str__(self) -> str:
        return f"{self.weights} weights" + (f" under {self.autocast} autocast" if self.autocast else ", no autocast")


def default_bf16(device: torch.device | str | None = None) -> bool:
    """bf16 on where the GPU supports it, off on CPU: the default of both stages' --bf16."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def policy_regime(bf16: bool | None, fp16: bool = False) -> Regime:
    """train's regime: the policy loads in float32, under bf16 or fp16 autocast as the flags say (--bf16 unset: on
    where the GPU supports it)."""
    if fp16:
        if not torch.cuda.is_available():
            raise KTOPipelineError("--fp16 needs a CUDA GPU; on CPU use --bf16 or full precision (--no-bf16).")
        return Regime("float32", AUTOCAST_DTYPES["fp16"])
    on = default_bf16() if bf16 is None else bf16
    return Regime("float32", AUTOCAST_DTYPES["bf16"] if on else None)


def reference_regime(dtype: str, bf16: bool | None, device: torch.device) -> Regime:
    """precompute's regime: the reference's weights in --dtype (auto: float32), under bf16 autocast with --bf16
    (unset: on where the device's GPU supports it)."""
    from kto_pipeline.models import resolve_dtype

    weights = resolve_dtype("float32" if dtype == "auto" else dtype, device)
    on = default_bf16(device) if bf16 is None else bf16
    return Regime(str(weights).removeprefix("torch."), "bfloat16" if on else None)


def regime_mismatch(cache: Regime, run: Regime) -> str | None:
    """What to tell a run whose policy computes in `run` against a cache made in `cache` (None: they agree)."""
    if cache == run:
        return None
    return (
        f"the cache's reference ran in {cache}, and this run's policy runs in {run}: at step 1 the rewards and the "
        "KL estimate start off zero by the difference of the two roundings. Precompute the cache in this run's "
        "regime (precompute --dtype and --bf16), or train in the cache's (--bf16 / --no-bf16)."
    )


def check_regime(cache: Regime, run: Regime, strict: bool) -> str | None:
    """A mismatch is an error with --strict, else a warning to print (returned); None when the regimes agree."""
    mismatch = regime_mismatch(cache, run)
    if mismatch and strict:
        raise KTOPipelineError(f"--strict: {mismatch}")
    return f"warning: {mismatch} (--strict makes this an error)" if mismatch else None


def autocast_forward(module: torch.nn.Module, regime: Regime, cache: bool = True) -> None:
    """Run `module`'s forward under the regime's autocast, as accelerate does for the models it prepares (none:
    nothing): the weights stay as they are, and the log-probs float32 (the scoring computes them in float32).

    `cache=False` for a sharded model: autocast would keep its bf16 cast of every layer's gathered weights for the
    whole forward, undoing the resharding after each layer (found by the memory simulation); the casts are the same
    values either way."""
    if regime.autocast is None:
        return
    dtype = WEIGHT_DTYPES[regime.autocast]
    forward = module.forward
    device_type = next(module.parameters()).device.type

    @functools.wraps(forward)
    def autocast(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype, cache_enabled=cache):
            return forward(*args, **kwargs)

    module.forward = autocast
