"""Stage 2: train the policy alone against a reference cache.

`train()` is the outline, one phase a function around one `Run`:

    setup -> resume -> prepare the output directory -> fit -> finish

`setup` opens and checks the cache, loads the policy (never a reference model), builds the data loaders over
the memory-mapped cache (`data.py`; the items' order: `batches.py`), the optimizer and the schedule. `resume`
restores a checkpoint, `fit` is the loop, `finish` writes the final model, its card and trainer state (`rundir/`;
--push-to-hub: `rundir/hub.py`). The policy is loaded and its optimizer built by `policy.py`; a micro-batch's forward
and the update run in `step.py` (as estimate-memory simulates them); how the policy is spread over the processes,
its backward, clipping and step are asked of the engine (`runtime/engines`), which this stage never names.
accelerate is used as a library (`accumulate`, `gather`), so the loop is the whole algorithm: nothing happens in
callbacks. What depends on the loss family (its cache, items, forward pass, metrics and evaluation) is asked of the
run's objective (`kto_pipeline/objectives`), chosen once in `setup`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from kto_pipeline import __version__
from kto_pipeline.cache import Manifest
from kto_pipeline.config import TrainConfig
from kto_pipeline.errors import Interrupted, KTOPipelineError, Preempted, check_option
from kto_pipeline.lock import main_process_lock
from kto_pipeline.model_card import write_model_card
from kto_pipeline.objectives import Objective, objective_for
from kto_pipeline.objectives.items import real_rows
from kto_pipeline.quantization import INT8_STEP_ONE, quantized_run, train_quantization
from kto_pipeline.rundir import (
    InitPoint,
    MetricLog,
    MetricsWriter,
    TrainerState,
    finished_at,
    start_run,
)
from kto_pipeline.rundir.checkpoint import (
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    save_merged,
    save_model,
    skip_model_weights_in_accelerate_state,
)
from kto_pipeline.rundir.hub import push_run
from kto_pipeline.runtime.compiled import TRAIN_COMPILES_ON
from kto_pipeline.runtime.engines import engine_for
from kto_pipeline.runtime.launch import print0, process_state, shows_progress
from kto_pipeline.runtime.peak_memory import PeakMemory, describe
from kto_pipeline.runtime.precision import Regime, check_regime, policy_regime
from kto_pipeline.runtime.preemption import StopRequests, continue_command
from kto_pipeline.scoring.keys_values import keeping_keys_values
from kto_pipeline.scoring.packable import packing_leaked
from kto_pipeline.scoring.plan import Plan, plan_scoring
from kto_pipeline.scoring.products import StepCasts
from kto_pipeline.stages.train.batches import EpochSampler
from kto_pipeline.stages.train.checks import (
    check_output_dir,
    check_resume_compatible,
    policy_start_note,
    resume_changes_note,
)
from kto_pipeline.stages.train.data import loaders, open_checked_cache
from kto_pipeline.stages.train.policy import init_point, load_base, load_policy, make_optimizer
from kto_pipeline.stages.train.schedules import schedule
from kto_pipeline.stages.train.step import PolicyScorer, forward, update


@dataclass
class Progress:
    """Where the run stands, and what this process has done in it."""

    global_step: int = 0
    epoch: int = 0  # the epoch being trained
    skip_batches: int = 0  # batches of `epoch` a resumed run skips (trained before the checkpoint)
    epoch_index: int = 0  # after the last step: the epoch the next batch belongs to
    batches_in_epoch: int = 0  # after the last step: batches of that epoch trained
    fractional_epoch: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    log: MetricLog = field(default_factory=MetricLog)
    grad_norm: torch.Tensor | float | None = None  # the last optimizer step's, before clipping (as the engine gives it)
    step_seconds: list[float] = field(default_factory=list)  # wall time of each optimizer step of this run
    started: float = 0.0
    step_started: float = 0.0
    # work counters of this run, this process: tokens the forwards ran vs the tokens the rows need (P + C + K)
    tokens_executed: int = 0
    tokens_needed: int = 0
    items_seen: int = 0  # rows, or pairs (the objective's unit)
    kl_on_cached_prompt: bool = False


@dataclass
class Run:
    """Everything the phases share."""

    config: TrainConfig
    objective: Objective  # the loss family: what it needs of the cache, its items, forward, metrics, evaluation
    loss: Any  # the family's settings of this run (`objective.settings`): what its forward and evaluation read
    out: Path
    resume_dir: Path | None
    accelerator: Any
    plan: Plan  # how this process runs the policy: device, engine, precision, packed or padded, kernel, compiled
    manifest: Manifest
    init: InitPoint | None  # --init-from: the previous round's policy this run started from
    tokenizer: Any
    scorer: PolicyScorer  # DDP-wrapped by accelerate, or the FSDP2 root
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: EpochSampler
    loader: DataLoader
    eval_loader: DataLoader | None
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    aux_coef: float  # MoE load-balancing weight (0: not a MoE model)
    trackers: list[str]
    peaks: PeakMemory  # each process's peak memory, sampled from the start
    progress: Progress = field(default_factory=Progress)
    metrics: MetricsWriter | None = None


@dataclass
class TrainResult:
    output_dir: Path
    global_step: int
    metrics: list[dict[str, float]]
    step_seconds: list[float]  # wall time of each optimizer step of this run (benchmarks, profiling)


def train(config: TrainConfig) -> TrainResult:
    """Train a policy on a reference cache; writes metrics, checkpoints and the final model to `output_dir`.

    The output directory's lock is taken before any work starts and held until the run ends: a second `train`
    into the same directory refuses at once, naming this one. Only the main process holds it."""
    process_state(config.ddp_timeout)  # the process group first: the lock's broadcast runs in it
    with main_process_lock(config.output_dir, "train", label="--output-dir"), PeakMemory() as peaks:
        run = setup(config, peaks)
        done = resume(run)
        if done is not None:
            return done
        prepare_output_dir(run)
        fit(run)
        return finish(run)


# ------------------------------------------------------------------------------------------- setup


def setup(config: TrainConfig, peaks: PeakMemory) -> Run:
    """Check the inputs, then load the policy and build the loaders, optimizer and schedule. Nothing is written."""
    out = Path(config.output_dir)
    resume_dir = resolve_resume(out, config.resume, config.resume_from, config.autoresume)
    if resume_dir is None or resume_dir.parent.resolve() != out.resolve():
        check_output_dir(out, config)  # a checkpoint of this same dir may continue it
    objective = objective_for(config.loss_type)
    loss = objective.settings(config)  # the family's settings, typed, made once
    cache, max_length = open_checked_cache(config, objective)
    trackers = _trackers(config)
    regime = policy_regime(config.bf16, config.fp16)  # the policy loads in float32
    engine = engine_for(process_state(config.ddp_timeout).num_processes)  # (the state `train` set up)
    quantization = train_quantization(config, cache.manifest.reference.get("quantization"))
    if quantization is not None:  # the cache's quantized base under LoRA adapters, its other weights in its dtype
        config = quantized_run(config, quantization, engine)
        regime = dataclasses.replace(regime, weights=cache.manifest.precision[0])
    check_option(not config.merge or config.lora_r is not None, "merge", "only applies with --lora-r")
    accelerator = engine.make_accelerator(
        regime,
        config.max_grad_norm,
        config.ddp_timeout,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        log_with=trackers or None,
        project_dir=str(out / "tensorboard"),
    )
    skip_model_weights_in_accelerate_state(accelerator)
    if engine.activation_checkpointing and not config.gradient_checkpointing:  # the launch config asks for it
        config = dataclasses.replace(config, gradient_checkpointing=True)
    set_seed(config.seed)
    print0(accelerator, f"kto-pipeline train {__version__}\n{config.describe()}")
    warning = check_regime(Regime(*cache.manifest.precision), regime, config.strict)
    if warning:
        print0(accelerator, warning)
    quantized = f", its base's linear layers {quantization} (LoRA r {config.lora_r})" if quantization else ""
    print0(accelerator, f"policy: {regime}{quantized}, {engine}")
    if quantization is not None and quantization.bits == 8:
        print0(accelerator, INT8_STEP_ONE)
    init = init_point(config, cache.manifest, accelerator)
    if note := policy_start_note(config, cache.manifest):
        print0(accelerator, note)
    tokenizer, model, aux_coef = load_policy(config, cache.manifest, init, engine, quantization)
    say = functools.partial(print0, accelerator)
    plan = plan_scoring(  # (the model in training mode, as its steps will run)
        model.train(),
        config,
        accelerator.device,
        engine,
        regime,
        say,
        padded_because=packing_leaked(cache.manifest),
        compile_by_default=TRAIN_COMPILES_ON,
        wrap_layer=keeping_keys_values,  # the prompts' keys/values kept for the KL forward
    )
    if plan.kernel is not None:
        say(f"attention: {plan.kernel}" + (f" ({plan.kernel_note})" if plan.kernel_note else ""))
    sampler, loader, eval_loader = loaders(config, objective, loss, cache, max_length, accelerator, tokenizer, plan)
    scorer, optimizer, loader = engine.prepare_policy(
        PolicyScorer(model, plan.attention), model, lambda m: make_optimizer(config, m), loader
    )
    peaks.loaded()  # the policy read, then sharded or partitioned, with what its engine allocates up front
    if eval_loader is not None:
        eval_loader = accelerator.prepare_data_loader(eval_loader)
    steps_per_epoch = max(math.ceil(len(loader) / config.gradient_accumulation_steps), 1)
    total_steps = _planned_steps(config.max_steps, config.num_train_epochs, steps_per_epoch)
    warmup_steps = math.ceil(config.warmup_ratio * total_steps)
    scheduler = schedule(config.lr_scheduler_type, optimizer, warmup_steps, total_steps)
    accelerator.register_for_checkpointing(scheduler)  # stepped by hand once per optimizer step, saved with its state
    return Run(
        config=config,
        objective=objective,
        loss=loss,
        out=out,
        resume_dir=resume_dir,
        accelerator=accelerator,
        plan=plan,
        manifest=cache.manifest,
        init=init,
        tokenizer=tokenizer,
        scorer=scorer,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        loader=loader,
        eval_loader=eval_loader,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        aux_coef=aux_coef,
        trackers=trackers,
        peaks=peaks,
    )


# ------------------------------------------------------------------------------------------ resume


def resume(run: Run) -> TrainResult | None:
    """Restore a checkpoint (weights, optimizer, scheduler, RNG, data position, metrics), if resuming. Returns the
    result of a finished run that has nothing left to do; None to train on."""
    if run.resume_dir is None:
        return None
    config, p, resume_dir = run.config, run.progress, run.resume_dir
    state = load_checkpoint(run.plan.engine, run.scorer, run.optimizer, resume_dir)
    check_resume_compatible(state, config, resume_dir, run.manifest)
    if note := resume_changes_note(state, config):
        print0(run.accelerator, note)
    p.global_step, p.epoch, p.skip_batches = state.global_step, state.epoch_index, state.batches_in_epoch
    p.epoch_index, p.batches_in_epoch = state.epoch_index, state.batches_in_epoch
    p.fractional_epoch, p.history = state.epoch, state.log_history
    p.log.values.update(state.pending_metrics)
    if p.global_step > run.total_steps:
        raise KTOPipelineError(
            f"cannot resume from {resume_dir}: it is at step {p.global_step}, past this run's {run.total_steps} "
            "steps. Raise --max-steps (or --num-train-epochs), or pick an earlier checkpoint with --resume-from."
        )
    same_dir = resume_dir.parent.resolve() == run.out.resolve()
    if p.global_step == run.total_steps and same_dir and finished_at(run.out) == run.total_steps:
        print0(
            run.accelerator,
            f"nothing to do: {run.out} already finished its {run.total_steps} steps ({resume_dir.name} is its last "
            "checkpoint). To train on, raise --max-steps (or --num-train-epochs) and --resume again.",
        )
        return TrainResult(output_dir=run.out, global_step=p.global_step, metrics=p.history, step_seconds=[])
    print0(run.accelerator, f"resuming from {resume_dir} at step {p.global_step}")
    saved = state.run_config or {}
    was_total = state.max_steps or _planned_steps(
        saved.get("max_steps", -1), saved.get("num_train_epochs", 1.0), run.steps_per_epoch
    )
    if was_total != run.total_steps and p.global_step < run.total_steps:
        # The optimizer's saved rate came from the old total's schedule (0 at the end of a linear decay):
        # recompute this step's rate on the new schedule, as a run planned with the new total would have it.
        was_rate = run.optimizer.param_groups[0]["lr"]
        run.scheduler.last_epoch -= 1
        run.scheduler.step()
        print0(
            run.accelerator,
            f"note: the run now has {run.total_steps} steps (its checkpoint's run had {was_total}): the "
            f"{config.lr_scheduler_type} learning-rate schedule{' and its warmup' if run.warmup_steps else ''} "
            f"now spans {run.total_steps} steps, so step {p.global_step + 1} trains at "
            f"{run.scheduler.get_last_lr()[0]:.3g} (the old schedule's next rate: {was_rate:.3g}).",
        )
    return None


# ------------------------------------------------------------------------------------------- output


def prepare_output_dir(run: Run) -> None:
    """Create the run directory once every check has passed: the run config and the metrics so far; no finished
    mark until the run ends (a resumed or extended run included)."""
    if run.accelerator.is_main_process:
        if run.resume_dir is None:  # a fresh run in a reused dir: stale checkpoints must not mix with its own
            for stale in [*run.out.glob("checkpoint-*"), *run.out.glob(".checkpoint-*.tmp")]:
                shutil.rmtree(stale)
        start_run(run.out, run.config.to_dict(), run.progress.history)
    if run.trackers:
        hparams = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in run.config.to_dict().items()}
        named = {"wandb": {"name": run.config.run_name}} if run.config.run_name else {}  # (trl's run_name)
        run.accelerator.init_trackers("kto-pipeline", config=hparams, init_kwargs=named)
    run.metrics = MetricsWriter(run.out, run.accelerator, run.progress.history, bool(run.trackers))


# ---------------------------------------------------------------------------------------------- fit


def fit(run: Run) -> None:
    """The loop: micro-batches accumulate into optimizer steps until the run's last step. A stop request (SIGTERM,
    SIGUSR1: a scheduler preempting the run; Ctrl-C) is acted on at the next step boundary, all processes together."""
    accelerator, p = run.accelerator, run.progress
    steps, shown = dict(total=run.total_steps, initial=p.global_step), shows_progress(accelerator)
    bar = tqdm(**steps, desc="train", unit="step", disable=not shown)
    p.started = p.step_started = time.perf_counter()
    run.scorer.train()
    with (
        StopRequests(interactive=True) as stop,
        StepCasts(run.scorer, run.plan.regime, run.plan.engine, run.config) as casts,
    ):
        while p.global_step < run.total_steps:
            run.sampler.use_epoch(p.epoch)
            batches = accelerator.skip_first_batches(run.loader, p.skip_batches) if p.skip_batches else run.loader
            if hasattr(batches, "_non_blocking"):  # (which accelerate's skip_first_batches drops: accelerate#4295)
                batches._non_blocking = accelerator.non_blocking
            for micro_step, batch in enumerate(batches, start=p.skip_batches):
                casts.open()
                with accelerator.accumulate(run.scorer):  # decides whether this micro-step ends an optimizer step
                    with run.plan.engine.gradient_sync(run.scorer, accelerator.sync_gradients):
                        train_step(run, batch, casts, last_batch=micro_step + 1 == len(run.loader))
                if not accelerator.sync_gradients:
                    continue
                after_step(run, micro_step, bar)
                if p.global_step >= run.total_steps:
                    break
                if signal_name := stop.agreed(accelerator.device):  # one small collective per step
                    bar.close()
                    stop_here(run, signal_name)
            p.skip_batches = 0
            p.epoch += 1
    bar.close()


def train_step(run: Run, batch: dict[str, torch.Tensor], casts: StepCasts, last_batch: bool = False) -> None:
    """Forward, metrics and backward of one micro-batch; the optimizer steps where accelerate syncs gradients.
    `last_batch`: the epoch's last, which may hold items repeated to even it out across processes."""
    config, accelerator, p, objective = run.config, run.accelerator, run.progress, run.objective
    real = real_rows(accelerator, config.per_device_train_batch_size, len(run.sampler), last_batch)
    out = forward(objective, accelerator, run.scorer, batch, run.loss, run.aux_coef, real)  # (step.py)
    scored = out.scored
    p.tokens_executed += scored.tokens_executed
    p.tokens_needed += batch["tokens_needed"]
    p.items_seen += len(out.ids)
    p.kl_on_cached_prompt = scored.kl_on_cached_prompt
    if scored.completions.aux_loss is not None:  # MoE: the load-balancing loss in the loss, logged apart too
        p.log.add("aux_loss", accelerator.gather(scored.completions.aux_loss.detach().reshape(1)).mean().item())
    metrics = objective.metrics(accelerator, out, real)  # one collective: the loss summed over every process
    # every process takes the same branch (the same gathered sum), or the others would wait forever in a collective
    if not math.isfinite(metrics["loss"]):
        ids = sorted(gather_object(out.ids.tolist()))
        raise KTOPipelineError(
            f"non-finite loss at step {p.global_step + 1}, batch example ids {objective.ids_are}{ids}. Lower "
            "--learning-rate or check these rows; the last checkpoint is intact."
        )
    for name, value in metrics.items():
        p.log.add(name, value)
    # the weights' casts of this step closed before the optimizer changes the weights; the norm read when logged
    grad_norm = update(run.plan.engine, run.scorer, run.optimizer, out.loss, config.max_grad_norm, casts.close)
    if grad_norm is not None:
        p.grad_norm = grad_norm


