"""Our step's memory: the step `train_step` runs (forward, backward, clipping, AdamW), on the policy as `train`
prepares it (`stages/train/policy.py`) and through the engine train would run (`runtime/engines`); the floor
(what any step must hold); and the check of the simulation against a real CPU step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.memory.simulation import (
    StepMemory,
    StepSettings,
    breakdown,
    build_model,
    cpu_accelerator,
    fake_mode,
    fake_process_group,
    init_optimizer_state,
    memory_tracker,
    offload_unpinned,
    pad_token_id,
    step_attention,
)

# ------------------------------------------------------------------------------------------ our step


def simulate_ours(
    model_config,
    rows: list[dict[str, Any]],
    settings: StepSettings,
    fake=True,
    attribute: bool = False,
    loss_type: str = "kto",
) -> StepMemory:
    """Peak memory of one `train` step on `rows`: the step `train_step` runs (forward, backward, clipping,
    AdamW), on fake tensors (`fake=True`) or real ones (`fake=False`, the CPU check). `attribute`: also list
    the largest tensors alive at the peak (runs the step twice). With a pair loss (`loss_type`), each row is a
    pair: its prompt, its completion as the chosen answer and its KL completion as the rejected one."""
    if settings.fsdp_world_size > 1:
        with fake_process_group(settings.fsdp_world_size):
            return _simulate_ours(model_config, rows, settings, fake, attribute, loss_type)
    return _simulate_ours(model_config, rows, settings, fake, attribute, loss_type)


def _simulate_ours(model_config, rows, settings: StepSettings, fake: bool, attribute: bool, loss_type) -> StepMemory:
    first = _run_ours(model_config, rows, settings, fake, None, loss_type)
    if not attribute:
        return first
    second = _run_ours(model_config, rows, settings, fake, first.peak_bytes, loss_type)
    assert second.peak_bytes == first.peak_bytes, "the simulated step is deterministic"
    return second


def step_engine(settings: StepSettings):
    """The engine train runs the simulated step with, made from the settings rather than from a launcher's
    environment: FSDP2 over `fsdp_world_size` processes (with or without CPU offload, the rest at the defaults
    `accelerate launch` gives an FSDP2 config), else one process."""
    from kto_pipeline.runtime.engines.fsdp2 import FSDP2
    from kto_pipeline.runtime.engines.single import Single

    if settings.fsdp_world_size > 1:
        return FSDP2(settings.fsdp_world_size, offload_params=settings.cpu_offload)
    return Single(1)


def _run_ours(
    model_config, rows, settings: StepSettings, fake: bool, attribute_at: int | None, loss_type: str = "kto"
) -> StepMemory:
    import torch

    from kto_pipeline.config import TrainConfig
    from kto_pipeline.objectives import objective_for
    from kto_pipeline.runtime.precision import policy_regime
    from kto_pipeline.scoring.packable import packing_unsupported
    from kto_pipeline.stages.train.step import PolicyScorer, forward, update

    mode = fake_mode() if fake else None
    batch_size = max(len(rows), 2)
    smoothing = 1e-3 if "exo_pair" in loss_type.split("+") else 0.0  # (exo_pair needs one; memory does not)
    config = TrainConfig(
        cache="-",
        output_dir="-",
        bf16=settings.bf16,
        per_device_train_batch_size=batch_size,
        loss_type=loss_type,
        label_smoothing=smoothing,
    )
    objective = objective_for(loss_type)
    sharded = settings.fsdp_world_size > 1
    model = build_model(model_config, settings, mode)
    if (why := packing_unsupported(model)) is not None:  # (train would pad its batches: not simulated here)
        raise KTOPipelineError(
            f"--model: {type(model).__name__} trains padded, a sequence a row ({why}); the memory simulation "
            "runs packed batches only"
        )
    costs = step_attention(model, settings.device_type)  # as the step would run on that device
    # as train.setup: the engine prepares the policy (sharded, the optimizer over the shards) and steps it
    engine = step_engine(settings)
    engine.make_accelerator(policy_regime(config.bf16), config.max_grad_norm, config.ddp_timeout, cpu=True)
    with offload_unpinned():
        scorer, optimizer, _ = engine.prepare_policy(
            PolicyScorer(model, costs), model, lambda m: _make_optimizer(settings, config, m), move=False
        )
    init_optimizer_state(model, optimizer, mode)
    pad_id = pad_token_id(model_config)
    loss_settings = objective.settings(config)
    batch = objective.collator(pad_id, True, costs, loss_settings)(objective.items_from_rows(rows))
    tracker = memory_tracker(scorer if sharded else None, optimizer, settings.cpu_offload, attribute_at)
    if not sharded:
        tracker.track_external(model, optimizer)
    with tracker:
        before = tracker._device_total(tracker.get_tracker_snapshot()[torch.device("cpu")])
        # train's step (`stages/train/step.py`): its forward (no load-balancing loss asked), backward, clipping
        # and optimizer step
        out = forward(objective, engine.accelerator, scorer, batch, loss_settings, aux_coef=0.0)
        tokens_with_grad, tokens_executed = _layout_tokens(batch), out.scored.tokens_executed
        kl_forward = objective.kl_forward(loss_settings, out.scored.kl_on_cached_prompt)
        loss = out.loss
        del out
        update(engine, scorer, optimizer, loss, config.max_grad_norm)
        del loss
    dev = torch.device("cpu")
    return StepMemory(
        peak_bytes=tracker._peak_mem[dev],
        breakdown=breakdown(tracker._peak_mem_snap[dev], settings.cpu_offload),
        before_step_bytes=before,
        tokens_with_grad=tokens_with_grad,
        tokens_executed=tokens_executed,
        top=tracker.top or [],
        kl_forward=kl_forward,
    )


def _make_optimizer(settings: StepSettings, config, model):
    """train's optimizer (fused AdamW), or bitsandbytes' AdamW8bit over the same parameter groups (built outside
    the fake mode: its quantization map is a real table; its moments are made from the fake parameters)."""
    from kto_pipeline.stages.train.policy import make_optimizer

    if settings.optimizer == "adamw":
        return make_optimizer(config, model)
    import bitsandbytes as bnb

    groups = make_optimizer(config, model).param_groups
    return bnb.optim.AdamW8bit(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups], lr=config.learning_rate
    )


def _layout_tokens(batch) -> int:
    """Tokens of the forward with gradients: the layout's columns before the split, padding included."""
    from kto_pipeline.objectives.items import batch_layout

    layout = batch_layout(batch)
    return int(layout.input_ids.shape[0] * layout.split)


