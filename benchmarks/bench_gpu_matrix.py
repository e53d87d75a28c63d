"""`make bench-gpu`: the GPU matrix in one bounded run (8 minutes by default).

    python benchmarks/bench_gpu_matrix.py                          # `make bench-gpu`: a CUDA GPU, RESULTS-gpu.md
    python benchmarks/bench_gpu_matrix.py --device cpu             # the code path on a CPU, tiny shapes (~3 min)

For Qwen2-0.5B and a ~1.5B shape (Qwen2-1.5B's, at max_length 2048 with HH lengths), KTO against trl.KTOTrainer and
the `sigmoid` pair loss against trl.DPOTrainer, at batch 8 and 64: kto-pipeline's training compiled (without, then with
CUDA graphs) and eager, trl precomputed with and without liger's fused loss: each case's step time, MFU and peak
memory, each tool's reference pass, the goals. Checks first: the default path's step-1 rewards must be exactly 0, CUDA
graphs must give the compiled run's numbers, and `step_one_layouts.py` says what moves a sequence's log-prob. Also:
where a compiled step's time goes (torch.profiler), and which reference pass setting pays.

A budget keeps it within 8 minutes (--budget-s 480, building and the checks included); the run goes in the order of
what answers the goals (`plan`; `--first` moves a goal first, after a run whose budget ended before it), one process
a tool, model and loss. Every case is written down the moment it ends; what the budget leaves no time for is reported
as not run, never guessed; a case out of memory says so and the rest go on. Model and data: `gpu_harness.py`'s. On a
CPU the compiled cases compile with torch's aot_eager backend (`CPU_BACKEND`)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import gpu_harness
import harness
import step_one_layouts
import torch
from gpu_harness import BETA, LEARNING_RATE, PEAK_FLOPS_CUDA, Flops, pairs

HEADING = "# GPU matrix: `make bench-gpu`"
MODELS = {"cuda": ("qwen2-0.5b", "qwen2-1.5b"), "cpu": ("tiny",)}
BATCHES = {"cuda": (8, 64), "cpu": (4,)}  # a CPU run checks the code path
LOSSES, TOOLS = ("kto", "sigmoid"), ("ours", "trl")
STEPS = {"qwen2-0.5b": 8, "qwen2-1.5b": 6, "tiny": 3}
# every tool's cases of the ~1.5B shape recompute activations: without, ours at batch 64 (~20k tokens) needs 91 GiB
# (`estimate-memory`, 64 rows x 320 tokens: 74 GiB of activations), 26 GiB with
CHECKPOINTING = {"qwen2-1.5b": True}
# a group's cases in order: (column, ours' compile options | trl's use_liger_kernel); CUDA graphs last (a failure
# while recording a graph can leave the device unusable)
OURS = {"kto-pipeline compiled": dict(torch_compile=True), "kto-pipeline eager": dict(torch_compile=False)}
OURS["kto-pipeline CUDA graphs"] = dict(torch_compile_mode="reduce-overhead")  # static shapes implied
TRL = {"trl precomputed": False, "trl precomputed + liger": True}
COMPILED = ("kto-pipeline compiled", "kto-pipeline CUDA graphs")  # ours' best of these against trl's best
COLUMNS = (*OURS, *TRL)
# a compiled case's attention: on a CPU the dense mask (by tree, a compiled graph unrolls the trees)
COMPILED_ATTENTION = {"cuda": "auto", "cpu": "dense"}
# where a compiled step's time goes: KTO on the first model at the smallest batch, a run of 5 steps minus one of 2
PROFILED, PROFILED_STEPS = "kto-pipeline compiled, profiled", (2, 5)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# the host waiting for the device (`.item()`, a copy to the host): while it waits, no launch runs ahead
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cuStreamSynchronize")
REFERENCE = "kto-pipeline reference pass"  # ours' first case of a (model, loss): the cache its training cases read
# the first model's KTO reference pass again (the control), then with one setting changed: which pays on the device
VARIANTS = {"again": {}, "dense mask": dict(attention_kernel="dense"), "--static-shapes": dict(static_shapes=True)}
VARIANTS["--torch-compile"] = dict(torch_compile=True)
# case -> (its cache's folder, the settings changed)
REFERENCE_VARIANTS = {f"{REFERENCE}, {k}": (f"cache-{k.lstrip('-').replace(' ', '-')}", v) for k, v in VARIANTS.items()}
STEP_ONE_ROWS, STEP_ONE_BATCH = 64, 8  # the step-1 check: the first model's first KTO rows, one step of a batch
STEP_ONE_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl")
GRAPHS_EQUAL = 1e-3  # CUDA graphs' numbers against the run without them: the parity tests' tolerance
GOALS = dict(speedup=1.5, memory=0.5, mfu=0.40, mfu_tokens=16384)
BUDGET_S, STARTS_UNTIL = 480, 60  # the run's seconds; no case starts in its last STARTS_UNTIL
CHECK_S = {"cuda": dict(step_one=150, graphs=120, layouts=90), "cpu": {}}  # at most: the cases keep most of the budget
FIRST = ("speed", "large", "graphs", "pairs", "step_one")  # `--first`: a goal's steps first (`plan`)
# a CPU run's compiler: traced as on a GPU, no kernels generated (136 s from an empty compile cache, 321 s inductor)
CPU_BACKEND = "aot_eager"
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1"}  # a CPU run's workers


def preset_of(model: str, loss: str, device: str) -> dict:
    """harness.GPU_PRESETS' preset of `model`, for `loss`, with the rows the largest batch trains."""
    steps, batch = STEPS[model], max(BATCHES[device])
    return dict(harness.GPU_PRESETS[model], loss_type=loss, steps=steps, batch=batch, rows=steps * batch)


