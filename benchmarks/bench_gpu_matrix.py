"""`make bench-gpu`: the GPU matrix in one bounded run, for the session a GPU is lent to.

    python benchmarks/bench_gpu_matrix.py                          # `make bench-gpu`: a CUDA GPU, RESULTS-gpu.md
    python benchmarks/bench_gpu_matrix.py --device cpu             # the code path on a CPU, tiny shapes (~3 min)

The accelerator's default path (the block mask, compiled, bf16; on a CPU its default, by tree and eager) runs both
stages (the reference pass compiled alike) and one step, and its step-1 rewards must be exactly 0 (`step_one_check`);
before their cases, CUDA graphs must give the numbers of the compiled run without them (a
tiny model, accumulation and evaluation). For Qwen2-0.5B and a ~1.5B shape (Qwen2-1.5B's, at max_length 2048 with HH
lengths), KTO against trl.KTOTrainer and the `sigmoid` pair loss against trl.DPOTrainer, at batch 8 and 64:
kto-pipeline's training compiled (without, then with CUDA graphs: `--torch-compile-mode reduce-overhead`) and eager,
trl precomputed with and without liger's fused loss. It reports each case's step time, MFU and peak memory, and the
goals.

A budget keeps it within 8 minutes (--budget-s 480, building and the checks included), and the run goes in the order of
what answers the goals (`plan`), so that what the budget leaves out answers the least: the ~1.5B shape's reference pass
at the defaults (forwards filled to the token budget: needed tokens/s, MFU) and its compiled training step at its
larger batch (>= 16k tokens: MFU); the `sigmoid` pair loss against trl.DPOTrainer at batch 8 and 64 on Qwen2-0.5B; the
default path's step-1 check end to end; CUDA graphs after their check; KTO on Qwen2-0.5B, ours compiled and trl's two
settings at both batches (the speed and memory goals), with where ours' compiled step's time goes at batch 8
(torch.profiler: the GPU's kernel time against the wall, kernels run, launches, the host's waits for the device, ops);
the layouts' diagnosis of step 1; the first model's KTO reference pass again, on the dense mask, in static shapes and
compiled (which pays); then every other case (eager, the ~1.5B shape's others). `--first speed` (or `large`, `graphs`,
`pairs`, `step_one`) moves that goal's cases first, for a run that follows one whose budget ended before them. Each
step of cases (one tool, one model, one loss) runs in a fresh process that measures them one after another (ours'
reference pass once for the model and loss, its cache kept for the later steps); every case is written down the
moment it ends, and what the budget leaves no time for is reported as not run, never guessed. A case that runs out of
memory says so and the rest go on. Model and data as `gpu_harness.py` builds them (random weights, random characters
with HH-RLHF's lengths). On a CPU the compiled cases compile with torch's aot_eager backend (`CPU_BACKEND`: traced as on
a GPU, no kernels generated)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import gpu_harness
import harness
import step_one_layouts
import torch
from gpu_harness import LEARNING_RATE, OURS_PRECOMPUTE, PEAK_FLOPS_CUDA, Flops, pairs

HEADING = "# GPU matrix: `make bench-gpu`"
MODELS = {"cuda": ("qwen2-0.5b", "qwen2-1.5b"), "cpu": ("tiny",)}
BATCHES = {"cuda": (8, 64), "cpu": (4,)}  # a CPU run checks the code path
LOSSES = ("kto", "sigmoid")
STEPS = {"qwen2-0.5b": 8, "qwen2-1.5b": 6, "tiny": 3}
# every tool's cases of the ~1.5B shape recompute activations: without, ours at batch 64 (~20k tokens) needs 91 GiB
# (`estimate-memory`, 64 rows x 320 tokens: 74 GiB of activations), 26 GiB with
CHECKPOINTING = {"qwen2-1.5b": True}
# a group's cases, in the order they run: (column, ours' compile options, or trl's use_liger_kernel)
# CUDA graphs last: a failure while recording a graph can leave the device unusable for the cases after it
OURS = (
    ("kto-pipeline compiled", dict(torch_compile=True)),
    ("kto-pipeline eager", dict(torch_compile=False)),
    ("kto-pipeline CUDA graphs", dict(torch_compile_mode="reduce-overhead")),  # static shapes implied
)
COMPILED = ("kto-pipeline compiled", "kto-pipeline CUDA graphs")  # ours' best of these against trl's best
# where a compiled step's time goes: KTO on the first model at the smallest batch (the step the host bounds), compiled,
# in the process that ran the compiled cases (its graphs compiled), a run of PROFILED_STEPS[1] steps minus one of
# PROFILED_STEPS[0] under torch.profiler: per step, the wall (profiled), the GPU's kernel time, launches, waits, ops
PROFILED, PROFILED_STEPS = "kto-pipeline compiled, profiled", (2, 5)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# the host waiting for the device (`.item()`, `.tolist()`, a copy to the host): while it waits, no launch runs ahead
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cuStreamSynchronize")
TRL = (("trl precomputed", False), ("trl precomputed + liger", True))
COLUMNS = (*(c for c, _ in OURS), *(c for c, _ in TRL))
REFERENCE = "kto-pipeline reference pass"  # ours' first case of a (model, loss): the cache its training cases read
# the first model's KTO reference pass again, in one process, each into a cache of its own: at its defaults (their
# control: the first case ran in another process, and a block-mask pass compiles FlexAttention within its seconds),
# then with one setting changed: which pays on the device (the reference pass is eager by default; on a CPU the
# compiled one attends on the dense mask, as by tree attention's shapes follow the trees). label -> the settings;
# compiled last (never run on a GPU: a failure there could leave the device unusable for what follows in the process)
VARIANTS = {"again": {}, "dense mask": dict(attention_kernel="dense"), "--static-shapes": dict(static_shapes=True)}
VARIANTS["--torch-compile"] = dict(torch_compile=True)
REFERENCE_VARIANTS = {f"{REFERENCE}, {label}": (label, changed) for label, changed in VARIANTS.items()}
TOOLS = ("ours", "trl")
# the step-1 check: the first rows of the first model's KTO data, one step of a batch, the metrics read
STEP_ONE_ROWS, STEP_ONE_BATCH = 64, 8
STEP_ONE_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl")
GRAPHS_EQUAL = 1e-3  # CUDA graphs' numbers against the run without them: the parity tests' tolerance
GOALS = dict(speedup=1.5, memory=0.5, mfu=0.40, mfu_tokens=16384)
# the whole run's seconds (8 minutes): no case starts in its last STARTS_UNTIL seconds, and a worker still running at
# its end is stopped (the cases it finished are kept)
BUDGET_S, STARTS_UNTIL = 480, 60
# at most, for each check before the cases on a GPU (step 1 of the default path, CUDA graphs against the run without
# them, step_one_layouts: what moves a sequence's log-prob between layouts), so that the cases keep most of the budget
CHECK_S = {"cuda": dict(step_one=150, graphs=120, layouts=90), "cpu": {}}
FIRST = ("speed", "large", "graphs", "pairs", "step_one")  # `--first`: a goal's steps first (`plan`)
# what compiles ours' regions in a CPU run (the code path's check): Dynamo and AOTAutograd trace them as on a GPU, and
# no kernels are generated (inductor's CPU kernels are not what a GPU runs: tests/test_compile.py holds them to the
# eager numbers); measured: the CPU run from an empty compile cache, 136 s against 321 s with inductor
CPU_BACKEND = "aot_eager"


def preset_of(model: str, loss: str, device: str) -> dict:
    """harness.GPU_PRESETS' preset of `model`, for `loss`, with the rows the largest batch trains."""
    steps, batch = STEPS[model], max(BATCHES[device])
    return dict(harness.GPU_PRESETS[model], loss_type=loss, steps=steps, batch=batch, rows=steps * batch)


