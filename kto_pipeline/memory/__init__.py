"""Peak accelerator memory of one training step, simulated on a machine without an accelerator.

`kto-pipeline estimate-memory` answers "does this fit on my GPU?" in seconds, for a model of which only the
config is known (no weights are read). It runs one real training step of the model's architecture, in which
only the shapes exist.

    simulation.py  the fake tensors, the memory trackers, the model and the rows the step runs on
    step.py        our step: the policy as `train` prepares it (`stages/train/policy.py`) and its engine
                   (`runtime/engines`); the floor; the check against a real CPU step
    trl_step.py    trl.KTOTrainer's step, modelled (`--against-trl`)
    estimate.py    the command: the estimate and its table

- the model is built on the meta device and materialized as fake tensors (`FakeTensorMode`): every parameter,
  activation, gradient and optimizer state has its real shape and dtype, and none takes memory;
- the step runs outside the fake mode, through the code `train` runs (the loss family's collator ->
  `stages/train/step.py`: `PolicyScorer` -> its forward, the engine's backward, clipping and step, fused AdamW;
  FSDP2 through the same engine). An op that touches a fake tensor runs under the fake mode; an op on real tensors
  runs for real. So the data-dependent host work (the packed layout, the masks' indices, `nonzero`) is computed from
  real token lists, and the model's math on fake tensors: the shapes are those of the real step;
- torch's memory tracker (`torch.distributed._tools.MemTracker`, `FSDPMemTracker` on a fake process group
  for FSDP2) counts every storage alive at each op, by category (parameters, gradients, optimizer state,
  activations, temporaries), and keeps the peak.

The CPU stands in for the accelerator (fake CUDA tensors need a CUDA build of torch): dtypes and shapes are
the GPU's, and the code's device decisions are the GPU's (attention on the dense mask, never tree by tree).
What is not simulated: the CUDA caching allocator's rounding and fragmentation (reserved > allocated), the
CUDA context, cuBLAS/NCCL workspaces and kernels' internal scratch. The tracker counts allocated tensors,
what `torch.cuda.max_memory_allocated` reports.

With `--against-trl` it also simulates trl.KTOTrainer's step (online: a reference model beside the policy)
on the same rows. This package does not import trl, so that step is modelled here, after trl 1.16's
`KTOTrainer._compute_loss` and its fused LM head (`trl/trainer/utils.py:add_fused_lm_head`,
`trl/kernels/chunked_logprob.py`); benchmarks/bench_memory.py and tests/test_estimate_memory.py hold the
model to the real trl run under the same simulation.
"""

from kto_pipeline.memory.estimate import describe, estimate, run
from kto_pipeline.memory.simulation import (
    CATEGORIES,
    StepMemory,
    StepSettings,
    build_model,
    fake_mode,
    load_model_config,
    memory_tracker,
    synthetic_rows,
)
from kto_pipeline.memory.step import cpu_check, floor_bytes, measure_cpu_step, simulate_ours
from kto_pipeline.memory.trl_step import addmm_fp32, simulate_trl

__all__ = [
    "CATEGORIES",
    "StepMemory",
    "StepSettings",
    "addmm_fp32",
    "build_model",
    "cpu_check",
    "describe",
    "estimate",
    "fake_mode",
    "floor_bytes",
    "load_model_config",
    "measure_cpu_step",
    "run",
    "simulate_ours",
    "simulate_trl",
    "synthetic_rows",
    "memory_tracker",
]