def compile_notes(compiled: dict) -> str:
    """What a compiled case's record (trainer_state.json's or the manifest's `compile`) says ran eagerly."""
    text = " (ran eagerly: compiling failed)" if compiled.get("eager_fallback") else ""
    return text + (" (some shapes eagerly: past the recompile limit)" if compiled.get("recompile_limit") else "")


def case_name(column: str, batch: int) -> str:
    return f"{column} @ {batch}"


def group_cases(tool: str, device: str) -> list[str]:
    """The cases a group (one tool, one model, one loss) measures, in order."""
    columns = OURS if tool == "ours" else TRL
    return ([REFERENCE] if tool == "ours" else []) + [case_name(c, b) for c in columns for b in BATCHES[device]]


def not_on(device: str) -> dict[str, str]:
    """The cases `device` does not run, with why: a CPU has no CUDA graphs (their check runs their mode)."""
    why = "skipped: a CPU has no CUDA graphs (the CUDA graphs check above ran their mode)"
    return {case_name(COMPILED[1], batch): why for batch in BATCHES[device]} if device == "cpu" else {}


def plan(device: str, first: str | None = None) -> list[tuple]:
    """The run's steps, `("check", name)` or `(tool, model, loss, cases)` (one process), each case once: the MFU goal
    (the last model's reference pass, its compiled step at the largest batch), the pair loss, the step-1 check, CUDA
    graphs (check, then cases), the speed and memory goals (KTO on the first model, profiled after its compiled step),
    the layouts, the reference pass's variants, then the rest. `first` (one of FIRST) puts its goal first."""
    first_model, batches, (compiled, graphs) = MODELS[device][0], BATCHES[device], COMPILED
    trl = {loss: ("trl", first_model, loss, group_cases("trl", device)) for loss in LOSSES}
    ours = [REFERENCE, *(case_name(compiled, b) for b in batches)]
    goals = {
        "large": [("ours", MODELS[device][-1], "kto", [REFERENCE, case_name(compiled, max(batches))])],
        "pairs": [("ours", first_model, "sigmoid", ours), trl["sigmoid"]],
        "step_one": [("check", "step_one")],
        "graphs": [("check", "graphs"), ("ours", first_model, "kto", [case_name(graphs, b) for b in batches])],
        "speed": [("ours", first_model, "kto", list(ours)), trl["kto"]],
    }
    order = sorted(goals, key=lambda goal: goal != first)  # (a stable sort: the others in their order)
    wanted = [step for goal in order for step in goals[goal]] + [("check", "layouts")]
    # the profiled steps right after the compiled case they profile, in its process (its graphs compiled)
    anchor = case_name(compiled, batches[0])
    cases = next(step[3] for step in wanted if step[1:3] == (first_model, "kto") and anchor in step[3])
    cases.insert(cases.index(anchor) + 1, case_name(PROFILED, batches[0]))
    wanted.append(("ours", first_model, "kto", list(REFERENCE_VARIANTS)))
    wanted += [(tool, m, loss, group_cases(tool, device)) for loss in LOSSES for m in MODELS[device] for tool in TOOLS]
    steps, planned = [], set()
    for step in wanted:
        if step[0] == "check":
            steps.append(step)
        elif cases := [c for c in step[3] if (*step[:3], c) not in planned and c not in not_on(device)]:
            planned.update((*step[:3], case) for case in cases)
            steps.append((*step[:3], cases))
    return steps


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
        self.write(dict(case=name, **result))  # (what it left is freed by the next case's reset_peak_memory)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        status = "started" if "started" in record else record.get("skipped") or "done"
        print(f"  {record['case']}: {status}", flush=True)


