"""Each process's peak private memory while a sharding engine loads a model: FSDP2 with and without
`fsdp_cpu_ram_efficient_loading`, DeepSpeed ZeRO-3 with and without `zero3_init_flag`.

    python benchmarks/bench_loading.py                       # FSDP2; writes its section of RESULTS-scale.md
    python benchmarks/bench_loading.py --engine deepspeed    # DeepSpeed ZeRO-3; writes its own section
    python benchmarks/bench_loading.py --quick               # the tiny model for the big one: checks the code path

Precompute and train in 2 CPU processes (gloo) on a random-weight Qwen2 (about 440M parameters, 1.7 GB float32) and
on a tiny one (the baseline); each run records every process's peak `RssAnon` (sampled every 10 ms; mmapped weights
are shared page cache, not counted). Goal, for a process that does not read the weights: its peak through loading at
most its shard + the largest tensor (received whole; under zero.Init the largest module) + the baseline, within 20%.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import harness

HEADING = "## Loading a sharded model: each process's peak memory"
HEADINGS = {"fsdp2": HEADING, "deepspeed": "## Loading a model under DeepSpeed ZeRO-3: each process's peak memory"}
DEEPSPEED_CONFIG = harness.HERE.parent / "configs" / "accelerate" / "deepspeed_zero3.yaml"
MIB = 1 << 20
# about 440M parameters: hidden 1024, 24 layers, a 32,000-token vocabulary (tied)
BIG = dict(hidden=1024, layers=24, heads=16, kv_heads=16, intermediate=4096, vocab=32000, max_position_embeddings=2048)
PRESETS = {"big": dict(BIG, rope_theta=1e6), "tiny": harness.TINY}  # main adds tie_word_embeddings=True
FSDP_ENV = dict(ACCELERATE_USE_CPU="1", ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_RESHARD_AFTER_FORWARD="true")
# No malloc variable: the sharding engines set glibc's mmap threshold themselves (without, the non-reading process's
# reference pass peaked at 2755 MiB, not 1533: runtime/engines/sharded.return_freed_buffers): what a user gets
FSDP_ENV |= harness.LAUNCH_ENV
GOAL = 1.2  # measured peak / bound
# training's state beyond the shard, in shards (engine prepared, optimizer step); STATE says what (DeepSpeed 0.19)
TRAIN_STATE = {"fsdp2": (0, 3), "deepspeed": (2, 5)}
LAUNCHES = {
    "fsdp2": "torchrun, 2 CPU processes (gloo), FSDP2 as configs/accelerate/fsdp.yaml exports it",
    "deepspeed": "accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml --zero3_init_flag "
    "true|false, 2 CPU processes (gloo, DeepSpeed's CPU accelerator), float32 (--no-bf16)",
}
READERS = {  # who reads the weights, without and with the engine's one-reader loading
    "fsdp2": ("every process", "the main process only"),
    "deepspeed": ("every process (zero3_init_flag false)", "the main process only (zero3_init_flag true)"),
}
STATE = {
    "fsdp2": "3 x the shard in training: a gradient and two AdamW moments per parameter of the shard",
    "deepspeed": "in training 2 x the shard up front, DeepSpeed's float32 master copy and gradient partition, 5 x at "
    "the step, with the gradient flattened anew and two AdamW moments (benchmarks/checks/deepspeed_step_memory.py, "
    "in git at 00274f3)",
}


def weights(model_dir: Path) -> dict[str, float]:
    """The model's float32 bytes in MiB: all of it, and its largest tensor."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        sizes = [4 * math.prod(f.get_slice(key).get_shape()) for key in f.keys()]
    return {"total_mib": sum(sizes) / MIB, "largest_mib": max(sizes) / MIB, "parameters": sum(sizes) // 4}


def measure(work: Path, model: Path, data: Path, engine: str, one_reader: bool) -> dict[str, list[dict]]:
    """Each process's peaks in both stages, from scratch, the weights read by the main process only or by all."""
    tag = f"{engine}-{model.name}-{'main-reads' if one_reader else 'all-read'}"
    flag = str(one_reader).lower()
    if engine == "fsdp2":
        env, launcher, flags = {**FSDP_ENV, "FSDP_CPU_RAM_EFFICIENT_LOADING": flag}, harness.TORCHRUN, []
    else:  # on DeepSpeed's own CPU accelerator (accelerate's CPU mode would drop it), in float32 as FSDP2's runs
        launcher = ["accelerate.commands.launch", "--config_file", str(DEEPSPEED_CONFIG), "--num_processes", "2"]
        env, launcher, flags = harness.LAUNCH_ENV, [*launcher, "--zero3_init_flag", flag], ["--no-bf16"]
    cache, run = work / "runs" / f"cache-{tag}", work / "runs" / f"train-{tag}"
    for old in (cache, run):  # an existing cache of the same settings would not be recomputed
        shutil.rmtree(old, ignore_errors=True)
    pre = ["precompute", "--model", str(model), "--dataset", str(data), "--output", str(cache), "--max-length", "64"]
    train = ["train", "--cache", str(cache), "--output-dir", str(run), "--overwrite-output-dir", "--max-steps", "1"]
    train += ["--per-device-train-batch-size", "2", "--save-steps", "0"]
    for stage in (pre, train):  # launched with only the launch variables of `env`
        cmd = [sys.executable, "-m", *launcher, "-m", "kto_pipeline", *stage, *flags]
        log = work / f"{stage[0]}-{tag}.log"
        with open(log, "w") as out:
            proc = subprocess.run(cmd, env=harness.launch_env(env), stdout=out, stderr=subprocess.STDOUT)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    pre_peaks = json.loads((cache / "manifest.json").read_text())["timing"]["peak_memory"]
    return {"precompute": pre_peaks, "train": json.loads((run / "trainer_state.json").read_text())["peak_memory"]}


def render(measured: dict, sizes: dict, args, seconds: float) -> str:
    shard, largest = sizes["total_mib"] / 2, sizes["largest_mib"]
    options = (" --engine deepspeed" if args.engine == "deepspeed" else "") + (" --quick" if args.quick else "")
    lines = [
        HEADINGS[args.engine] + "\n",
        *harness.provenance(f"`python benchmarks/bench_loading.py{options}`", seconds),
        f"- model: a random-weight Qwen2, {sizes['parameters'] / 1e6:.0f}M parameters, {sizes['total_mib']:.0f} MiB "
        f"in float32 (safetensors); its largest tensor {largest:.0f} MiB; one process's shard {shard:.0f} MiB",
        f"- launch: {LAUNCHES[args.engine]}, no environment variable (the engine sets glibc's mmap threshold, "
        "runtime/engines/sharded.return_freed_buffers); precompute "
        "of 16 rows, then train 1 step (batch 2 x 2 processes, AdamW). Figure: each process's peak private memory "
        "(RssAnon, MiB) through loading and the stage; baseline: a tiny model (2 layers, hidden 64), same launch\n",
        *harness.table_head(
            "| stage | weights read by | process | loading: baseline (MiB) | loaded (MiB) | bound (MiB) | "
            "loaded / bound | stage: baseline (MiB) | peak (MiB) | bound (MiB) | peak / bound |"
        ),
    ]
    for stage in ("precompute", "train"):
        upfront, extra = (n * shard for n in TRAIN_STATE[args.engine]) if stage == "train" else (0.0, 0.0)
        for one_reader in (False, True):
            for m, base in zip(measured["big", one_reader][stage], measured["tiny", one_reader][stage], strict=True):
                reader = not one_reader or m["rank"] == 0
                loading_bound = base["loaded_host_private_mib"] + shard + largest + upfront
                stage_bound = base["host_private_mib"] + shard + largest + extra
                loaded = m["loaded_host_private_mib"] / loading_bound
                goal = "" if reader else f" (goal <= 1.2: {'met' if loaded <= GOAL else 'NOT met'})"
                lines.append(
                    f"| {stage} | {READERS[args.engine][one_reader]} | {m['rank']}{' (reads)' if reader else ''} | "
                    f"{base['loaded_host_private_mib']:.0f} | {m['loaded_host_private_mib']:.0f} | "
                    f"{loading_bound:.0f} | {loaded:.2f}{goal} | {base['host_private_mib']:.0f} | "
                    f"{m['host_private_mib']:.0f} | {stage_bound:.0f} | {m['host_private_mib'] / stage_bound:.2f} |"
                )
    upfront = TRAIN_STATE[args.engine][0]
    lines += [
        "",
        "loaded: the peak until the engine had loaded and placed the model (read, then sharded or partitioned), "
        "before any batch; bound = that baseline + the shard + the largest "
        f"tensor{f' (+ {upfront} x the shard in training)' if upfront else ''}; the goal is for a process not reading "
        "the weights. peak: the stage's; bound = its baseline + the shard + the largest tensor (+ "
        f"{STATE[args.engine]}); what a pass adds beyond (gathered layers, activations) is read below the table.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = harness.script_parser(__doc__, results="file to update", default=str(harness.HERE / "RESULTS-scale.md"))
    parser.add_argument("--quick", action="store_true", help="the tiny model in place of the big one")
    parser.add_argument("--engine", choices=sorted(HEADINGS), default="fsdp2", help="FSDP2 or DeepSpeed ZeRO-3")
    args = parser.parse_args()
    work = Path(args.work) / "loading"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = [
        {"prompt": f"Question {i}: what is {i} + {i}?", "completion": f" It is {2 * i}.", "label": bool(i % 2)}
        for i in range(16)
    ]
    data, measured = harness.write_jsonl(work / "data.jsonl", rows), {}
    for name in ("big", "tiny"):
        model = work / f"model-{name}"
        harness.random_qwen2(model, dict(PRESETS["tiny" if args.quick else name], tie_word_embeddings=True))
        for one_reader in (False, True):
            print(f"  {name} model, weights read by {'the main process' if one_reader else 'every process'} ...")
            measured[name, one_reader] = measure(work, model, data, args.engine, one_reader)
    report = render(measured, weights(work / "model-big"), args, time.perf_counter() - started)
    harness.publish(report, None if args.quick else args.results, HEADINGS[args.engine])


if __name__ == "__main__":
    main()
