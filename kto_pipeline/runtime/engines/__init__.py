"""The engines, and the registry that picks one from the launch environment.

    base.py       the interface, and the engine of one process and of DDP (accelerate replicates the model)
    single.py     one process; DDP
    fsdp2.py      torch's fully_shard per decoder layer, then the root; sharded checkpoints
    deepspeed.py  DeepSpeed ZeRO-2/3 through accelerate

Adding an engine: a file here with a subclass of `Engine`, and a line in `engine_for`.
"""

from __future__ import annotations

from kto_pipeline.runtime.engines.base import Engine
from kto_pipeline.runtime.launch import deepspeed_launch, env_flag


def engine_for(world_size: int) -> Engine:
    """The engine the launcher asked for, from its environment (`world_size`: the processes accelerate sees)."""
    from kto_pipeline.runtime.engines.deepspeed import DeepSpeed
    from kto_pipeline.runtime.engines.fsdp2 import FSDP2
    from kto_pipeline.runtime.engines.single import DDP, Single

    if env_flag("ACCELERATE_USE_FSDP"):  # accelerate launch --config_file configs/accelerate/fsdp.yaml
        return FSDP2.from_env(world_size)
    if deepspeed_launch():  # configs/accelerate/deepspeed_zero2.yaml, deepspeed_zero3.yaml
        return DeepSpeed.from_env(world_size)
    return DDP(world_size) if world_size > 1 else Single(world_size)


__all__ = ["Engine", "engine_for"]