def ours_group(where: Path, model: str, loss: str, device: str, cases: Cases, wanted: list[str]) -> None:
    """The `wanted` cases of ours: the reference pass (its cache for the group's training cases), REFERENCE_VARIANTS,
    the profiled steps, a setting of OURS at a batch."""
    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.cache import open_cache

    preset, cache_dir, folder = preset_of(model, loss, device), where / "ours-cache", cases.path.parent
    ml, steps = preset["max_length"], preset["steps"]

    def lengths(table, n: int | None = None) -> list[list[int]]:  # of the first n rows (None: every row)
        return gpu_harness.pair_lengths(where, n) if pairs(preset) else gpu_harness.row_lengths(table.slice(0, n), ml)

    def reference(output: Path = cache_dir, **changed) -> dict:
        paths = dict(model=str(where / "model"), dataset=str(where / "data.jsonl"), output=str(output))
        dtype = "bfloat16" if device == "cuda" else "float32"
        config = PrecomputeConfig(**paths, overwrite=True, max_length=ml, dtype=dtype)
        if changed.get("torch_compile"):
            changed = dict(changed, attention_kernel=COMPILED_ATTENTION[device])
        cache = open_cache(precompute(dataclasses.replace(config, pairs_only=pairs(preset), **changed)))
        timing, rows = cache.manifest.timing, lengths(cache.table)
        ref = dict(ref_seconds=timing["reference_pass_seconds"], ref_lengths=rows, compile=timing.get("compile"))
        return dict(ref, ref_peak_mib=gpu_harness.peak_memory_mib(device))

    def step(column: str, compiling: dict, batch: int) -> dict:
        out = folder / f"run-{batch}-{column.split(' ', 1)[1].replace(' ', '-')}"
        res = train(ours_config(cache_dir, out, model, loss, device, batch, steps, **compiling))
        state, rows = harness.trainer_state(out) or {}, lengths(open_cache(cache_dir).table, steps * batch)
        measured = dict(step_seconds=res.step_seconds, train_peak_mib=gpu_harness.peak_memory_mib(device))
        kept = {key: state.get(key) for key in ("compile", "kl_forward")}
        return dict(measured, train_lengths=rows, kernel=state.get("attention_kernel"), **kept)

    settings_of = {case_name(c, b): (c, compiling, b) for c, compiling in OURS.items() for b in BATCHES[device]}
    for case in wanted:
        if case == REFERENCE:
            cases.run(REFERENCE, reference)
        elif case in REFERENCE_VARIANTS:
            output, changed = REFERENCE_VARIANTS[case]
            torch._dynamo.reset()
            cases.run(case, functools.partial(reference, folder / output, **changed))
        elif case.startswith(PROFILED):  # (no dynamo reset: the graphs the compiled cases compiled)
            batch = int(case.rsplit(" @ ", 1)[1])
            cases.run(case, functools.partial(profiled_steps, cache_dir, folder, model, loss, device, batch))
        elif "torch_compile_mode" in settings_of[case][1] and CHECKPOINTING.get(model, False):
            cases.write(
                dict(case=case, skipped="no CUDA graphs under gradient checkpointing (the mode compiles without them)")
            )
        else:
            torch._dynamo.reset()  # each case compiles from its own first step, as a fresh run would
            cases.run(case, functools.partial(step, *settings_of[case]))


def ours_config(cache: Path, out: Path, model: str, loss: str, device: str, batch: int, steps: int, **compiling):
    """The TrainConfig of ours' case: `steps` steps at `batch`, bf16 on a GPU, `compiling` its compile options."""
    settings = dict(batch=batch, steps=steps, learning_rate=LEARNING_RATE, bf16=device == "cuda")
    settings |= dict(beta=BETA, loss_type=loss, save_steps=0, **compiling)
    if any(compiling.values()):  # compiled, with or without CUDA graphs
        settings["attention_kernel"] = COMPILED_ATTENTION[device]
    config = harness.ours_train_config(cache, out, **settings)
    return dataclasses.replace(config, gradient_checkpointing=CHECKPOINTING.get(model, False))


def profiled_steps(cache_dir: Path, out: Path, model: str, loss: str, device: str, batch: int) -> dict:
    """Per step of a compiled run under torch.profiler (PROFILED_STEPS): the wall, `profile_counts`, the longest
    kernels, and the graphs compiled anew (0: the compiled cases' served, the dynamo cache kept)."""
    from torch.profiler import ProfilerActivity, profile

    from kto_pipeline import train

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    runs = {}
    for steps in PROFILED_STEPS:
        where = out / f"run-{batch}-profiled-{steps}"
        with profile(activities=activities) as prof:
            res = train(ours_config(cache_dir, where, model, loss, device, batch, steps, torch_compile=True))
        compiled = (harness.trainer_state(where) or {}).get("compile") or {}
        runs[steps] = dict(profile_counts(prof), wall=sum(res.step_seconds), graphs=compiled.get("graphs", 0))
    few, many = (runs[n] for n in PROFILED_STEPS)
    n = PROFILED_STEPS[1] - PROFILED_STEPS[0]
    counted = ("wall", "device_s", "kernels_run", "launches", "graph_launches", "syncs", "ops")
    kernels = {name: (t - few["kernels"].get(name, 0.0)) / n for name, t in many["kernels"].items()}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:5]
    per_step = {k: (many[k] - few[k]) / n for k in counted}
    graphs = few["graphs"] + many["graphs"]
    return dict(profiled=per_step, top_kernels=top, steps=list(PROFILED_STEPS), graphs_compiled=graphs)


