"""How a process scores its model: decided once, after the model is loaded, and carried down.

Both stages load a model, then decide the same things about it: whether its
sequences can run packed (`packable.py`), which attention kernel packed rows run (`attention.choose_kernel`),
whether its products compute a row alike in every layout (`products.rows_alike`, `experts_rows_alike`), whether
its layers are compiled (`runtime.compiled`) and whether its packed layouts take static shapes. `plan_scoring`
makes those decisions in that order and returns them as one frozen `Plan`; the scorers (`ReferenceScorer`,
`PolicyScorer`) take its `attention`, and no forward chooses again (estimate-memory's simulated step takes the
kernel its simulated device would run, `memory.simulation.step_attention`). Here, in the scoring wing, because the
plan decides what the scoring runs; the launch's part (device, engine, precision regime) comes from `runtime`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kto_pipeline.runtime.compiled import CompileStats, compile_layers
from kto_pipeline.runtime.engines import Engine
from kto_pipeline.runtime.experts import experts_rows_alike
from kto_pipeline.runtime.precision import Regime
from kto_pipeline.scoring.attention import attention_costs, choose_kernel
from kto_pipeline.scoring.packable import packing_unsupported
from kto_pipeline.scoring.packing import AttentionCosts
from kto_pipeline.scoring.products import rows_alike


@dataclass(frozen=True)
class Plan:
    """What one process of a run runs its model with."""

    device: torch.device
    engine: Engine  # how the model is spread over the processes (`runtime.engines`)
    regime: Regime  # its precision: the weights' dtype and autocast
    padded_because: str | None  # why its sequences run padded, one a row; None: packed
    attention: AttentionCosts  # how its packed rows attend (the kernel) and what that costs them
    kernel_note: str | None  # why the kernel is not the one asked for; None: it is
    compiled: CompileStats | None  # its compiled layers' counters; None: the layers run eagerly

    @property
    def kernel(self) -> str | None:
        """The attention kernel its packed rows run; None where its sequences run padded."""
        return self.attention.kernel if self.padded_because is None else None

    def padded(self, why: str) -> Plan:
        """This plan with its sequences run padded, for `why` (the reference pass's packing check)."""
        return dataclasses.replace(self, padded_because=why)


def plan_scoring(
    model,
    config,
    device,
    engine: Engine,
    regime: Regime,
    say: Callable[[str], None],
    padded_because: str | None = None,
    compile_by_default=(),
    wrap_layer=None,
) -> Plan:
    """Decide how `model` is scored on `device` under `config` (its `attention_kernel`, `torch_compile`,
    `torch_compile_mode`, `static_shapes`), and make it so: its products and experts computing each row alike, its
    layers compiled where asked (`compile_layers`, which says what it did through `say`; `compile_by_default`: the
    device types compiled when --torch-compile is unset; `wrap_layer`: each layer's call wrapped). The kernel is
    chosen for the model's mode (training or not), as its forwards run. `padded_because`: a reason the caller already
    has to run padded (a cache whose packed layout leaked); the model's own comes first."""
    device = torch.device(device)
    padded_because = packing_unsupported(model) or padded_because
    kernel, kernel_note = choose_kernel(model, config.attention_kernel, device)
    rows_alike(model, regime, device)  # each row of a product computes alike in both stages
    experts_rows_alike(model)  # a token's experts compute it alike in both stages
    compiled = compile_layers(model, config, device, engine, say, compile_by_default, wrap_layer)
    static = compiled.static_layouts if compiled else config.static_shapes
    attention = attention_costs(model, kernel, static)
    return Plan(device, engine, regime, padded_because, attention, kernel_note, compiled)
