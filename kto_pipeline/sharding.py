"""More than one process: which engine runs the stages, and sharding the model with FSDP2.

Both stages run once per process under `accelerate launch` or torchrun. accelerate sets up the process group,
shards the data loaders and gathers metrics; the model is either replicated (DDP: accelerate wraps it) or
sharded here with torch's own `fully_shard` (FSDP2), because accelerate cannot shard on a CPU (with
`ACCELERATE_USE_FSDP` and `ACCELERATE_USE_CPU` it silently falls back to DDP). One code path for CPU and GPU,
configured by what `accelerate launch --config_file configs/accelerate/fsdp.yaml` exports (`ACCELERATE_USE_FSDP`,
`FSDP_VERSION`, `FSDP_*`), the way torchtune and torchtitan shard: each decoder layer, then the root.

The root is the module whose forward a stage calls (`PolicyScorer`, `ReferenceScorer`): its forward gathers the
parameters outside the layers (embeddings, final norm, LM head), which the scoring reads directly.

Under sharding every forward is a collective: each process must run the same number of forwards at every step,
or the others wait forever. Where the data decides how many forwards a process runs (the reference pass's
batches), `agree_on_forwards` makes the count uniform and the short processes run filler forwards.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kto_pipeline.errors import KTOPipelineError


def _flag(name: str, default: bool = False) -> bool:
    from accelerate.utils import parse_flag_from_env  # accelerate's own reading of its boolean variables

    return parse_flag_from_env(name, default)


def launched_processes() -> int:
    """How many processes the launcher started (torchrun and accelerate launch set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def deepspeed_requested() -> bool:
    """`accelerate launch` with a DeepSpeed config (configs/accelerate/deepspeed_zero*.yaml) exports this."""
    return _flag("ACCELERATE_USE_DEEPSPEED")


def use_cpu() -> bool:
    """Whether accelerate must run on the CPU: asked for (ACCELERATE_USE_CPU=1), or several processes launched on
    a machine without a GPU. Without the second, accelerate gives each torchrun process a world of its own.
    Never under DeepSpeed: accelerate's CPU mode silently drops DeepSpeed (the model would be DDP-wrapped);
    DeepSpeed runs on its own CPU accelerator, over gloo (`process_group_kwargs`)."""
    if deepspeed_requested():
        return False
    return _flag("ACCELERATE_USE_CPU") or (launched_processes() > 1 and not torch.cuda.is_available())


def process_group_kwargs(timeout_seconds: int) -> dict:
    """What the process group is created with: how long a process waits for the others in a collective, and, for
    DeepSpeed on a machine without a GPU, gloo (accelerate would otherwise find no backend and give every process
    a world of its own)."""
    from datetime import timedelta

    kwargs: dict = {"timeout": timedelta(seconds=timeout_seconds)}
    if deepspeed_requested() and not torch.cuda.is_available():
        kwargs["backend"] = "gloo"
    return kwargs


def process_state(timeout_seconds: int = 1800):
    """accelerate's PartialState: one process, or one per device under accelerate launch / torchrun (without a GPU:
    the CPU and gloo). The first call in a process sets the process group up; later calls return the same state."""
    from accelerate import PartialState

    return PartialState(cpu=use_cpu(), **process_group_kwargs(timeout_seconds))


@dataclass(frozen=True)
class Engine:
    """How the model is spread over the processes: "single" (one process), "ddp" (replicated, accelerate),
    "fsdp2" (sharded here, `fully_shard`) or "deepspeed" (ZeRO-2 or ZeRO-3, through accelerate), with the settings
    from the launcher's environment."""

    name: str
    world_size: int
    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    layer_classes: tuple[str, ...] = ()  # FSDP_TRANSFORMER_CLS_TO_WRAP; () = the model's _no_split_modules
    zero_stage: int = 0  # DeepSpeed's ZeRO stage

    @property
    def shards(self) -> bool:
        """This module shards the model with FSDP2 (DeepSpeed shards its own, through accelerate)."""
        return self.name == "fsdp2"

    @property
    def deepspeed(self) -> bool:
        return self.name == "deepspeed"

    @property
    def collective_forwards(self) -> bool:
        """Every forward gathers parameters from all processes (FSDP2, ZeRO-3): all must run as many."""
        return self.shards or (self.deepspeed and self.zero_stage == 3)

    def __str__(self) -> str:
        if self.name == "single":
            return "one process"
        names = {"fsdp2": "sharded (FSDP2)", "ddp": "replicated (DDP)"}
        how = names.get(self.name, f"DeepSpeed ZeRO-{self.zero_stage}")
        return f"{how} over {self.world_size} processes"

    def record(self) -> dict:
        """What manifest.json and trainer_state.json record under "distributed"."""
        name = f"deepspeed-zero{self.zero_stage}" if self.deepspeed else self.name
        return {"engine": name, "world_size": self.world_size}


def engine_from_env(world_size: int) -> Engine:
    """The engine the launcher asked for, from its environment (`world_size`: the processes accelerate sees)."""
    if _flag("ACCELERATE_USE_FSDP"):
        version = os.environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise KTOPipelineError(
                f"FSDP_VERSION={version}: kto-pipeline shards with FSDP2 only. Set `fsdp_version: 2` in the accelerate "
                "config (configs/accelerate/fsdp.yaml does), or export FSDP_VERSION=2."
            )
        classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
        return Engine(
            "fsdp2",
            world_size,
            reshard_after_forward=_flag("FSDP_RESHARD_AFTER_FORWARD", True),
            offload_params=_flag("FSDP_OFFLOAD_PARAMS"),
            activation_checkpointing=_flag("FSDP_ACTIVATION_CHECKPOINTING"),
            layer_classes=tuple(c.strip() for c in classes.split(",") if c.strip()),
        )
    if deepspeed_requested():
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        if stage not in (2, 3):
            raise KTOPipelineError(
                f"DeepSpeed ZeRO-{stage}: kto-pipeline runs ZeRO-2 and ZeRO-3 "
                "(configs/accelerate/deepspeed_zero2.yaml, deepspeed_zero3.yaml)."
            )
        return Engine("deepspeed", world_size, zero_stage=stage)
    return Engine("ddp" if world_size > 1 else "single", world_size)


def check_process_group(state) -> None:
    """Refuse a launch whose processes do not see each other (each would believe it is alone and write the same
    output), naming how to launch instead."""
    if launched_processes() > 1 and state.num_processes == 1:
        raise KTOPipelineError(
            f"{launched_processes()} processes were launched (WORLD_SIZE), but accelerate set up a world of one: "
            "each process would run the whole stage alone. Launch with `accelerate launch` or torchrun; on a "
            "machine without a GPU export ACCELERATE_USE_CPU=1 (gloo)."
        )


@contextmanager
def accelerate_without_fsdp(engine: Engine):
    """Build accelerate's objects as for plain data parallelism when this module shards the model: accelerate must
    neither wrap the model nor set up FSDP of its own (it reads ACCELERATE_USE_FSDP when constructed)."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None) if engine.shards else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def decoder_layers(model, layer_classes: tuple[str, ...] = ()) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one: the decoder layers (the classes the model lists in `_no_split_modules`,
    or FSDP_TRANSFORMER_CLS_TO_WRAP)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(layer_classes or getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise KTOPipelineError(
            f"FSDP2: no decoder layer of {type(base).__name__} to shard (looked for modules of class "
            f"{sorted(names) or 'none: the model lists no _no_split_modules'}). Name the layer class in the accelerate "
            "config (`fsdp_transformer_layer_cls_to_wrap: MyDecoderLayer`, exported as FSDP_TRANSFORMER_CLS_TO_WRAP)."
        )
    return layers


def shard_model(root: torch.nn.Module, model, engine: Engine, device: torch.device) -> torch.nn.Module:
    """Shard `model`'s decoder layers, then `root` (the module whose forward the stage calls), over all processes.

    No precision policy: parameters stay in the dtype they were loaded in and outputs are not cast, so that the
    log-probs and the loss stay float32 and a sharded run computes what one process computes (bf16 comes from
    autocast around the root's forward, as for one process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (engine.world_size,))
    offload = CPUOffloadPolicy() if engine.offload_params else OffloadPolicy()
    units = list(decoder_layers(model, engine.layer_classes))
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is not embeddings.weight:
        # Untied, the embeddings and the LM head are units of their own: else they are the root's, whole on every
        # process from the first forward to the end of the backward (4 GiB for Qwen2-7B in float32). The chunked
        # head then runs as the head's own forward (logprobs._head_logps), which gathers its weight.
        units += [embeddings, head]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=engine.reshard_after_forward, offload_policy=offload)
    fully_shard(root, mesh=mesh, reshard_after_forward=engine.reshard_after_forward, offload_policy=offload)
    return root


def release_deepspeed(engine) -> None:
    """Once a stage is done with a DeepSpeed engine: remove its hooks (ZeRO-3 gathers parameters from them) and
    its buffers (`DeepSpeedEngine.destroy`), so that nothing of it is left to be torn down at interpreter exit."""
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()


def autocast_forward(module: torch.nn.Module, mixed_precision: str, cache: bool = True) -> None:
    """Run `module`'s forward under autocast, as accelerate does for the models it prepares ("bf16", "fp16"; "no":
    nothing): the weights stay float32, and so do the log-probs (the scoring computes them in float32).

    `cache=False` for a sharded model: autocast would keep its bf16 cast of every layer's gathered weights for the
    whole forward, undoing the resharding after each layer (found by the memory simulation); the casts are the same
    values either way."""
    if mixed_precision not in ("bf16", "fp16"):
        return
    import functools

    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    forward = module.forward
    device_type = next(module.parameters()).device.type

    @functools.wraps(forward)
    def autocast(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype, cache_enabled=cache):
            return forward(*args, **kwargs)

    module.forward = autocast


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for sharded gradients: the norm over every process's shards."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters], 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def agree_on_forwards(count: int, device: torch.device) -> int:
    """The most forwards any process will run (all processes call this together)."""
    import torch.distributed as dist

    n = torch.tensor([count], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())