def profile_counts(prof) -> dict:
    """A profile's totals: the GPU's seconds (by kernel name), the kernels run (copies and memsets apart), launches,
    CUDA graph launches, the host's waits, aten ops. Annotated ranges (inductor's `## Call CompiledFxGraph ##`, the
    optimizer's step) span the kernels they hold: left out, as torch's own tables do."""
    from torch.autograd import DeviceType

    events, kernels, run = prof.events(), {}, 0
    for event in events:
        if event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e6
            run += not event.name.startswith(("Memcpy", "Memset"))
    cpu = [e.name for e in events if e.device_type == DeviceType.CPU]
    named = dict(launches=LAUNCHES, graph_launches=("cudaGraphLaunch",), syncs=SYNCS)
    counts = {key: sum(name in names for name in cpu) for key, names in named.items()}
    ops = sum(name.startswith("aten::") for name in cpu)
    return dict(counts, device_s=sum(kernels.values()), kernels=kernels, kernels_run=run, ops=ops)


def trl_group(where: Path, model: str, loss: str, device: str, cases: Cases, wanted: list[str]) -> None:
    """The `wanted` cases of trl (liger last: it patches the model's module for good), each at its batch: its reference
    pass (in the constructor), then the steps, on the rows that batch trains."""
    from trl import DPOTrainer, KTOTrainer

    preset, timing, sync = preset_of(model, loss, device), {}, torch.cuda.synchronize if device == "cuda" else None
    ml, steps = preset["max_length"], preset["steps"]

    def record(seconds: float, *args, **kwargs) -> None:
        timing.update(ref_seconds=seconds)

    harness.time_calls(DPOTrainer if pairs(preset) else KTOTrainer, "_precompute_ref_logps", record, synchronize=sync)
    no_liger = (
        None if device == "cuda" else f"skipped: liger-kernel's Triton kernels need a CUDA GPU (device is {device})"
    )
    if not no_liger and importlib.util.find_spec("liger_kernel") is None:
        no_liger = "skipped: liger-kernel is not installed (`pip install liger-kernel`)"
    lines = (where / "data.jsonl").read_text().splitlines(keepends=True)

    def step(batch: int, liger: bool, data: Path, out: Path) -> dict:
        timing.clear()
        run = dict(batch=batch, max_length=ml, precompute=True, bf16=device == "cuda", max_steps=steps)
        run |= dict(beta=BETA, learning_rate=LEARNING_RATE, use_liger_kernel=liger, precompute_ref_batch_size=batch)
        run |= dict(gradient_checkpointing=CHECKPOINTING.get(model, False), train_sampling_strategy="sequential")
        run |= dict(pairs=True, loss_type=[loss]) if pairs(preset) else {}
        trainer = harness.trl_trainer(where / "model", data, out, **run, **harness.TRL_RUN)
        n, kl = steps * batch, "KL_completion_ids"
        rows = trainer.train_dataset[:n]
        lengths = gpu_harness.pair_lengths(where, n) if pairs(preset) else gpu_harness.row_lengths(rows, ml, kl)
        ref = dict(timing, ref_lengths=lengths, ref_peak_mib=gpu_harness.peak_memory_mib(device))
        timer = harness.step_timer(synchronize=sync)
        trainer.add_callback(timer)
        gpu_harness.reset_peak_memory(device)
        trainer.train()
        peak = gpu_harness.peak_memory_mib(device)
        return dict(ref, step_seconds=timer.times, train_peak_mib=peak, train_lengths=lengths)

    settings_of = {case_name(column, b): (b, liger) for column, liger in TRL.items() for b in BATCHES[device]}
    for case in wanted:
        batch, liger = settings_of[case]
        kind = "liger" if liger else "plain"
        data, out = cases.path.parent / f"data-{batch}-{kind}.jsonl", cases.path.parent / f"trl-{batch}-{kind}"
        data.write_text("".join(lines[: steps * batch]))  # a file of its own: no reused reference
        if liger and no_liger:
            cases.write(dict(case=case, skipped=no_liger))
        else:
            cases.run(case, functools.partial(step, batch, liger, data, out))