def after_step(run: Run, micro_step: int, bar) -> None:
    """The bookkeeping of an optimizer step: schedule, progress, logging, evaluation and checkpoints."""
    config, accelerator, p = run.config, run.accelerator, run.progress
    learning_rate = run.scheduler.get_last_lr()[0]  # the rate this step used (what trl logs)
    run.scheduler.step()
    p.global_step += 1
    now = time.perf_counter()
    p.step_seconds.append(now - p.step_started)
    p.step_started = now
    if run.plan.compiled is not None:
        run.plan.compiled.step_ended(p.global_step)  # (a benchmark's median leaves out the steps that compiled)
    bar.update(1)
    elapsed = max(now - p.started, 1e-9)
    bar.set_postfix_str(
        f"{p.items_seen * accelerator.num_processes / elapsed:.1f} {run.objective.unit}/s, "
        f"{p.tokens_needed * accelerator.num_processes / elapsed:.0f} tokens/s"
    )
    p.fractional_epoch = p.epoch + (micro_step + 1) / len(run.loader)
    epoch_done = micro_step + 1 == len(run.loader)
    p.epoch_index, p.batches_in_epoch = (p.epoch + 1, 0) if epoch_done else (p.epoch, micro_step + 1)
    last_step = p.global_step >= run.total_steps
    stamp = {"epoch": round(p.fractional_epoch, 4), "step": p.global_step}
    if p.global_step % config.logging_steps == 0 or last_step:
        grad_norm = {"grad_norm": float(p.grad_norm)} if p.grad_norm is not None else {}
        run.metrics({**p.log.flush(), "learning_rate": learning_rate, **grad_norm, **stamp})
    if run.eval_loader is not None and (last_step or (config.eval_steps and p.global_step % config.eval_steps == 0)):
        evaluated = run.objective.evaluate(
            accelerator, run.scorer, run.eval_loader, run.loss, config.per_device_eval_batch_size
        )
        run.metrics({**evaluated, **stamp})
    # every N steps and at the last one (as transformers' Trainer), so that a finished run can be extended
    if _checkpoint_due(config, p.global_step, last_step):
        write_checkpoint(run)