# ------------------------------------------------------------------------------------------ the floor


def floor_bytes(model_config, settings: StepSettings, tokens: int, fake: bool = True) -> dict[str, int]:
    """What any trainer of this model must hold at its peak: the trained weights' float32 copies, their
    gradients and AdamW's two moments (16 bytes a trained parameter; LoRA: the frozen base's 4 bytes a parameter
    plus 16 a trained one; FSDP2: a 1/world share of each), plus the activations a backward needs for `tokens`
    tokens with gradients.

    The activations are measured, not modelled: the bare backbone's forward (causal, one unpadded sequence, no
    LM head), with the step's autocast and checkpointing, on 256 and on 512 tokens. What it keeps grows by a
    per-token slope; what it keeps whatever the length (autocast's bf16 copies of the weights, which the backward
    reads) is the intercept. The floor takes intercept + slope x `tokens`."""
    import torch

    from kto_pipeline.models import backbone_of

    mode = fake_mode() if fake else None
    model = build_model(model_config, dataclasses.replace(settings, fsdp_world_size=1), mode)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    world = settings.fsdp_world_size
    kept = {}
    for n in (256, 512):
        tracker = memory_tracker()
        tracker.track_external(model)
        with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            out = backbone_of(model)(input_ids=torch.zeros((1, n), dtype=torch.long), use_cache=False)
            kept[n] = breakdown(tracker.get_tracker_snapshot()[torch.device("cpu")], False)["activations"]
        del out
    slope = (kept[512] - kept[256]) / 256
    intercept = kept[256] - slope * 256
    return {
        "parameters": (trained + frozen) * 4 // world,
        "gradients": trained * 4 // world,
        "optimizer": trained * 8 // world,
        "activations": int(intercept / world + slope * tokens),
    }


# ------------------------------------------------------------------------------------------ the real CPU check


