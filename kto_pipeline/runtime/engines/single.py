"""One process, and DDP: the model whole on every process.

The base class is this engine (`base.py`): accelerate's `prepare` wraps the model in DistributedDataParallel when
several processes run, and averages the gradients in the backward. This file only names the two.
"""

from __future__ import annotations

from kto_pipeline.runtime.engines.base import Engine


class Single(Engine):
    """One process."""

    name = "single"


class DDP(Engine):
    """The model replicated on every process; gradients all-reduced (accelerate's DistributedDataParallel)."""

    name = "ddp"

    def __str__(self) -> str:
        return f"replicated (DDP) over {self.world_size} processes"