def _checkpoint_due(config: TrainConfig, step: int, last_step: bool) -> bool:
    """Every --save-steps steps and at the last one (as transformers' Trainer), so that a finished run can be
    extended."""
    return bool(config.save_steps) and (step % config.save_steps == 0 or last_step)


def write_checkpoint(run: Run) -> Path:
    """This step's checkpoint, OUT/checkpoint-STEP (every process)."""
    state, settings, limit = trainer_state(run), run.config.to_dict(), run.config.save_total_limit
    return save_checkpoint(run.plan.engine, run.scorer, run.optimizer, run.tokenizer, run.out, state, settings, limit)


def stop_here(run: Run, signal_name: str) -> None:
    """Every process received a stop request at this step boundary: write this step's checkpoint (unless it was
    just written), let go of what the run holds, and end with `Preempted` (the command line's exit status 75; on
    Ctrl-C `Interrupted`, 130)."""
    p = run.progress
    path = run.out / f"checkpoint-{p.global_step}"
    if not _checkpoint_due(run.config, p.global_step, last_step=False):
        path = write_checkpoint(run)
    if run.trackers:
        run.accelerator.end_training()
    run.plan.engine.close(run.scorer)
    stopped = Interrupted if signal_name == "SIGINT" else Preempted
    raise stopped(
        f"{signal_name} received: stopped at step {p.global_step} of {run.total_steps}, its checkpoint written "
        f"({path}). Continue with {continue_command('--autoresume', unless=('--resume',))}."
    )