def compiled_attention(device: str) -> str:
    """The attention kernel of a compiled case: the device's default ("auto"), but on a CPU the dense mask (its
    default, by tree, attends once a tree: a compiled graph unrolls the trees, and a new layout compiles again)."""
    return "auto" if device == "cuda" else "dense"


def compile_notes(compiled: dict) -> str:
    """What a compiled case's record (trainer_state.json's or the manifest's `compile`) says ran eagerly."""
    text = " (ran eagerly: compiling failed)" if compiled.get("eager_fallback") else ""
    return text + (" (some shapes eagerly: past the recompile limit)" if compiled.get("recompile_limit") else "")


def group_work(work: Path, model: str, loss: str) -> Path:
    """A (model, loss)'s folder: the model (one per shape, shared by both losses) and that loss's data."""
    return work / f"{model}-{loss}"


def prepare(work: Path, model: str, loss: str, device: str) -> dict:
    """The random model (built once per shape; on the GPU where there is one) and the loss's data."""
    where = group_work(work, model, loss)
    where.mkdir(parents=True, exist_ok=True)
    shared = work / f"{model}-model"
    harness.random_qwen2(shared, preset_of(model, loss, device), device=device)
    if not (where / "model").exists():
        (where / "model").symlink_to(shared.resolve(), target_is_directory=True)
    return gpu_harness.build_data(where / "data.jsonl", preset_of(model, loss, device))


# ------------------------------------------------------------------------------------------ the workers


