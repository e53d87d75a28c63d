"""Precision regimes: how a model computed, recorded by both stages and compared.

A regime is the dtype of the weights and the autocast dtype (or none). The log-softmax and every sum are float32 in
both stages whatever the regime (`scoring/logprobs.py`). KTO's rewards are differences between the policy's
log-probs and the cached reference's, so at step 1 (policy = reference) they are zero only when both stages ran in
the same regime; in another one they start off by the difference of two roundings. "float32 weights under bf16
autocast" is the regime every engine can reproduce (one process, DDP, FSDP2), because no engine casts the weights:
it is the default of both stages on a GPU that supports bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "no": None}


@dataclass(frozen=True)
class Regime:
    weights: str  # "float32", "bfloat16", "float16"
    autocast: str | None = None  # "bfloat16", "float16", or None

    @property
    def mixed_precision(self) -> str:
        """accelerate's name for the autocast: "bf16", "fp16" or "no"."""
        return next(name for name, dtype in AUTOCAST_DTYPES.items() if dtype == self.autocast)

    def __str__(self) -> str:
        return f"{self.weights} weights" + (f" under {self.autocast} autocast" if self.autocast else ", no autocast")


def default_bf16(device: torch.device | str | None = None) -> bool:
    """bf16 on where the GPU supports it, off on CPU: the default of both stages' --bf16."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def regime_mismatch(cache: Regime, run: Regime) -> str | None:
    """What to tell a run whose policy computes in `run` against a cache made in `cache` (None: they agree)."""
    if cache == run:
        return None
    return (
        f"the cache's reference ran in {cache}, and this run's policy runs in {run}: at step 1 the rewards and the "
        "KL estimate start off zero by the difference of the two roundings. Precompute the cache in this run's "
        "regime (precompute --dtype and --bf16), or train in the cache's (--bf16 / --no-bf16)."
    )
