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
from kto_pipeline.models import auto_class
from kto_pipeline.runtime.engines.base import ACCELERATE_STATE, Engine
from kto_pipeline.runtime.engines.sharded import most_of_all, return_freed_buffers
from kto_pipeline.runtime.launch import env_flag, main_decides
from kto_pipeline.runtime.precision import Regime, autocast_forward

SHARDED = "sharded"  # a checkpoint's weights and optimizer state, each process's shards (torch.distributed.checkpoint)


class FSDP2(Engine):
    name = "fsdp2"
    caches_whole_casts = False  # its units' weights are whole only inside their own forward
    fixed_parameter_addresses = False  # a unit's whole parameters are gathered anew in every forward
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
        ram_efficient_loading: bool = False,
    ):
        super().__init__(world_size)
        self.ram_efficient_loading = ram_efficient_loading  # FSDP_CPU_RAM_EFFICIENT_LOADING: one process reads
        self._fill_next = False  # `load` built the model empty here: the next `shard` fills it from the main process
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
            ram_efficient_loading=env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING"),
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

    def load(self, read, trust_remote_code: bool = False, regime: Regime | None = None):
        """With `fsdp_cpu_ram_efficient_loading` (FSDP_CPU_RAM_EFFICIENT_LOADING), only the main process reads the
        weights; the others build the model from its config with every parameter on the meta device (no memory;
        buffers, such as the rotary tables, computed for real), and `shard` fills each process's shards from the
        main process's weights, one tensor at a time. Without it, every process reads the whole model."""
        if self.world_size > 1:
            return_freed_buffers()  # the broadcast and all-gathered tensors go back to the system once freed
        if not self.ram_efficient_loading or self.world_size == 1:
            return read()
        from accelerate import PartialState

        loaded = []

        def read_on_main() -> dict:
            loaded.append(read())
            model = loaded[0]
            return {"config": model.config, "dtype": next(model.parameters()).dtype, "layout": parameter_layout(model)}

        state = PartialState()
        built = main_decides(state, read_on_main)
        model = loaded[0] if loaded else empty_model(built["config"], built["dtype"], trust_remote_code)
        # every process must shard the same parameters (else the collectives mismatch): all agree, or all stop
        if most_of_all(int(parameter_layout(model) != built["layout"]), state.device):
            raise KTOPipelineError(
                f"FSDP2: {type(model).__name__} built from its config has other parameters than the loaded model, so "
                "the weights cannot be read by one process and spread. Set `fsdp_cpu_ram_efficient_loading: false` "
                "in the accelerate config (FSDP_CPU_RAM_EFFICIENT_LOADING=false): every process then reads them."
            )
        self._fill_next = True
        return model

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
            # head then runs as the head's own forward (head.head_logps), which gathers its weight.
            units += [embeddings, head]
        fill, self._fill_next = self._fill_next, False
        if fill:
            main = torch.distributed.get_rank() == 0
            # the main process's whole weights (its own model's, kept until they are spread), keyed as `root`'s; the
            # buffers, real on every process, outlive the meta parameters' materialization below
            whole = root.state_dict() if main else {}
            buffers = {name: buffer.detach().clone() for name, buffer in root.named_buffers()}
        for unit in [*units, root]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward, offload_policy=offload)
        self._gathered_in_forward(*units, root)
        if fill:
            if not main:  # this process's shards, allocated (uninitialized) where they compute
                root.to_empty(device=device if not self.offload_params else torch.device("cpu"))
                with torch.no_grad():
                    for name, buffer in root.named_buffers():
                        buffer.copy_(buffers[name])
            _fill_from_main(root, whole, device)
            del whole, buffers
        return root

    def agree_on_forwards(self, count: int) -> int:
        return most_of_all(count, self.device)

    # ------------------------------------------------------------------ the step

    def gradient_sync(self, module, sync: bool):
        """Micro-steps before the optimizer step skip the gradient reduce-scatter (FSDP2's
        `set_requires_gradient_sync`, as accelerate's `no_sync` for FSDP2): each process adds its micro-batches'
        gradients up unsharded, and the last micro-step reduce-scatters the sum. The cost: while accumulating, each
        process holds the gradients of the whole model unsharded (as accelerate's FSDP2 does)."""
        from contextlib import nullcontext

        module.set_requires_gradient_sync(sync)
        return nullcontext()

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
        read = ", the weights read by the main process only" if self.ram_efficient_loading else ""
        return f"sharded (FSDP2) over {self.world_size} processes{read}"


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


def empty_model(config, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM of `config` with its parameters on the meta device (they take no memory) and its buffers real."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = auto_class(config).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # as from_pretrained ties them (tie_word_embeddings): one parameter, as on the main process
    return model


def parameter_layout(model) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameters (tied ones once): names and shapes."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


@torch.no_grad()
def _fill_from_main(root: torch.nn.Module, whole: dict, device: torch.device) -> None:
    """Copy the main process's whole weights (`whole`, empty elsewhere) into every process's shards of `root`: one
    tensor at a time, broadcast whole, then each process keeps its part. A process holds its shards and one whole
    tensor at most (torch's `set_model_state_dict(broadcast_from_rank0=True)` holds every received tensor until the
    end: the whole model)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, target in root.state_dict().items():
        local = target.to_local() if isinstance(target, DTensor) else target
        full = whole[name].to(device) if whole else torch.empty(target.shape, dtype=target.dtype, device=device)
        dist.broadcast(full, src=0)
        if isinstance(target, DTensor):  # this process's part of it, cut where it is (no communication)
            full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        local.copy_(full)
        del full