class Cases:
    """A group worker's cases: each written to `cases.jsonl` the moment it ends (a killed worker keeps them)."""

    def __init__(self, out: Path, deadline: float, device: str):
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.deadline, self.device = out / "cases.jsonl", deadline, device

    def run(self, name: str, measure) -> None:
        if time.time() > self.deadline:
            return self.write(dict(case=name, skipped="not run within the budget"))
        self.write(dict(case=name, started=time.time()))  # replaced by its result; alone: stopped while running
        gpu_harness.reset_peak_memory(self.device)
        try:
            result = measure()
        except torch.OutOfMemoryError as error:  # the rest of the group goes on
            result = dict(skipped=f"out of memory ({str(error).splitlines()[0][:120]})")
        except Exception as error:  # noqa: BLE001 (named in the report; the rest of the group goes on)
            traceback.print_exc()
            result = dict(skipped=f"failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        self.write(dict(case=name, **result))

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        status = "started" if "started" in record else record.get("skipped") or "done"
        print(f"  {record['case']}: {status}", flush=True)


def case_name(column: str, batch: int) -> str:
    return f"{column} @ {batch}"


def group_cases(tool: str, device: str) -> list[str]:
    """The cases a group (one tool, one model, one loss) measures, in order."""
    columns = OURS if tool == "ours" else TRL
    first = [REFERENCE] if tool == "ours" else []
    return first + [case_name(column, batch) for column, _ in columns for batch in BATCHES[device]]


def not_on(device: str) -> dict[str, str]:
    """The cases `device` does not run, with why: on a CPU the CUDA graphs cases (a CPU has none; the CUDA graphs
    check runs their mode, in static shapes, against the compiled run without it)."""
    if device != "cpu":
        return {}
    why = "skipped: a CPU has no CUDA graphs (the CUDA graphs check above ran their mode)"
    return {case_name(COMPILED[1], batch): why for batch in BATCHES[device]}


def plan(device: str, first: str | None = None) -> list[tuple]:
    """The run's steps in the order of what answers the goals: `("check", name)`, or `(tool, model, loss, cases)`, a
    group's cases that run in one process. First the last model's (on a GPU the ~1.5B shape's) reference pass at the
    defaults and its compiled step at the largest batch (the MFU goals, at >= 16k tokens a step); then the `sigmoid`
    pair loss on the first model, ours compiled and trl.DPOTrainer's settings at every batch; the default path's
    step-1 check end to end; the CUDA graphs check, then CUDA graphs' cases; KTO on the first model, ours compiled
    (its smallest batch profiled right after it ran, in its process) and trl's settings at every batch; the layouts'
    diagnosis of step 1; the first model's KTO reference pass again and with one setting changed (the dense mask,
    static shapes, compiled); then every case not yet planned, group by group in the goals' order (loss, model, tool).
    `first` (one of FIRST) puts that goal's steps first, for a run that follows one whose budget ended before them.
    Each case once."""
    first_model, last, large = MODELS[device][0], MODELS[device][-1], max(BATCHES[device])
    compiled, graphs = COMPILED
    # the profiled steps right after the compiled case they profile, in its process (its graphs compiled)
    speed_cases = [case_name(compiled, b) for b in BATCHES[device]]
    speed_cases.insert(1, case_name(PROFILED, BATCHES[device][0]))
    goals = {
        "large": [("ours", last, "kto", [REFERENCE, case_name(compiled, large)])],
        "pairs": [
            ("ours", first_model, "sigmoid", [REFERENCE, *(case_name(compiled, b) for b in BATCHES[device])]),
            ("trl", first_model, "sigmoid", group_cases("trl", device)),
        ],
        "step_one": [("check", "step_one")],
        "graphs": [("check", "graphs"), ("ours", first_model, "kto", [case_name(graphs, b) for b in BATCHES[device]])],
        "speed": [
            ("ours", first_model, "kto", [REFERENCE, *speed_cases]),
            ("trl", first_model, "kto", group_cases("trl", device)),
        ],
    }
    order = list(goals)
    if first:
        order.insert(0, order.pop(order.index(first)))
    wanted = [step for goal in order for step in goals[goal]] + [("check", "layouts")]
    # the profiled steps run in the process of the compiled case they profile: with the first group that holds it (on
    # a CPU the one model's MFU step holds it too)
    profiled, anchor = case_name(PROFILED, BATCHES[device][0]), case_name(compiled, BATCHES[device][0])
    for index, step in enumerate(wanted):
        if step[0] != "check" and step[1:3] == (first_model, "kto") and anchor in step[3] and profiled not in step[3]:
            cases = list(step[3])
            cases.insert(cases.index(anchor) + 1, profiled)
            wanted[index] = (*step[:3], cases)
            break
    wanted.append(("ours", first_model, "kto", list(REFERENCE_VARIANTS)))
    wanted += [(tool, m, loss, group_cases(tool, device)) for loss in LOSSES for m in MODELS[device] for tool in TOOLS]
    steps, planned, skipped = [], set(), not_on(device)
    for step in wanted:
        if step[0] == "check":
            steps.append(step)
            continue
        cases = [case for case in step[3] if (*step[:3], case) not in planned and case not in skipped]
        planned.update((*step[:3], case) for case in cases)
        if cases:
            steps.append((*step[:3], cases))
    return steps


def ours_group(where: Path, model: str, loss: str, device: str, cases: Cases, wanted: list[str]) -> None:
    """The `wanted` cases of ours, in order: the reference pass over the rows the largest batch trains (its cache in
    `where`, for every step of the group), the same pass again and with one setting changed (REFERENCE_VARIANTS, each
    into a cache of its own), and settings at a batch: compiled, with CUDA graphs (on a CPU: the same code path
    without them, in their fixed shapes), eager."""
    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.cache import open_cache

    preset, cache_dir = preset_of(model, loss, device), where / "ours-cache"
    ml, steps = preset["max_length"], preset["steps"]

    def reference(output: Path = cache_dir, **changed) -> dict:
        dtype = "bfloat16" if device == "cuda" else "float32"
        paths = dict(model=str(where / "model"), dataset=str(where / "data.jsonl"), output=str(output))
        config = PrecomputeConfig(**paths, overwrite=True, max_length=ml, dtype=dtype, **OURS_PRECOMPUTE)
        if changed.get("torch_compile"):
            changed = dict(changed, attention_kernel=compiled_attention(device))
        cache = open_cache(precompute(dataclasses.replace(config, pairs_only=pairs(preset), **changed)))
        lengths = gpu_harness.pair_lengths(where) if pairs(preset) else gpu_harness.row_lengths(cache.table, ml)
        seconds, compiled = cache.manifest.timing["reference_pass_seconds"], cache.manifest.timing.get("compile")
        peak = gpu_harness.peak_memory_mib(device)
        return dict(ref_seconds=seconds, ref_lengths=lengths, ref_peak_mib=peak, compile=compiled)

    settings_of = {case_name(column, b): (column, compiling, b) for column, compiling in OURS for b in BATCHES[device]}
    for case in wanted:
        if case == REFERENCE:
            cases.run(REFERENCE, reference)
            continue
        if case in REFERENCE_VARIANTS:
            label, changed = REFERENCE_VARIANTS[case]
            output = cases.path.parent / f"cache-{label.lstrip('-').replace(' ', '-')}"
            torch._dynamo.reset()
            cases.run(case, lambda output=output, changed=changed: reference(output, **changed))
            continue
        if case.startswith(PROFILED):
            batch = int(case.rsplit(" @ ", 1)[1])
            profiling = (cache_dir, cases.path.parent, model, loss, device, batch)
            cases.run(case, lambda profiling=profiling: profiled_steps(*profiling))
            continue
        column, compiling, batch = settings_of[case]
        if "torch_compile_mode" in compiling and CHECKPOINTING.get(model, False):
            no_graphs = "no CUDA graphs under gradient checkpointing (the mode compiles without them)"
            cases.write(dict(case=case, skipped=no_graphs))
            continue

        def step(batch=batch, compiling=compiling, column=column) -> dict:
            out = cases.path.parent / f"run-{batch}-{column.split(' ', 1)[1].replace(' ', '-')}"
            config = ours_config(cache_dir, out, model, loss, device, batch, steps, column in COMPILED, **compiling)
            res = train(config)
            state = harness.trainer_state(out) or {}
            rows = open_cache(cache_dir).table.slice(0, steps * batch)
            n = steps * batch
            lengths = gpu_harness.pair_lengths(where, n) if pairs(preset) else gpu_harness.row_lengths(rows, ml)
            return dict(
                step_seconds=res.step_seconds,
                train_peak_mib=gpu_harness.peak_memory_mib(device),
                train_lengths=lengths,
                kernel=state.get("attention_kernel"),
                compile=state.get("compile"),
                kl_forward=state.get("kl_forward"),
            )

        torch._dynamo.reset()  # each case compiles from its own first step, as a fresh run would
        cases.run(case, step)


def ours_config(
    cache: Path, out: Path, model: str, loss: str, device: str, batch: int, steps: int, compiled: bool, **compiling
):
    """The TrainConfig of ours' training case: `steps` steps at `batch` (bf16 on a GPU), `compiling` (its compile
    options; `compiled`: on the compiled cases' attention kernel), checkpointing where the model's preset needs it."""
    settings = dict(batch=batch, steps=steps, learning_rate=LEARNING_RATE, bf16=device == "cuda")
    settings |= dict(beta=gpu_harness.BETA, loss_type=loss, save_steps=0, **compiling)
    if compiled:
        settings["attention_kernel"] = compiled_attention(device)
    config = harness.ours_train_config(cache, out, **settings)
    return dataclasses.replace(config, gradient_checkpointing=CHECKPOINTING.get(model, False))


def profiled_steps(cache_dir: Path, out: Path, model: str, loss: str, device: str, batch: int) -> dict:
    """Where a compiled step's time goes: a PROFILED_STEPS[1]-step minus a PROFILED_STEPS[0]-step compiled run under
    torch.profiler (CPU and, on a GPU, CUDA activity), per step: the wall (the runs' step times, profiled), the GPU's
    kernel time (kernels', copies' and memsets' durations: `profile_counts`), the kernels run, kernel launches (CUDA
    graph launches apart), the host's waits for the device, aten ops, and the kernels that took longest. The dynamo
    cache is kept: the graphs the compiled cases compiled."""
    from torch.profiler import ProfilerActivity, profile

    from kto_pipeline import train

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    runs = {}
    for steps in PROFILED_STEPS:
        where = out / f"run-{batch}-profiled-{steps}"
        config = ours_config(cache_dir, where, model, loss, device, batch, steps, True, torch_compile=True)
        with profile(activities=activities) as prof:
            res = train(config)
        compiled = (harness.trainer_state(where) or {}).get("compile") or {}
        runs[steps] = dict(profile_counts(prof), wall=sum(res.step_seconds), graphs=compiled.get("graphs", 0))
    few, many = (runs[n] for n in PROFILED_STEPS)
    n = PROFILED_STEPS[1] - PROFILED_STEPS[0]
    counted = ("wall", "device_s", "kernels_run", "launches", "graph_launches", "syncs", "ops")
    per_step = {k: (many[k] - few[k]) / n for k in counted}
    kernels = {name: (t - few["kernels"].get(name, 0.0)) / n for name, t in many["kernels"].items()}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:5]
    graphs = few["graphs"] + many["graphs"]  # compiled anew in the profiled runs (0: the cases' graphs served)
    return dict(profiled=per_step, top_kernels=top, steps=list(PROFILED_STEPS), graphs_compiled=graphs)


