"""The engine interface: how the model is spread over the processes, asked by both stages and the checkpoints.

An engine loads the model (`load`), prepares a policy for training (`prepare_policy`) or a frozen model for
scoring (`prepare_scorer`), runs the optimizer step's parts (`backward`, `clip_grad_norm`, `step`), gives the whole
state dict, saves and loads its state in a checkpoint, records itself for manifest.json and trainer_state.json, and
lets go of what it holds (`close`). The stages call these and never test which engine runs: adding one is a file in
this folder and a line in the registry (`engines/__init__.py`).

This base class is the engine of one process, and of DDP: accelerate replicates the model (its `prepare` wraps it in
DistributedDataParallel when several processes run) and runs the forward under the regime's autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kto_pipeline.runtime.launch import check_process_group, process_group_kwargs, use_cpu
from kto_pipeline.runtime.precision import Regime, autocast_forward

ACCELERATE_STATE = "accelerate_state"  # a checkpoint's optimizer, scheduler and RNG states, written by accelerate
GATHERED_IN_FORWARD = "kto_gathered_in_forward"  # set on a module whose parameters are whole only in its own forward


class Engine:
    name = "single"
    collective_forwards = False  # every forward gathers parameters from all processes: all must run as many
    state_holds_weights = False  # the engine's checkpoint state holds the weights (else: the HF files beside it)
    holds_whole_model = True  # each process holds the whole model (else it is gathered to be saved or merged)
    activation_checkpointing = False  # the launch config asks for gradient checkpointing
    caches_whole_casts = True  # a step may keep casts of the whole weights, under torch.autocast (`StepCasts`)
    fixed_parameter_addresses = True  # the parameters stay where they are from step to step (what CUDA graphs need)
    compile_refusal: str | None = None  # why the decoder layers cannot be compiled by region (None: they can)

    @staticmethod
    def gathers_in_forward(module: torch.nn.Module) -> bool:
        """Whether `module`'s parameters are whole only within its own forward and backward (an engine that shards
        them so, DeepSpeed ZeRO-3 or an FSDP2 unit, marked the module when it prepared the model): the scoring then
        runs a chunked computation on its weight as that module's forward."""
        return getattr(module, GATHERED_IN_FORWARD, False)

    @staticmethod
    def _gathered_in_forward(*modules: torch.nn.Module) -> None:
        for module in modules:
            setattr(module, GATHERED_IN_FORWARD, True)

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.accelerator = None  # train's Accelerator, once `make_accelerator` built it
        self.regime: Regime | None = None  # the policy's, from `make_accelerator`
        self.device = torch.device("cpu")  # where the model computes, once prepared
        self.gradients_in_place = False  # the gradients kept allocated from step to step (`prepare_policy`)

    # ------------------------------------------------------------------ setup

    def make_accelerator(
        self, regime: Regime, max_grad_norm: float, timeout_seconds: int, cpu: bool | None = None, **kwargs
    ):
        """train's Accelerator for a policy computing in `regime`, with a fresh global state (accelerate keeps one
        per process: several runs in one process, a sweep through the Python API, may each choose their own
        precision), the process group's timeout and the engine's settings."""
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

        self.regime = regime
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        with self._building_accelerator():
            self.accelerator = Accelerator(
                cpu=use_cpu() if cpu is None else cpu,
                mixed_precision=regime.mixed_precision,
                kwargs_handlers=[InitProcessGroupKwargs(**process_group_kwargs(timeout_seconds))],
                # a batch's copy to an accelerator does not wait for the device (train's loaders pin their batches
                # there); on the CPU it changes nothing
                dataloader_config=DataLoaderConfiguration(non_blocking=True),
                **kwargs,
            )
        check_process_group(self.accelerator)
        self.device = self.accelerator.device
        self._configure(max_grad_norm)
        return self.accelerator

    def _building_accelerator(self):
        """A context around the Accelerator's construction (accelerate reads its environment then)."""
        from contextlib import nullcontext

        return nullcontext()

    def _configure(self, max_grad_norm: float) -> None:
        """Settings of the engine that the train flags own, once the Accelerator exists."""

    def load(
        self, read: Callable[[], torch.nn.Module], trust_remote_code: bool = False, regime: Regime | None = None
    ) -> torch.nn.Module:
        """The model as this process holds it before `prepare_policy` / `prepare_scorer`: `read()` (which loads it
        whole, on the CPU) on every process here; an engine that shards may read it once and fill the others, or
        build it partitioned (in `regime`'s weights dtype: the reference's; train's policy is its Accelerator's)."""
        return read()

    def whole_models(self):
        """A context in which models are built whole on this process, by it alone (--merge's base model, on the
        main process while the others wait), where the engine would otherwise build them partitioned."""
        from contextlib import nullcontext

        return nullcontext()

    def weights_hash(self, model: torch.nn.Module, main: bool) -> str | None:
        """`files.model_weights_hash` of `model` as loaded, on the main process (`main`), None on the others. Every
        process must call this (a partitioned model is gathered a tensor at a time)."""
        from kto_pipeline.files import model_weights_hash

        return model_weights_hash(sorted(model.state_dict().items())) if main else None

    def prepare_policy(
        self, scorer: torch.nn.Module, model, make_optimizer: Callable, loader=None, move: bool = True
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        """(scorer, optimizer, loader) ready to train: `scorer` wraps `model` (its forward is what the step calls),
        `make_optimizer(model)` builds the optimizer over the parameters as this engine leaves them. `move=False`
        keeps the model where it is (the memory simulation's fake tensors).

        Where the layers replay CUDA graphs and a step accumulates micro-batches, every gradient is allocated here
        and zeroed in place after each step (`gradients_in_place`): a layer's backward graph returns its gradients
        in the graphs' own memory, which the next micro-batch's replay overwrites, so autograd must add them into
        buffers of its own rather than keep the first as the gradient. (The gradients then stay allocated between
        steps, through the next forward.)"""
        from kto_pipeline.runtime.compiled import replays_cuda_graphs

        optimizer = make_optimizer(model)
        accumulates = self.accelerator.gradient_accumulation_steps > 1
        self.gradients_in_place = accumulates and replays_cuda_graphs(model)
        placement = None if move else [False, False]
        if loader is None:
            prepared = (*self.accelerator.prepare(scorer, optimizer, device_placement=placement), None)
        else:
            placement = None if move else [False, False, False]
            prepared = self.accelerator.prepare(scorer, optimizer, loader, device_placement=placement)
        if self.gradients_in_place:
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.grad = torch.zeros_like(parameter)
        return prepared

    def prepare_scorer(self, scorer: torch.nn.Module, model, regime: Regime, device: torch.device) -> torch.nn.Module:
        """`scorer` (wrapping the frozen `model`) on `device`, ready to score under `regime`."""
        self.device = device
        scorer.to(device)
        autocast_forward(scorer, regime)
        return scorer

    def agree_on_forwards(self, count: int) -> int:
        """How many forwards this process runs when it has `count` to run (all processes call this together where
        `collective_forwards`: the most any process has)."""
        return count

    # ------------------------------------------------------------------ the step

    def gradient_sync(self, module: torch.nn.Module, sync: bool):
        """The context of one micro-step's forward and backward: `sync` is False on the micro-steps before an
        optimizer step (--gradient-accumulation-steps), whose gradients stay on their process and add up, so that
        the processes exchange gradients once per optimizer step. Here nothing: accelerate's `accumulate` already
        runs DDP's micro-steps under `no_sync`."""
        from contextlib import nullcontext

        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, module: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients to `max_norm`; returns their norm before clipping (over every process)."""
        return self.accelerator.clip_grad_norm_(module.parameters(), max_norm)

    def step(self, optimizer) -> None:
        optimizer.step()
        if self.gradients_in_place:
            optimizer.zero_grad(set_to_none=False)
        else:
            optimizer.zero_grad()

    # ------------------------------------------------------------------ state

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The scorer as the stage built it (without DDP's or DeepSpeed's wrapper)."""
        return self.accelerator.unwrap_model(module)

    def full_state_dict(self, module: torch.nn.Module) -> dict:
        """The whole model's weights on the main process (others: what they hold). Every process must call this."""
        return self.accelerator.get_state_dict(module)

    def save_state(self, module: torch.nn.Module, optimizer, directory: Path) -> None:
        """Write what resuming needs besides the HF files (optimizer, scheduler, RNG; with `state_holds_weights`
        the weights too) into a checkpoint `directory`. Every process must call this."""
        self.accelerator.save_state(str(directory / ACCELERATE_STATE))

    def load_state(self, module: torch.nn.Module, optimizer, directory: Path) -> None:
        """Restore what `save_state` wrote. Every process must call this."""
        self.accelerator.load_state(str(directory / ACCELERATE_STATE))

    # ------------------------------------------------------------------ records

    def record(self) -> dict[str, Any]:
        """What manifest.json and trainer_state.json record under "distributed"."""
        return {"engine": self.name, "world_size": self.world_size}

    def close(self, module: torch.nn.Module) -> None:
        """Once a stage is done with `module`: let go of what the engine holds for it."""

    def __str__(self) -> str:
        return "one process"
