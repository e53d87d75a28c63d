"""FSDP2: the model sharded over the processes with torch's own `fully_shard`, each decoder layer, then the root.

accelerate cannot shard on a CPU (with `ACCELERATE_USE_FSDP` and `ACCELERATE_USE_CPU` it silently falls back to
DDP), so the model is sharded here, the way torchtune and torchtitan shard, configured by what `accelerate launch
--config_file configs/accelerate/fsdp.yaml` exports (`FSDP_VERSION`, `FSDP_*`). accelerate still runs the process
group, the data loaders and the optimizer's bookkeeping; it neither wraps the model nor sets up FSDP of its own.

The root is the module whose forward a stage calls (`PolicyScorer`, `ReferenceScorer`): its forward gathers the
parameters outside the layers (embeddings, final norm, LM head), which the scoring reads directly. No precision
policy: parameters stay in the dtype they were loaded in and outputs are not cast, so that the log-probs and the
loss stay float32 and a sharded run computes what one process computes (bf16 comes from autocast around the
root's forward, as for one process).

Every forward is a collective: each process must run the same number of forwards at every step, or the others
wait forever. Where the data decides how many forwards a process runs (the reference pass's batches),
`agree_on_forwards` makes the count uniform and the short processes run filler forwards.

A checkpoint stores the weights and the optimizer state sharded, each process writing its own shards
(`torch.distributed.checkpoint`), in `sharded/`; accelerate's state beside it holds the scheduler and RNG states.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.runtime.engines.base import ACCELERATE_STATE, Engine
from kto_pipeline.runtime.launch import env_flag, most_of_all
from kto_pipeline.runtime.precision import Regime, autocast_forward

SHARDED = "sharded"  # a checkpoint's weights and optimizer state, each process's shards (torch.distributed.checkpoint)


class FSDP2(Engine):
    name = "fsdp2"
    collective_forwards = True
    state_holds_weights = True
    holds_whole_model = False

    def __init__(
        self,
        world_size: int,
        reshard_after_forward: bool = True,
        offload_params: bool = False,
        activation_checkpointing: bool = False,
        layer_classes: tuple[str, ...] = (),
    ):
        super().__init__(world_size)
        self.reshard_after_forward = reshard_after_forward
        self.offload_params = offload_params
        self.activation_checkpointing = activation_checkpointing
        self.layer_classes = layer_classes  # FSDP_TRANSFORMER_CLS_TO_WRAP; () = the model's _no_split_modules

    @classmethod
    def from_env(cls, world_size: int) -> FSDP2:
        """The settings `accelerate launch` exports from an FSDP config."""
        version = os.environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise KTOPipelineError(
                f"FSDP_VERSION={version}: kto-pipeline shards with FSDP2 only. Set `fsdp_version: 2` in the accelerate "
                "config (configs/accelerate/fsdp.yaml does), or export FSDP_VERSION=2."
            )
        classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
        return cls(
            world_size,
            reshard_after_forward=env_flag("FSDP_RESHARD_AFTER_FORWARD", True),
            offload_params=env_flag("FSDP_OFFLOAD_PARAMS"),
            activation_checkpointing=env_flag("FSDP_ACTIVATION_CHECKPOINTING"),
            layer_classes=tuple(c.strip() for c in classes.split(",") if c.strip()),
        )

    @contextmanager
    def _building_accelerator(self):
        """accelerate must not set up FSDP of its own: it reads ACCELERATE_USE_FSDP when constructed."""
        saved = os.environ.pop("ACCELERATE_USE_FSDP", None)
        try:
            yield
        finally:
            if saved is not None:
                os.environ["ACCELERATE_USE_FSDP"] = saved

    # ------------------------------------------------------------------ setup

    def prepare_policy(self, scorer, model, make_optimizer: Callable, loader=None, move: bool = True):
        """Sharded before the optimizer is built, so that it holds each process's shards only; the root's forward
        under the regime's autocast."""
        self.shard(scorer, model, self.accelerator.device)
        autocast_forward(scorer, self.regime, cache=False)
        optimizer = make_optimizer(model)
        if loader is None:
            return scorer, self.accelerator.prepare(optimizer), None
        optimizer, loader = self.accelerator.prepare(optimizer, loader)
        return scorer, optimizer, loader

    def prepare_scorer(self, scorer, model, regime: Regime, device: torch.device):
        """Each process keeps 1/N of the weights; each layer's are gathered for its forward."""
        autocast_forward(scorer, regime, cache=False)
        self.shard(scorer, model, device)
        return scorer

    def shard(self, root: torch.nn.Module, model, device: torch.device) -> torch.nn.Module:
        """Shard `model`'s decoder layers, then `root` (the module whose forward the stage calls)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        self.device = device
        mesh = init_device_mesh(device.type, (self.world_size,))
        offload = CPUOffloadPolicy() if self.offload_params else OffloadPolicy()
        units = list(decoder_layers(model, self.layer_classes))
        embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is not None and head.weight is not embeddings.weight:
            # Untied, the embeddings and the LM head are units of their own: else they are the root's, whole on every
            # process from the first forward to the end of the backward (4 GiB for Qwen2-7B in float32). The chunked
            # head then runs as the head's own forward (logprobs._head_logps), which gathers its weight.
            units += [embeddings, head]
        for unit in [*units, root]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward, offload_policy=offload)
        return root

    def agree_on_forwards(self, count: int) -> int:
        return most_of_all(count, self.device)

    # ------------------------------------------------------------------ the step

    def clip_grad_norm(self, module, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ for sharded gradients: the norm over every process's shards."""
        from torch.distributed.tensor import DTensor

        parameters = [p for p in module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in parameters], 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total

    # ------------------------------------------------------------------ state

    def unwrap(self, module):
        return module

    def full_state_dict(self, module) -> dict:
        """The shards gathered, onto the CPU of the main process only."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_state(self, module, optimizer, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        with self._optimizer_not_in_accelerate_state():
            self.accelerator.save_state(str(directory / ACCELERATE_STATE))
        dcp.save(_sharded_state(module, optimizer), checkpoint_id=str(directory / SHARDED))

    def load_state(self, module, optimizer, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sharded = _sharded_state(module, optimizer)
        dcp.load(sharded, checkpoint_id=str(directory / SHARDED))
        set_state_dict(
            module,
            getattr(optimizer, "optimizer", optimizer),
            model_state_dict=sharded["model"],
            optim_state_dict=sharded["optimizer"],
        )
        with self._optimizer_not_in_accelerate_state():
            self.accelerator.load_state(str(directory / ACCELERATE_STATE))

    @contextmanager
    def _optimizer_not_in_accelerate_state(self):
        """The optimizer state is saved sharded with the weights: accelerate would save (and load) only the main
        process's shards of it."""
        saved = self.accelerator._optimizers
        self.accelerator._optimizers = []
        try:
            yield
        finally:
            self.accelerator._optimizers = saved

    def __str__(self) -> str:
        return f"sharded (FSDP2) over {self.world_size} processes"


def _sharded_state(module, optimizer) -> dict:
    """This process's shards of the weights and of the optimizer state, by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(module, getattr(optimizer, "optimizer", optimizer))
    return {"model": model_state, "optimizer": optimizer_state}


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