def cuda_graphs_check(work: Path, device: str) -> dict:
    """CUDA graphs (`--torch-compile-mode reduce-overhead`) against the compiled run without them, before any is
    timed: a tiny Qwen2 in static shapes, 2 micro-batches a step, an evaluation every 2 steps (where graph outputs could
    be overwritten). The logged numbers' largest relative difference, and what ran without CUDA graphs."""
    from kto_pipeline import PrecomputeConfig, precompute, train

    where, preset = work / "cuda-graphs-check", dict(harness.GPU_PRESETS["tiny"], loss_type="kto", rows=32)
    harness.random_qwen2(where / "model", preset, device=device)
    gpu_harness.build_data(where / "data.jsonl", preset)
    paths = dict(model=str(where / "model"), dataset=str(where / "data.jsonl"), output=str(where / "cache"))
    settings = dict(attention_kernel=COMPILED_ATTENTION[device], static_shapes=True)
    dtype = "bfloat16" if device == "cuda" else "float32"
    # the cache both runs read, scored eagerly: what is compared is training (one cold compile fewer)
    config = PrecomputeConfig(**paths, overwrite=True, max_length=preset["max_length"], dtype=dtype, **settings)
    cache = precompute(dataclasses.replace(config, torch_compile=False))
    logged, compiled = {}, {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        out = where / f"run-{mode}"
        run = dict(settings, torch_compile=True, torch_compile_mode=mode, gradient_accumulation_steps=2)
        run |= dict(eval_cache=str(cache), eval_steps=2, save_steps=0, bf16=device == "cuda")
        train(harness.ours_train_config(cache, out, batch=2, steps=4, learning_rate=LEARNING_RATE, **run))
        logged[mode] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        compiled[mode] = (harness.trainer_state(out) or {}).get("compile")

    def compared(row: dict, key: str) -> bool:  # a logged number, not a time or the schedule
        return isinstance(row.get(key), float) and key not in ("epoch", "learning_rate") and not key.endswith("seconds")

    pairs_of = [(a[k], b[k]) for a, b in zip(*logged.values(), strict=True) for k in a if compared(a, k)]
    # relative, but to at least 1e-3: a value near 0 (step 1's rewards, a KL clamped at 0) is held to 1e-6 apart
    worst = max((abs(a - b) / max(abs(a), abs(b), 1e-3) for a, b in pairs_of), default=None)
    return dict(values=len(pairs_of), max_rel_diff=worst, compile=compiled["reduce-overhead"])


def step_one_check(work: Path, device: str) -> dict:
    """The default path (attention "auto", compiled on a GPU, bf16 autocast there) in both stages, then one step: at
    step 1 the policy is the reference, so its rewards and KL are 0 where both stages compute each sequence alike."""
    from kto_pipeline import PrecomputeConfig, precompute, train

    model, where = MODELS[device][0], work / "step-one-check"
    source, data = work / f"{model}-kto", where / "data.jsonl"
    where.mkdir(parents=True, exist_ok=True)
    data.write_text("".join((source / "data.jsonl").read_text().splitlines(keepends=True)[:STEP_ONE_ROWS]))
    common = dict(bf16=device == "cuda", attention_kernel="auto", torch_compile=device == "cuda")
    paths = dict(model=str(source / "model"), dataset=str(data), output=str(where / "cache"), overwrite=True)
    cache = precompute(PrecomputeConfig(**paths, max_length=harness.GPU_PRESETS[model]["max_length"], **common))
    settings = dict(batch=STEP_ONE_BATCH, steps=1, learning_rate=LEARNING_RATE, beta=BETA, **common)
    train(harness.ours_train_config(cache, where / "run", **settings))
    first = json.loads((where / "run" / "metrics.jsonl").read_text().splitlines()[0])
    manifest, state = json.loads((cache / "manifest.json").read_text()), harness.trainer_state(where / "run")
    kernels = f"{manifest['reference_pass'].get('attention_kernel')} / {state.get('attention_kernel')}"
    return dict(step_one={k: first[k] for k in STEP_ONE_KEYS}, kernel=kernels, precision=state.get("precision"))


def worker(name: str, work: Path, device: str, out: Path, deadline: float, wanted: list[str]) -> dict:
    """`STEP_TOOL_MODEL_LOSS`: that group's `wanted` cases, into OUT/cases.jsonl; a check by its function's name;
    `build`: every model and data set (so that the driver holds no GPU memory)."""
    if name == "build":
        for model in MODELS[device]:
            shared = work / f"{model}-model"  # one a shape (on the GPU where there is one), for both losses
            harness.random_qwen2(shared, harness.GPU_PRESETS[model], device=device)
            for loss in LOSSES:  # a (model, loss)'s folder: the model and that loss's data
                where = work / f"{model}-{loss}"
                where.mkdir(parents=True, exist_ok=True)
                if not (where / "model").exists():
                    (where / "model").symlink_to(shared.resolve(), target_is_directory=True)
                gpu_harness.build_data(where / "data.jsonl", preset_of(model, loss, device))
        cpu = f"{harness.cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
        return dict(device_name=torch.cuda.get_device_name(0) if device == "cuda" else cpu)
    checks = dict(cuda_graphs_check=cuda_graphs_check, step_one_check=step_one_check)
    if name in checks:
        return harness.measured(lambda: checks[name](work, device), rss=False)
    _, tool, model, loss = name.split("_")
    cases, group = Cases(out, deadline, device), ours_group if tool == "ours" else trl_group

    def run() -> dict:
        group(work / f"{model}-{loss}", model, loss, device, cases, wanted)
        return dict(cases=str(cases.path))

    return harness.measured(run, rss=False)


# ------------------------------------------------------------------------------------------ the report


def median(res: dict) -> float:
    """A case's median step: steps 2..n, leaving out those that compiled (`harness.median_step`)."""
    return harness.median_step(res["step_seconds"], harness.compiling_steps(res))


def mfu(flops: Flops, res: dict, batch: int, peak: float | None) -> float | None:
    """Model FLOPs of a step (the mean over steps 2..n) over the median step's time, against `peak` (None on a CPU)."""
    times = res["step_seconds"]
    if peak is None or len(times) < 2:
        return None
    return flops.train(res["train_lengths"][batch:]) / (len(times) - 1) / median(res) / peak


def missing(res: dict | None, key: str) -> str | None:
    """Why a case's record has no `key` measured (not run, its reason, stopped while running); None where it has."""
    if res is None:
        return "not run within the budget"
    if key in res:
        return None
    return res.get("skipped") or ("stopped at the budget's end while running" if "started" in res else "-")


def cell(res: dict | None, flops: Flops, batch: int, peak: float | None) -> str:
    if why := missing(res, "step_seconds"):
        return why
    value, compiled = mfu(flops, res, batch, peak), res.get("compile") or {}
    text = f"{median(res):.4f} s" + (f", {value:.1%} MFU" if value is not None else "")
    compiled_steps, timed = harness.steps_compiling(res["step_seconds"], harness.compiling_steps(res))
    if compiled_steps:
        left = "every timed step compiled" if compiled_steps == timed else f"{compiled_steps} compiling left out"
        text += f" (steps 2..{timed + 1}: {left})"
    text += compile_notes(compiled)
    if skips := compiled.get("cudagraph_skips"):
        text += f" ({skips} graph(s) without CUDA graphs)"
    if peak is not None and compiled.get("cudagraph_recorded_inputs") == 0:  # (a GPU's CUDA graphs case)
        text += " (no CUDA graph recorded)"
    return f"{text}, {res['train_peak_mib']:,.0f} MiB"


def kl_forward_lines(results: dict) -> list[str]:
    """How ours ran the KL completions under gradient checkpointing (trainer_state.json's `kl_forward`), per model."""
    seen: dict[str, set] = {}
    for (model, _, _), res in results.items():
        if CHECKPOINTING.get(model) and isinstance(res, dict) and res.get("kl_forward"):
            seen.setdefault(model, set()).add(res["kl_forward"])
    lines = [f"ours' KL forward under gradient checkpointing, {m}: {'; '.join(sorted(k))}" for m, k in seen.items()]
    return lines + ([""] if seen else [])


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
    text += f"; graphs run without CUDA graphs: {compiled.get('cudagraph_skips')}"
    text += " (a CPU has none)" if device == "cpu" else ""
    if device == "cuda":  # (a skip can go uncounted; a recorded graph cannot)
        recorded = compiled.get("cudagraph_recorded_inputs")
        text += f"; CUDA graphs recorded: {'yes' if recorded else 'NONE'} ({recorded} inputs of recorded graphs)"
    reasons, sizes = compiled.get("cudagraph_skip_reasons"), compiled.get("cudagraph_sizes")
    text += f" ({'; '.join(reasons)})" if reasons else ""
    return text + (f"; graphs recorded for up to {sizes} sizes" if sizes else "")


def ours_compiled(got: dict) -> dict | None:
    """kto-pipeline's faster compiled case that ran (with or without CUDA graphs): its result."""
    return min((got[c] for c in COMPILED if got.get(c) and "step_seconds" in got[c]), key=median, default=None)


def goal_lines(model, loss, batch, got, ratio, flops, peak, tokens) -> list[tuple]:
    """The goals a row answers: speed-up and memory on Qwen2-0.5B (tiny on a CPU), MFU on the ~1.5B shape."""
    where, out, ours = f"{model}, {loss}, batch {batch}", [], ours_compiled(got)
    if model != "qwen2-1.5b":
        speedup = f"{ratio:.2f}x" if ratio else "-"
        out.append((f"step >= {GOALS['speedup']}x trl's best ({where})", speedup, ratio and ratio >= GOALS["speedup"]))
        trl = [got[c]["train_peak_mib"] for c in TRL if got.get(c) and "train_peak_mib" in got[c]]
        if ours and "train_peak_mib" in ours and trl:
            share, memory = ours["train_peak_mib"] / min(trl), f"peak memory <= {GOALS['memory']}x trl's best ({where})"
            out.append((memory, f"{share:.2f}x", share <= GOALS["memory"]))
    elif tokens and tokens >= GOALS["mfu_tokens"] and ours and "step_seconds" in ours:
        value = mfu(flops, ours, batch, peak)
        shown = f"{value:.1%} at {tokens} tokens a step" if value is not None else "n/a"
        out.append((f"MFU >= {GOALS['mfu']:.0%} ({where})", shown, value is not None and value >= GOALS["mfu"]))
    return out


def reference_table(results: dict, device: str, flops: dict, peak: float | None) -> list[str]:
    """Needed tokens/s (and MFU on a GPU) of each tool's reference pass. `flops`: (model, loss) -> its Flops."""
    header = "| model | loss | kto-pipeline | " + " | ".join(f"trl precomputed @ {b}" for b in BATCHES[device])
    header += " | " + " | ".join(f"kto-pipeline, {label}" for label in VARIANTS) + " |"
    cases = [REFERENCE, *(case_name("trl precomputed", b) for b in BATCHES[device]), *REFERENCE_VARIANTS]

    def pass_cell(model: str, loss: str, case: str) -> str:
        res = results.get((model, loss, case))
        if case in REFERENCE_VARIANTS and (model, loss) != (MODELS[device][0], "kto"):
            return "-"  # measured for the first model's KTO data only
        if why := missing(res, "ref_seconds"):
            return why
        seconds, compiled = res["ref_seconds"], res.get("compile") or {}
        text = f"{sum(map(sum, res['ref_lengths'])) / seconds:,.0f}"
        if peak:
            text += f" ({flops[model, loss].reference(res['ref_lengths']) / seconds / peak:.1%} MFU)"
        if compiled:  # compiling the layers is part of the pass's seconds
            text += f", {compiled['seconds']:.0f} s of its {seconds:.0f} s compiling"
        return text + compile_notes(compiled)

    return harness.table(
        header, [(m, loss, *(pass_cell(m, loss, c) for c in cases)) for m in MODELS[device] for loss in LOSSES]
    )


def render(results: dict, checks: dict, device: str, peak: float | None, seconds: float, argv: list[str]) -> str:
    """The report: the checks, a row per (model, loss, batch), the reference passes, the goals (`peak`: FLOP/s)."""
    check, graphs, layouts = checks["step_one"], checks["graphs"], checks["layouts"]
    on = [m for m in MODELS[device] if CHECKPOINTING.get(m)]  # gradient checkpointing
    command = " ".join(["python benchmarks/bench_gpu_matrix.py", *argv])
    name = next((r.get("device_name") for r in [check, *results.values()] if r.get("device_name")), "unknown")
    steps = ", ".join(f"{m} {STEPS[m]} (max_length {harness.GPU_PRESETS[m]['max_length']})" for m in MODELS[device])
    lines = [
        HEADING,
        "",
        f"- command: `{command}`" + (" (`make bench-gpu`)" if device == "cuda" else ""),
        f"- date: {harness.utc_stamp()}; total time {seconds:.0f} s; device: {name} ({device})",
        f"- versions: {harness.versions('kto-pipeline', 'torch', 'transformers', 'trl')}",
        "- settings: random weights, random characters with HH-RLHF's lengths (gpu_harness.py's data); "
        + ("bf16 autocast over float32 weights in training, the reference pass in bf16 weights; " if peak else "")
        + "the same rows in order, AdamW lr 1e-06, beta 0.1; gradient checkpointing "
        + (f"on for {', '.join(on)} (every tool), off otherwise" if on else "off")
        + f"; steps: {steps}; a cell: the median step of steps 2..n (leaving out those that compiled, where others are "
        "left: trainer_state.json's compile.compiling_steps), its MFU (model FLOPs as gpu_harness.py counts them, "
        + (f"MFU against {peak / 1e12:g}e12 FLOP/s" if peak else "no MFU on a CPU")
        + "), peak memory"
        + ("" if peak else f"; compiled cases: torch.compile's {CPU_BACKEND} backend (no kernels generated)"),
        "",
        "## The default path's step-1 check",
        "",
    ]
    exact = check.get("step_one") and all(v == 0 for v in check["step_one"].values())
    values = ", ".join(f"{k} {v:.3g}" for k, v in check.get("step_one", {}).items())
    step_one = f"- kernel (precompute / train): {check.get('kernel')}; {values}: exactly 0: {'yes' if exact else 'NO'}"
    lines += [step_one if "step_one" in check else f"- failed: {check.get('failed', 'did not run')}"]
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
    for model, loss, batch in ((m, loss, b) for m in MODELS[device] for loss in LOSSES for b in BATCHES[device]):
        got = {c: results.get((model, loss, case_name(c, batch))) for c in COLUMNS}
        # needed tokens (P + C + K: each prompt once) a step, the mean over the trained steps
        lengths = next((r["train_lengths"] for r in got.values() if r and r.get("train_lengths")), None)
        tokens = round(sum(map(sum, lengths)) / max(len(lengths) // batch, 1)) if lengths else None
        cells = [cell(got[c], flops[model, loss], batch, peak) for c in COLUMNS]
        # trl's best step (the faster setting that ran) over kto-pipeline's best compiled one
        trl, ours = [median(got[c]) for c in TRL if got.get(c) and "step_seconds" in got[c]], ours_compiled(got)
        ratio = min(trl) / median(ours) if ours and trl else None
        rows.append((model, loss, batch, tokens or "-", *cells, f"{ratio:.2f}x" if ratio else "-"))
        goal_rows += goal_lines(model, loss, batch, got, ratio, flops[model, loss], peak, tokens)
    goal_rows.append(("step-1 rewards exactly 0 in bf16, the default path", "yes" if exact else "NO", bool(exact)))
    models = {m: flops[m, LOSSES[0]] for m in MODELS[device]}  # a model's N is the same for every loss
    lines += [
        *("", "## Training steps", "", *harness.table(header, rows), ""),
        "`x` > 1: kto-pipeline's faster compiled setting (with or without CUDA graphs) is faster than trl's best "
        "setting that ran (its fastest step).",
        "",
        *kl_forward_lines(results),
        *profiled_lines(results, device),
        *("", "## Reference passes: needed tokens/s", "", *reference_table(results, device, flops, peak), ""),
        "trl's at precompute_ref_batch_size = the batch; ours over the rows the largest batch trains, at its default "
        "settings, then (the first model's KTO data, in one process) again and with one setting changed: which pays "
        "on this device, against `again`. A block-mask pass's seconds include compiling FlexAttention's kernel"
        + ("; on a CPU the --torch-compile pass attends on the dense mask too." if device == "cpu" else "."),
        *("", "## Against the goals", "", *harness.goals_table(*goal_rows), ""),
        *("## Formula", "", *gpu_harness.formula(models, peak), ""),
    ]
    return "\n".join(lines)


def run_plan(work: Path, device: str, ends: float, checks: dict, first=None, after=None) -> tuple[dict, dict]:
    """`plan`'s steps, none started past `ends` - STARTS_UNTIL, every worker stopped at `ends` (`checks`: name -> a
    check, given the seconds left): (model, loss, case) -> its record or why not, and each check's result.
    `after(results, checked)`: called with what is known after each step."""
    deadline, checked, skipped = ends - STARTS_UNTIL, {}, not_on(device).items()
    results = {(m, loss, case): dict(skipped=why) for m in MODELS[device] for loss in LOSSES for case, why in skipped}
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
            env, timeout = CPU_ENV if device == "cpu" else {}, ends - time.time()
            res = harness.run_worker(Path(__file__), name, work, flags, env=env, must_succeed=False, timeout=timeout)
            if "failed" in res and not res["failed"].startswith("killed"):
                why = f"not run: its group's process failed ({res['failed'][:200]})"
        path = work / "runs" / name / "cases.jsonl"
        for record in map(json.loads, path.read_text().splitlines() if path.exists() else []):
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
        return harness.print_result(worker(args.name, work, args.device, Path(args.out), args.deadline, wanted))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch (use --device cpu)")
    started, ends = time.perf_counter(), time.time() + args.budget_s
    harness.fresh_runs(work)
    print(f"building the models and data in {work} ...", flush=True)
    env, device, first = CPU_ENV if args.device == "cpu" else {}, ["--device", args.device], MODELS[args.device][0]
    built = harness.run_worker(Path(__file__), "build", work, device, env=env)
    layouts = [*device, "--preset", first, "--model", str(work / f"{first}-model")]
    check_runs = dict(step_one=(__file__, "step_one_check", device), graphs=(__file__, "cuda_graphs_check", device))
    check_runs["layouts"] = (step_one_layouts.__file__, "step_one_layouts", layouts)

    def check(kind: str, left: float) -> dict:
        """A check in a process of its own, for at most its CHECK_S and the `left` seconds: its result, or why not."""
        script, name, flags = check_runs[kind]
        timeout = min(CHECK_S[args.device].get(kind, float("inf")), left)
        return harness.run_worker(Path(script), name, work, flags, env=env, must_succeed=False, timeout=timeout)

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
        (work / "matrix-results.json").write_text(json.dumps(dict(cases=cases, checks=checked), default=str))
        report = render(results, checked, args.device, peak, time.perf_counter() - started, sys.argv[1:])
        harness.publish_run(report, destination)

    # after each step the report so far is written, so that a run cut off keeps what it measured
    so_far = functools.partial(publish, why_missing="not reached when this report was written (the run went on)")
    checks = {kind: functools.partial(check, kind) for kind in check_runs}
    publish(*run_plan(work, args.device, ends, checks, args.first, after=so_far))


if __name__ == "__main__":
    main()