def trainer_state(run: Run) -> TrainerState:
    """The trainer's state after the last step (a checkpoint's; `finish` adds the run's work)."""
    p = run.progress
    return TrainerState(
        global_step=p.global_step,
        max_steps=run.total_steps,
        epoch=p.fractional_epoch,
        epoch_index=p.epoch_index,
        batches_in_epoch=p.batches_in_epoch,
        log_history=p.history,
        pending_metrics=dict(p.log.values),
        distributed=run.plan.engine.record(),
        cache_rows=dict(content_id=run.manifest.content_id, rows=run.manifest.counts["rows"]),
    )


# ------------------------------------------------------------------------------------------- finish


def finish(run: Run) -> TrainResult:
    """The final model (HF format; merged too with --merge), its card, and the final trainer state."""
    config, accelerator, p, out = run.config, run.accelerator, run.progress, run.out
    accelerator.wait_for_everyone()
    if run.trackers:
        accelerator.end_training()
    save_model(run.plan.engine, run.scorer, run.tokenizer, out, config.to_dict())
    if config.merge:  # (a quantized base: into its float weights, in the reference's dtype, as served)
        quantized = run.manifest.reference.get("quantization") is not None
        dtype = run.manifest.precision[0] if quantized else None
        base = lambda: load_base(config, run.manifest, run.init, dtype=dtype)  # noqa: E731
        save_merged(run.plan.engine, run.scorer, run.tokenizer, out, base, into_loaded=quantized)
    executed, needed = (sum(gather_object([x])) for x in (p.tokens_executed, p.tokens_needed))
    state = trainer_state(run)
    state.train_seconds = round(time.perf_counter() - p.started, 3)
    state.tokens_executed, state.tokens_needed = executed, needed
    state.token_efficiency = round(needed / max(executed, 1), 4)
    state.precision = str(run.plan.regime)
    state.packing = "packed" if run.plan.padded_because is None else f"padded ({run.plan.padded_because})"
    state.attention_kernel = run.plan.kernel
    state.compile = run.plan.compiled.report() if run.plan.compiled else None
    state.reference_hash = run.manifest.reference["weights_hash"]
    state.round = run.init.round + 1 if run.init else 1
    state.peak_memory = run.peaks.per_process(accelerator)
    if run.init:
        state.parent_run = run.init.parent()
    state.cache_segments = [
        {k: seg[k] for k in ("index", "rows", "first_example_id", "written_at")}
        | {"source": seg["source"]["name_or_path"], "content_hash": seg["source"]["content_hash"]}
        for seg in run.manifest.all_segments
    ]
    state.kl_forward = run.objective.kl_forward(run.loss, p.kl_on_cached_prompt)
    if accelerator.is_main_process:
        state.write(out)
        _write_cards(run, {"round": state.round, "parent_run": state.parent_run})
        print(
            f"train finished: {p.global_step} steps in {state.train_seconds:.1f} s; model and its card "
            f"(README.md) in {out.resolve()}\n"
            f"  efficiency   {state.token_efficiency:.1%}: {needed} tokens needed (each prompt once, no padding) "
            f"/ {executed} run in forwards; batches {state.packing}, KL forward {state.kl_forward}\n"
            f"  memory       peak private host memory: {describe(state.peak_memory)}",
            flush=True,
        )
    run.plan.engine.close(run.scorer)
    accelerator.wait_for_everyone()
    if config.push_to_hub and accelerator.is_main_process:  # (after every process is done: a failure stops none)
        print(f"  hub          https://huggingface.co/{push_run(out, config.hub_model_id)}", flush=True)
    return TrainResult(output_dir=out, global_step=p.global_step, metrics=p.history, step_seconds=p.step_seconds)


def _write_cards(run: Run, lineage: dict[str, Any]) -> None:
    config, history = run.config.to_dict(), run.progress.history
    card = dict(
        chat_template=run.tokenizer.chat_template is not None,
        num_processes=run.accelerator.num_processes,
        precision=run.plan.regime.mixed_precision,
        lineage=lineage,
    )
    write_model_card(run.out, config, run.manifest, history, adapter=run.config.lora_r is not None, **card)
    if run.config.merge:
        write_model_card(run.out / "merged", config, run.manifest, history, adapter=False, **card)


def _trackers(config: TrainConfig) -> list[str]:
    return [t.strip() for t in config.report_to.split(",") if t.strip() not in ("", "none")]


def _planned_steps(max_steps: int, num_train_epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps of a run: --max-steps if > 0, else --num-train-epochs passes (at least 1 step)."""
    return max_steps if max_steps > 0 else max(math.ceil(num_train_epochs * steps_per_epoch), 1)