def profile_counts(prof) -> dict:
    """A profile's totals: the GPU's time in its CUDA events (seconds; by kernel name), the kernels run (copies and
    memsets apart: without CUDA graphs, one a launch), launches, CUDA graph launches, the host's waits, aten ops.
    The device's copies of annotated ranges (inductor's `## Call CompiledFxGraph ##` around each compiled call, the
    optimizer's step) are no kernels: they span the kernels they hold, and are left out, as torch's own tables do."""
    from torch.autograd import DeviceType

    events, kernels, run = prof.events(), {}, 0
    for event in events:
        if event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e6
            run += not event.name.startswith(("Memcpy", "Memset"))
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    return dict(
        device_s=sum(kernels.values()),
        kernels=kernels,
        kernels_run=run,
        launches=sum(e.name in LAUNCHES for e in cpu),
        graph_launches=sum(e.name == "cudaGraphLaunch" for e in cpu),
        syncs=sum(e.name in SYNCS for e in cpu),
        ops=sum(e.name.startswith("aten::") for e in cpu),
    )


def profiled_lines(results: dict, device: str) -> list[str]:
    """The profiled case's section: where a compiled step's time goes."""
    model, batch = MODELS[device][0], BATCHES[device][0]
    res = results.get((model, "kto", case_name(PROFILED, batch))) or {}
    lines = ["## Where a compiled step's time goes (torch.profiler)", ""]
    if "profiled" not in res:
        return [*lines, f"- {res.get('skipped', 'not run')}"]
    p, (few, many) = res["profiled"], res["steps"]
    gpu = (
        f"the GPU's kernels {p['device_s']:.4f} s ({p['device_s'] / p['wall']:.0%} of the wall), "
        f"{p['kernels_run']:,.0f} kernels run, {p['launches']:,.0f} kernel launches, "
        f"{p['graph_launches']:,.0f} CUDA graph launches, {p['syncs']:,.0f} waits of the host for the device, "
        if device == "cuda"
        else "no GPU (a CPU run: ops only), "
    )
    lines.append(
        f"- {model}, KTO, batch {batch}, compiled (the graphs the compiled cases compiled), per step: a {many}-step "
        f"minus a {few}-step run under torch.profiler: wall {p['wall']:.4f} s (profiled), {gpu}"
        f"{p['ops']:,.0f} aten ops dispatched"
        + (f" ({res['graphs_compiled']} graphs compiled in the profiled runs)" if res.get("graphs_compiled") else "")
    )
    if res.get("top_kernels"):
        top = "; ".join(f"{name[:80]} {seconds * 1e3:.2f} ms" for name, seconds in res["top_kernels"])
        lines.append(f"- the longest kernels a step: {top}")
    return lines


def trl_group(where: Path, model: str, loss: str, device: str, cases: Cases, wanted: list[str]) -> None:
    """The `wanted` cases of trl, in TRL's order (precomputed without, then with liger), each at its batch: its
    reference pass (in the constructor) then the steps, on the rows that batch trains."""
    from trl import DPOTrainer, KTOTrainer

    preset = preset_of(model, loss, device)
    ml, steps = preset["max_length"], preset["steps"]
    sync = torch.cuda.synchronize if device == "cuda" else None
    timing: dict = {}
    harness.time_calls(
        DPOTrainer if pairs(preset) else KTOTrainer,
        "_precompute_ref_logps",
        lambda seconds, *args, **kwargs: timing.update(ref_seconds=seconds),
        synchronize=sync,
    )
    lines = (where / "data.jsonl").read_text().splitlines(keepends=True)
    # the plain cases first: liger patches the model's module (its norms, MLP, rotary) for the rest of the process
    for column, liger in TRL:
        for batch in BATCHES[device]:
            if case_name(column, batch) not in wanted:
                continue
            n = steps * batch
            data = cases.path.parent / f"data-{batch}-{'liger' if liger else 'plain'}.jsonl"  # no reused reference
            data.write_text("".join(lines[:n]))
            if liger and gpu_harness.liger_unavailable(device):
                cases.write(dict(case=case_name(column, batch), skipped=gpu_harness.liger_unavailable(device)))
                continue

            def step(batch=batch, liger=liger, data=data, n=n) -> dict:
                timing.clear()
                run = dict(batch=batch, max_length=ml, precompute=True, bf16=device == "cuda")
                run["gradient_checkpointing"] = CHECKPOINTING.get(model, False)
                run |= dict(beta=gpu_harness.BETA, learning_rate=LEARNING_RATE, max_steps=steps, use_liger_kernel=liger)
                run |= dict(precompute_ref_batch_size=batch, train_sampling_strategy="sequential", **harness.TRL_RUN)
                if pairs(preset):
                    run |= dict(pairs=True, loss_type=[loss])
                out = cases.path.parent / f"trl-{batch}-{'liger' if liger else 'plain'}"
                trainer = harness.trl_trainer(where / "model", data, out, **run)
                if pairs(preset):
                    lengths = gpu_harness.pair_lengths(where, n)
                else:
                    lengths = gpu_harness.row_lengths(trainer.train_dataset[:n], ml, "KL_completion_ids")
                ref = dict(timing, ref_lengths=lengths, ref_peak_mib=gpu_harness.peak_memory_mib(device))
                timer = harness.step_timer(synchronize=sync)
                trainer.add_callback(timer)
                gpu_harness.reset_peak_memory(device)
                trainer.train()
                peak = gpu_harness.peak_memory_mib(device)
                del trainer
                return dict(ref, step_seconds=timer.times, train_peak_mib=peak, train_lengths=lengths)

            cases.run(case_name(column, batch), step)