def measure_cpu_step(spec: dict[str, Any]) -> dict[str, int]:
    """One real `train` step on the CPU (float32, real seeded weights), in this process: the resident set's high
    water mark over the step, as the check of the simulation (run it in a fresh process started with
    MALLOC_MMAP_THRESHOLD_=65536, see `cpu_check`). `spec`: {"config": model config dict, "rows": rows}.

    Returns {"rss_before": resident bytes after the model and the optimizer's moments exist,
    "rss_peak": the high water mark during the step (the kernel's VmHWM, reset just before it),
    "baseline": resident bytes before the model was built}."""
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(1)  # per-thread scratch of the CPU kernels would blur the comparison
    config_dict = dict(spec["config"])
    model_config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    settings = StepSettings(bf16=False, device_type="cpu")
    # everything the step imports, before the baseline: the model's class (built on the meta device: no
    # memory), accelerate's state, the stages
    import kto_pipeline.stages.train.stage  # noqa: F401

    with torch.device("meta"):
        build_model(model_config, settings, None)
    cpu_accelerator("no")
    baseline = _rss("VmRSS")
    out = _run_real(model_config, spec["rows"], settings)
    out["baseline"] = baseline
    return out


def _run_real(model_config, rows, settings: StepSettings) -> dict[str, int]:
    import gc

    from kto_pipeline.config import TrainConfig
    from kto_pipeline.objectives import objective_for
    from kto_pipeline.runtime.precision import policy_regime
    from kto_pipeline.stages.train.policy import make_optimizer
    from kto_pipeline.stages.train.step import PolicyScorer, forward, update

    config = TrainConfig(cache="-", output_dir="-", bf16=False, per_device_train_batch_size=max(len(rows), 2))
    model = build_model(model_config, settings, None)
    objective = objective_for(config.loss_type)
    engine = step_engine(settings)
    engine.make_accelerator(policy_regime(False), config.max_grad_norm, config.ddp_timeout, cpu=True)
    costs = step_attention(model, "cpu")
    scorer, optimizer, _ = engine.prepare_policy(
        PolicyScorer(model, costs), model, lambda m: make_optimizer(config, m), move=False
    )
    init_optimizer_state(model, optimizer, None)
    loss_settings = objective.settings(config)
    batch = objective.collator(pad_token_id(model_config), True, costs, loss_settings)(objective.items_from_rows(rows))
    gc.collect()
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset the high water mark (Linux >= 4.0)
        f.write("5")
    loss = forward(objective, engine.accelerator, scorer, batch, loss_settings, aux_coef=0.0).loss  # train's step
    update(engine, scorer, optimizer, loss, config.max_grad_norm)
    del loss
    return {"rss_before": before, "rss_peak": _rss("VmHWM")}


def _rss(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def cpu_check(model_config, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The simulation against a real CPU step of the same model (float32, attention as the CPU runs it) and rows.

    Real: `measure_cpu_step` in a fresh process, glibc told to map every allocation above 64 KiB on its own
    (MALLOC_MMAP_THRESHOLD_), so that a freed tensor leaves the resident set at once and the high water mark is
    the step's live tensors plus the process's own pages. Compared: what the step adds to what was resident
    before it (gradients, activations, temporaries: the part the simulation has to get right; parameters and
    moments are counted, not simulated), and the whole peak above the process's baseline (before the model).
    Simulated: the same step on fake tensors (`simulate_ours`, device_type "cpu") and on real tensors under the
    same tracker (the tracker's accounting of real allocations)."""
    import subprocess

    settings = StepSettings(bf16=False, device_type="cpu")
    spec = {"config": model_config.to_dict(), "rows": rows}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "kto_pipeline.memory", "measure-cpu-step"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the real CPU step failed:\n{proc.stderr[-3000:]}")
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    fake = simulate_ours(model_config, rows, settings, fake=True)
    tracked_real = simulate_ours(model_config, rows, settings, fake=False)
    return {
        "real_step_bytes": real["rss_peak"] - real["rss_before"],
        "real_total_bytes": real["rss_peak"] - real["baseline"],
        "simulated_step_bytes": fake.peak_bytes - fake.before_step_bytes,
        "simulated_total_bytes": fake.peak_bytes,
        "tracked_real_step_bytes": tracked_real.peak_bytes - tracked_real.before_step_bytes,
        "tracked_real_total_bytes": tracked_real.peak_bytes,
    }