def cuda_graphs_check(work: Path, device: str) -> dict:
    """CUDA graphs (`--torch-compile-mode reduce-overhead`) against the compiled run without them, before any is
    timed: a tiny Qwen2, both runs in static shapes (the same kernels; bf16 on a GPU), 2 micro-batches a step and an
    evaluation every 2 steps (the paths where graph outputs could be overwritten). Their logged numbers, the largest
    relative difference, and what ran without CUDA graphs (on a CPU: every graph; none counted under CPU_BACKEND,
    which is not inductor)."""
    from kto_pipeline import PrecomputeConfig, precompute, train

    where, preset = work / "cuda-graphs-check", dict(harness.GPU_PRESETS["tiny"], loss_type="kto", rows=32)
    where.mkdir(parents=True, exist_ok=True)
    harness.random_qwen2(where / "model", preset, device=device)
    gpu_harness.build_data(where / "data.jsonl", preset)
    bf16, kernel = device == "cuda", compiled_attention(device)
    paths = dict(model=str(where / "model"), dataset=str(where / "data.jsonl"), output=str(where / "cache"))
    settings = dict(attention_kernel=kernel, torch_compile=True, static_shapes=True)
    dtype = "bfloat16" if bf16 else "float32"
    # the cache both runs read, scored eagerly: what is compared is training (one cold compile fewer)
    cache = precompute(
        PrecomputeConfig(
            **paths, overwrite=True, max_length=preset["max_length"], dtype=dtype, **dict(settings, torch_compile=False)
        )
    )
    logged, compiled = {}, {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        out = where / f"run-{mode}"
        run = harness.ours_train_config(cache, out, batch=2, steps=4, learning_rate=LEARNING_RATE, bf16=bf16)
        run = dataclasses.replace(run, **settings, torch_compile_mode=mode, gradient_accumulation_steps=2)
        train(dataclasses.replace(run, eval_cache=str(cache), eval_steps=2, save_steps=0))
        logged[mode] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        compiled[mode] = (harness.trainer_state(out) or {}).get("compile")
    pairs_of = [
        (a[k], b[k])
        for a, b in zip(logged["default"], logged["reduce-overhead"], strict=True)
        for k in a
        if isinstance(a.get(k), float) and k not in ("epoch", "learning_rate") and not k.endswith("seconds")
    ]
    # relative, but to at least 1e-3: a value near 0 (step 1's rewards, a KL clamped at 0) is held to 1e-6 apart
    worst = max((abs(a - b) / max(abs(a), abs(b), 1e-3) for a, b in pairs_of), default=None)
    return dict(values=len(pairs_of), max_rel_diff=worst, compile=compiled["reduce-overhead"])


def step_one_check(work: Path, device: str) -> dict:
    """Training's default path (attention "auto": the block mask on a GPU, by tree on a CPU; compiled on a GPU, eager
    on a CPU), the reference pass run alike (compiled on a GPU too, where by default it is eager), both stages in one
    precision regime (float32 weights under bf16 autocast on a GPU) over the first STEP_ONE_ROWS rows of the first
    model's KTO data, then one step of STEP_ONE_BATCH rows: at step 1 the policy is the reference, so its rewards and
    KL are 0 where both stages compute each sequence alike."""
    from kto_pipeline import PrecomputeConfig, precompute, train

    model, where = MODELS[device][0], work / "step-one-check"
    source, data = group_work(work, model, "kto"), where / "data.jsonl"
    where.mkdir(parents=True, exist_ok=True)
    data.write_text("".join((source / "data.jsonl").read_text().splitlines(keepends=True)[:STEP_ONE_ROWS]))
    common = dict(bf16=device == "cuda", attention_kernel="auto", torch_compile=device == "cuda")
    paths = dict(model=str(source / "model"), dataset=str(data), output=str(where / "cache"), overwrite=True)
    config = PrecomputeConfig(**paths, max_length=harness.GPU_PRESETS[model]["max_length"], **OURS_PRECOMPUTE)
    cache = precompute(dataclasses.replace(config, **common))
    settings = dict(batch=STEP_ONE_BATCH, steps=1, learning_rate=LEARNING_RATE, beta=gpu_harness.BETA, **common)
    train(harness.ours_train_config(cache, where / "run", **settings))
    first = json.loads((where / "run" / "metrics.jsonl").read_text().splitlines()[0])
    manifest, state = json.loads((cache / "manifest.json").read_text()), harness.trainer_state(where / "run")
    kernels = f"{manifest['reference_pass'].get('attention_kernel')} / {state.get('attention_kernel')}"
    return dict(step_one={k: first[k] for k in STEP_ONE_KEYS}, kernel=kernels, precision=state.get("precision"))


def worker(name: str, work: Path, device: str, out: Path, deadline: float, wanted: list[str]) -> dict:
    """`STEP_TOOL_MODEL_LOSS`: that group's `wanted` cases (a step of the plan), into OUT/cases.jsonl; `build`: every
    model and data set (in a process of its own, so that the driver holds no GPU memory)."""
    if name == "build":
        for model in MODELS[device]:
            for loss in LOSSES:
                prepare(work, model, loss, device)
        cpu = f"{harness.cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
        return dict(device_name=torch.cuda.get_device_name(0) if device == "cuda" else cpu)
    checks = dict(cuda_graphs_check=cuda_graphs_check, step_one_check=step_one_check)
    if name in checks:
        return harness.measured(lambda: checks[name](work, device), rss=False)
    _, tool, model, loss = name.split("_")
    cases = Cases(out, deadline, device)

    def run() -> dict:
        group = ours_group if tool == "ours" else trl_group
        group(group_work(work, model, loss), model, loss, device, cases, wanted)
        return dict(cases=str(cases.path))

    return harness.measured(run, rss=False)


# ------------------------------------------------------------------------------------------ the report


def median(res: dict) -> float:
    """A case's median step: steps 2..n, leaving out those that compiled (`harness.median_step`)."""
    return harness.median_step(res["step_seconds"], harness.compiling_steps(res))


def mfu(flops: Flops, res: dict, batch: int, peak: float | None) -> float | None:
    """Model FLOPs of a step (the mean over steps 2..n's needed tokens) over the median step's time, against `peak`
    (None on a CPU): a step that compiled does not count, as in the median."""
    times = res["step_seconds"]
    if peak is None or len(times) < 2:
        return None
    return flops.train(res["train_lengths"][batch:]) / (len(times) - 1) / median(res) / peak


def cell(res: dict | None, flops: Flops, batch: int, peak: float | None) -> str:
    if res is None:
        return "not run within the budget"
    if "skipped" in res:
        return res["skipped"]
    if "started" in res:
        return "stopped at the budget's end while running"
    value = mfu(flops, res, batch, peak)
    text = f"{median(res):.4f} s"
    text += f", {value:.1%} MFU" if value is not None else ""
    compiled_steps, timed = harness.steps_compiling(res["step_seconds"], harness.compiling_steps(res))
    if compiled_steps:
        left = "every timed step compiled" if compiled_steps == timed else f"{compiled_steps} compiling left out"
        text += f" (steps 2..{timed + 1}: {left})"
    compiled = res.get("compile") or {}
    text += compile_notes(compiled)
    skips = compiled.get("cudagraph_skips")
    text += f" ({skips} graph(s) without CUDA graphs)" if skips else ""
    if peak is not None and compiled.get("cudagraph_recorded_inputs") == 0:  # (a GPU's CUDA graphs case)
        text += " (no CUDA graph recorded)"
    return f"{text}, {res['train_peak_mib']:,.0f} MiB"


def tokens_per_step(res: dict | None, batch: int) -> int | None:
    """Needed tokens (P + C + K: each prompt once) of a step, the mean over the trained steps."""
    if not res or "train_lengths" not in res:
        return None
    rows = res["train_lengths"]
    return round(sum(sum(r) for r in rows) / max(len(rows) // batch, 1))


def kl_forward_lines(results: dict) -> list[str]:
    """How ours ran the KL completions under gradient checkpointing (trainer_state.json's `kl_forward`), per model:
    on the prompts' cached keys/values where its keys/values are small, else with the prompts again (more FLOPs)."""
    seen: dict[str, set] = {}
    for (model, _, _), res in results.items():
        if CHECKPOINTING.get(model) and isinstance(res, dict) and res.get("kl_forward"):
            seen.setdefault(model, set()).add(res["kl_forward"])
    return [f"ours' KL forward under gradient checkpointing, {m}: {'; '.join(sorted(k))}" for m, k in seen.items()] + (
        [""] if seen else []
    )


def render(results: dict, checks: dict, device: str, peak: float | None, seconds: float, argv: list[str]) -> str:
    """The report: the checks (`checks`: step 1; CUDA graphs against the run without them; step 1 by layout), a row
    per (model, loss, batch), the reference passes, the goals (`peak`: the device's FLOP/s for MFU, None on a CPU)."""
    check, graphs, layouts = checks["step_one"], checks["graphs"], checks["layouts"]
    on = [m for m in MODELS[device] if CHECKPOINTING.get(m)]  # gradient checkpointing
    command = " ".join(["python benchmarks/bench_gpu_matrix.py", *argv])
    lines = [HEADING, "", f"- command: `{command}`" + (" (`make bench-gpu`)" if device == "cuda" else "")]
    name = next((r.get("device_name") for r in [check, *results.values()] if r.get("device_name")), "unknown")
    peak_text = f"MFU against {peak / 1e12:g}e12 FLOP/s" if peak else "no MFU on a CPU"
    lines += [f"- date: {harness.utc_stamp()}; total time {seconds:.0f} s; device: {name} ({device})"]
    lines += [f"- versions: {harness.versions('kto-pipeline', 'torch', 'transformers', 'trl')}"]
    lines += [
        "- settings: random weights, random characters with HH-RLHF's lengths (gpu_harness.py's data); "
        + ("bf16 autocast over float32 weights in training, the reference pass in bf16 weights; " if peak else "")
        + "the same rows in order, AdamW lr 1e-06, beta 0.1; gradient checkpointing "
        + (f"on for {', '.join(on)} (every tool), off otherwise" if on else "off")
        + "; steps: "
        + ", ".join(f"{m} {STEPS[m]} (max_length {harness.GPU_PRESETS[m]['max_length']})" for m in MODELS[device])
        + "; a cell: the median step of steps 2..n (leaving out those that compiled, where others are left: "
        + "trainer_state.json's compile.compiling_steps), its MFU (model FLOPs as gpu_harness.py counts them, "
        + f"{peak_text}), peak memory"
        + ("" if peak else f"; compiled cases: torch.compile's {CPU_BACKEND} backend (no kernels generated)")
    ]
    exact = check.get("step_one") and all(v == 0 for v in check["step_one"].values())
    lines += ["", "## The default path's step-1 check", ""]
    if "step_one" in check:
        values = ", ".join(f"{k} {v:.3g}" for k, v in check["step_one"].items())
        lines += [f"- kernel (precompute / train): {check['kernel']}; {values}: exactly 0: {'yes' if exact else 'NO'}"]
    else:
        lines += [f"- failed: {check.get('failed', 'did not run')}"]
    lines += ["", "## CUDA graphs against the compiled run without them", "", cuda_graphs_line(graphs, device)]
    lines += ["", "## Step 1 by layout: what moves a sequence's log-prob (`benchmarks/step_one_layouts.py`)", ""]
    if "results" in layouts:
        lines += [step_one_layouts.settings(MODELS[device][0]), "", *step_one_layouts.table_lines(layouts["results"])]
    else:
        lines += [f"- failed: {layouts.get('failed', 'did not run')}"]
    header = "| model | loss | batch | needed tokens a step | " + " | ".join(COLUMNS)
    header += " | ours compiled vs trl's best |"
    rows, goal_rows = [], []
    flops = {(m, loss): Flops(preset_of(m, loss, device)) for m in MODELS[device] for loss in LOSSES}
    for model in MODELS[device]:
        for loss in LOSSES:
            for batch in BATCHES[device]:
                got = {c: results.get((model, loss, case_name(c, batch))) for c in COLUMNS}
                tokens = next((tokens_per_step(r, batch) for r in got.values() if tokens_per_step(r, batch)), None)
                cells = [cell(got[c], flops[model, loss], batch, peak) for c in COLUMNS]
                ratio = speedup(got)
                rows.append((model, loss, batch, tokens or "-", *cells, f"{ratio:.2f}x" if ratio else "-"))
                goal_rows += goal_lines(model, loss, batch, got, ratio, flops[model, loss], peak, tokens)
    lines += ["", "## Training steps", "", *harness.table(header, rows), ""]
    lines += [
        "`x` > 1: kto-pipeline's faster compiled setting (with or without CUDA graphs) is faster than trl's best "
        "setting that ran (its fastest step).",
        "",
    ]
    lines += kl_forward_lines(results)
    lines += [*profiled_lines(results, device), ""]
    lines += ["## Reference passes: needed tokens/s", "", *reference_table(results, device, flops, peak), ""]
    lines += [
        "trl's at precompute_ref_batch_size = the batch; ours over the rows the largest batch trains, at its default "
        "settings, then (the first model's KTO data, in one process) again and with one setting changed: which pays "
        "on this device, against `again`. A block-mask pass's seconds include compiling FlexAttention's kernel"
        + ("; on a CPU the --torch-compile pass attends on the dense mask too." if device == "cpu" else "."),
        "",
    ]
    goal_rows.append(("step-1 rewards exactly 0 in bf16, the default path", "yes" if exact else "NO", bool(exact)))
    lines += ["## Against the goals", "", *harness.goals_table(*goal_rows), ""]
    models = {m: flops[m, LOSSES[0]] for m in MODELS[device]}  # a model's N is the same for every loss
    lines += ["## Formula", "", *gpu_harness.formula(models, peak), ""]
    return "\n".join(lines)


def ours_compiled(got: dict) -> dict | None:
    """kto-pipeline's faster compiled case that ran (with or without CUDA graphs): its result."""
    ran = [got[c] for c in COMPILED if got.get(c) and "step_seconds" in got[c]]
    return min(ran, key=median, default=None)


def cuda_graphs_line(graphs: dict, device: str) -> str:
    """What `cuda_graphs_check` found: equal numbers (rel <= GRAPHS_EQUAL) or not, and what ran without graphs."""
    if "max_rel_diff" not in graphs:
        return f"- failed: {graphs.get('failed', 'did not run')}"
    worst, compiled = graphs["max_rel_diff"], graphs.get("compile") or {}
    equal = worst is not None and worst <= GRAPHS_EQUAL
    text = (
        f"- tiny Qwen2, `--torch-compile-mode reduce-overhead` vs default, both `--static-shapes`, 4 steps of 2 "
        f"micro-batches, an evaluation every 2: {graphs['values']} logged values, largest relative difference "
        f"(to at least 1e-3) {worst:.3g}: equal (<= {GRAPHS_EQUAL:g}): {'yes' if equal else 'NO'}"
        if worst is not None
        else "- no logged value to compare: NO"
    )
    skips = compiled.get("cudagraph_skips")
    text += f"; graphs run without CUDA graphs: {skips}" + (" (a CPU has none)" if device == "cpu" else "")
    if device == "cuda":  # (a skip can go uncounted; a recorded graph cannot)
        recorded = compiled.get("cudagraph_recorded_inputs")
        text += f"; CUDA graphs recorded: {'yes' if recorded else 'NONE'} ({recorded} inputs of recorded graphs)"
    reasons = compiled.get("cudagraph_skip_reasons")
    text += f" ({'; '.join(reasons)})" if reasons else ""
    return text + (
        f"; graphs recorded for up to {compiled['cudagraph_sizes']} sizes" if compiled.get("cudagraph_sizes") else ""
    )


def speedup(got: dict) -> float | None:
    """trl's best step (the faster setting that ran) over kto-pipeline's best compiled one."""
    ours = ours_compiled(got)
    trl = [median(got[c]) for c, _ in TRL if got.get(c) and "step_seconds" in got[c]]
    if ours is None or not trl:
        return None
    return min(trl) / median(ours)


def goal_lines(model, loss, batch, got, ratio, flops, peak, tokens) -> list[tuple]:
    """The goals a (model, loss, batch) row answers: the speed-up and memory on Qwen2-0.5B (tiny on a CPU), the MFU on
    the ~1.5B shape at >= 16k tokens a step."""
    where, out = f"{model}, {loss}, batch {batch}", []
    ours = ours_compiled(got)
    if model != "qwen2-1.5b":
        out.append(
            (
                f"step >= {GOALS['speedup']}x trl's best ({where})",
                f"{ratio:.2f}x" if ratio else "-",
                ratio and ratio >= GOALS["speedup"],
            )
        )
        trl = [got[c]["train_peak_mib"] for c, _ in TRL if got.get(c) and "train_peak_mib" in got[c]]
        if ours and "train_peak_mib" in ours and trl:
            share = ours["train_peak_mib"] / min(trl)
            out.append(
                (f"peak memory <= {GOALS['memory']}x trl's best ({where})", f"{share:.2f}x", share <= GOALS["memory"])
            )
    elif tokens and tokens >= GOALS["mfu_tokens"] and ours and "step_seconds" in ours:
        value = mfu(flops, ours, batch, peak)
        shown = f"{value:.1%} at {tokens} tokens a step" if value is not None else "n/a"
        out.append((f"MFU >= {GOALS['mfu']:.0%} ({where})", shown, value is not None and value >= GOALS["mfu"]))
    return out


def reference_table(results: dict, device: str, flops: dict, peak: float | None) -> list[str]:
    """Needed tokens/s (and MFU on a GPU) of each tool's reference pass; trl's at precompute_ref_batch_size = batch.
    `flops`: (model, loss) -> its Flops."""
    header = "| model | loss | kto-pipeline | " + " | ".join(f"trl precomputed @ {b}" for b in BATCHES[device])
    header += " | " + " | ".join(f"kto-pipeline, {label}" for label in VARIANTS) + " |"
    rows = []
    for model in MODELS[device]:
        for loss in LOSSES:
            cases = [REFERENCE, *(case_name("trl precomputed", b) for b in BATCHES[device]), *REFERENCE_VARIANTS]
            cells = []
            for case in cases:
                res = results.get((model, loss, case))
                if case in REFERENCE_VARIANTS and (model, loss) != (MODELS[device][0], "kto"):
                    cells.append("-")  # measured for the first model's KTO data only
                    continue
                if not res or "ref_seconds" not in res:
                    stopped = "stopped at the budget's end while running" if res and "started" in res else "-"
                    cells.append(res.get("skipped", stopped) if res else "not run within the budget")
                    continue
                tokens = sum(sum(r) for r in res["ref_lengths"])
                text = f"{tokens / res['ref_seconds']:,.0f}"
                if peak:
                    text += f" ({flops[model, loss].reference(res['ref_lengths']) / res['ref_seconds'] / peak:.1%} MFU)"
                compiled = res.get("compile") or {}
                if compiled:  # compiling the layers is part of the pass's seconds
                    text += f", {compiled['seconds']:.0f} s of its {res['ref_seconds']:.0f} s compiling"
                text += compile_notes(compiled)
                cells.append(text)
            rows.append((model, loss, *cells))
    return harness.table(header, rows)


def run_plan(
    work: Path,
    device: str,
    ends: float,
    checks: dict[str, Callable[[float], dict]],
    first: str | None = None,
    after: Callable[[dict, dict], None] | None = None,
) -> tuple[dict, dict]:
    """`plan(device, first)`'s steps in order, none started past the budget's last start (`ends` - STARTS_UNTIL) and
    every worker stopped at `ends`. `checks`: name -> a check's run, given the seconds left. Returns (model, loss,
    case) -> its record, every case that did not run saying why, and each check's result (one not run: {failed:
    why}). `after(results, checked)`: called with what is known after each step (the report written so far)."""
    deadline, checked = ends - STARTS_UNTIL, {}
    results = {
        (model, loss, case): dict(skipped=why)
        for model in MODELS[device]
        for loss in LOSSES
        for case, why in not_on(device).items()
    }
    for index, step in enumerate(plan(device, first)):
        if index and after is not None:
            after(results, checked)
        if step[0] == "check":
            late = time.time() >= deadline
            checked[step[1]] = {"failed": "not run within the budget"} if late else checks[step[1]](ends - time.time())
            continue
        tool, model, loss, wanted = step
        name, why = f"{index}_{tool}_{model}_{loss}", "not run within the budget"
        if time.time() < deadline:
            flags = ["--device", device, "--deadline", str(deadline), "--cases", json.dumps(wanted)]
            env = {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"} if device == "cpu" else {}
            res = harness.run_worker(
                Path(__file__), name, work, flags, env=env, must_succeed=False, timeout=ends - time.time()
            )
            if "failed" in res and not res["failed"].startswith("killed"):
                why = f"not run: its group's process failed ({res['failed'][:200]})"
        path = work / "runs" / name / "cases.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            results[(model, loss, record.pop("case"))] = record
        for case in wanted:  # what the step did not get to
            results.setdefault((model, loss, case), dict(skipped=why))
    return results, checked


def main() -> None:
    parser = harness.script_parser(__doc__, work=None, results="Markdown file (default: RESULTS-gpu.md on cuda)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    budget_help = "seconds the whole run may take (building, the check, the cases); what does not fit: not run"
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help=budget_help)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # worker: when to stop starting cases
    parser.add_argument("--cases", help=argparse.SUPPRESS)  # worker: its step's cases, a JSON list
    first_help = "run this goal's cases first (a run that follows one whose budget ended before them)"
    parser.add_argument("--first", choices=FIRST, help=first_help)
    peak_help = "the device's bf16 dense peak for MFU (H100 and H200 SXM: 989)"
    parser.add_argument("--peak-tflops", type=float, default=PEAK_FLOPS_CUDA / 1e12, help=peak_help)
    args = parser.parse_args()
    work = Path(args.work or harness.WORK_DIR / f"gpu-matrix-{args.device}")
    if args.mode == "worker":
        if args.device == "cpu":
            from kto_pipeline.runtime import compiled

            compiled.BACKEND = CPU_BACKEND
        wanted = json.loads(args.cases) if args.cases else []
        harness.print_result(worker(args.name, work, args.device, Path(args.out), args.deadline, wanted))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch (use --device cpu)")
    started, ends = time.perf_counter(), time.time() + args.budget_s
    harness.fresh_runs(work)
    print(f"building the models and data in {work} ...", flush=True)
    env = {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"} if args.device == "cpu" else {}
    built = harness.run_worker(Path(__file__), "build", work, ["--device", args.device], env=env)

    def check(kind: str, script: str, name: str, flags: list[str]) -> Callable[[float], dict]:
        """A check in a process of its own, for at most its CHECK_S and the seconds left: its result, or why it
        failed."""

        def run(left: float) -> dict:
            timeout = min(CHECK_S[args.device].get(kind, float("inf")), left)
            return harness.run_worker(Path(script), name, work, flags, env=env, must_succeed=False, timeout=timeout)

        return run

    first, device = MODELS[args.device][0], ["--device", args.device]
    layouts = [*device, "--preset", first, "--model", str(work / f"{first}-model")]
    checks = dict(
        step_one=check("step_one", __file__, "step_one_check", device),
        graphs=check("graphs", __file__, "cuda_graphs_check", device),
        layouts=check("layouts", step_one_layouts.__file__, "step_one_layouts", layouts),
    )
    peak = args.peak_tflops * 1e12 if args.device == "cuda" else None
    destination = harness.default_results(args.results, args.device == "cuda", "RESULTS-gpu.md")

    def publish(results: dict, checked: dict, why_missing: str | None = None) -> None:
        """The report of what is known (`why_missing`: what a case or check not yet run says, the run going on)."""
        results, checked = dict(results), {name: dict(value) for name, value in checked.items()}
        for step in plan(args.device, args.first) if why_missing else ():
            if step[0] == "check":
                checked.setdefault(step[1], {"failed": why_missing})
            for case in step[3] if step[0] != "check" else ():
                results.setdefault((*step[1:3], case), dict(skipped=why_missing))
        checked["step_one"].setdefault("device_name", built["device_name"])
        cases = {" / ".join(key): record for key, record in results.items()}  # (model, loss, case)
        raw = dict(cases=cases, checks=checked)  # whatever the report does
        (work / "matrix-results.json").write_text(json.dumps(raw, default=str))
        report = render(results, checked, args.device, peak, time.perf_counter() - started, sys.argv[1:])
        harness.publish_run(report, destination)

    # after each step the report so far is written, so that a run cut off keeps what it measured
    so_far = functools.partial(publish, why_missing="not reached when this report was written (the run went on)")
    publish(*run_plan(work, args.device, ends, checks, args.first, after=so_far))


if __name__ == "__main__":
    main()
