"""What agreeing on a stop request costs a training step: one all-reduce of one integer per optimizer step.

    python benchmarks/bench_stop_check.py            # writes its section of RESULTS.md
    python benchmarks/bench_stop_check.py --quick    # the tiny model, 2 steps: checks the code path

`train` asks every process at each step boundary whether any of them received SIGTERM or SIGUSR1
(`runtime/preemption.StopRequests.agreed`), so that all stop at the same step. Under torchrun, 2 CPU processes
(gloo), each worker times that call alone, many times over, then trains the bench's random Qwen2 (`SIZES["full"]`,
DDP) for a few steps and takes the median step (the check included). The ratio is the check's share of a step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import (
    HERE,
    LAUNCH_ENV,
    SIZES,
    TINY,
    TORCHRUN,
    launch_env,
    provenance,
    publish,
    random_qwen2,
    script_parser,
    table_head,
    write_jsonl,
)

HEADING = "## Preemption: the cost of the per-step stop check"
CALLS = 2000


def rows(n: int) -> list[dict]:
    words = "the a sea ship storm harbour light keeper night wave".split()
    out = []
    for i in range(n):
        prompt = " ".join(words[(i * 7 + k) % len(words)] for k in range(40 + i % 50))
        completion = " ".join(words[(i * 3 + k) % len(words)] for k in range(20 + i % 40))
        out.append({"prompt": f"Q{i}: {prompt}?", "completion": f" {completion}.", "label": bool(i % 3)})
    return out


def worker(work: Path, steps: int) -> None:
    """Under torchrun: time the stop check, then precompute and train; rank 0 writes the measurements."""
    from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train
    from kto_pipeline.runtime.launch import process_state
    from kto_pipeline.runtime.preemption import StopRequests

    state = process_state(120)
    with StopRequests() as stop:
        for _ in range(50):  # warm-up: the group's first collectives
            stop.agreed(state.device)
        started = time.perf_counter()
        for _ in range(CALLS):
            stop.agreed(state.device)
        check = (time.perf_counter() - started) / CALLS
    cache = precompute(
        PrecomputeConfig(model=str(work / "model"), dataset=str(work / "data.jsonl"), output=str(work / "cache"))
    )
    result = train(
        TrainConfig(
            cache=str(cache),
            output_dir=str(work / "run"),
            overwrite_output_dir=True,
            per_device_train_batch_size=8,
            max_steps=steps,
            save_steps=0,
            logging_steps=steps,
        )
    )
    if state.is_main_process:
        seconds = sorted(result.step_seconds[1:] or result.step_seconds)  # the first step warms up
        median = seconds[len(seconds) // 2]
        out = dict(check_seconds=check, step_seconds=median, steps=len(result.step_seconds))
        out |= dict(processes=state.num_processes)
        (work / "result.json").write_text(json.dumps(out))


def main() -> None:
    parser = script_parser(__doc__, results="file to write the section into", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 steps")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    work = Path(args.work) / "stop-check"
    if args.mode == "worker":
        worker(work, args.steps)
        return
    started = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    for old in ("cache", "run"):  # measured from scratch
        shutil.rmtree(work / old, ignore_errors=True)
    (work / "result.json").unlink(missing_ok=True)
    shape = TINY if args.quick else {k: v for k, v in SIZES["full"].items() if k in TINY or k == "tie_word_embeddings"}
    random_qwen2(work / "model", shape)
    write_jsonl(work / "data.jsonl", rows(64))
    steps = 2 if args.quick else args.steps
    cmd = [sys.executable, "-m", *TORCHRUN, __file__, "worker", "--work", str(args.work), "--steps", str(steps)]
    proc = subprocess.run(cmd, env=launch_env(LAUNCH_ENV), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the workers failed:\n{proc.stderr[-4000:]}")
    m = json.loads((work / "result.json").read_text())
    publish(render(m, args.quick, time.perf_counter() - started), None if args.quick else args.results, HEADING)


def render(m: dict, quick: bool, seconds: float) -> str:
    share = m["check_seconds"] / m["step_seconds"]
    lines = [
        HEADING,
        "",
        *provenance(f"`python benchmarks/bench_stop_check.py{' --quick' if quick else ''}`", seconds),
        f"- {m['processes']} CPU processes under torchrun (gloo); the check: `StopRequests.agreed`, one all-reduce "
        f"of one integer, timed over {CALLS} calls; the step: DDP, a random Qwen2 "
        f"({'tiny' if quick else 'bench.py --size full'} shape), 8 rows per process, median of "
        f"{m['steps']} steps (the first left out), the check included",
        "",
        *table_head("| stop check per step | training step | the check's share |"),
        f"| {m['check_seconds'] * 1e6:.0f} µs | {m['step_seconds'] * 1e3:.0f} ms | {share:.4%} |",
        "",
        "On GPUs the check is an NCCL all-reduce of 8 bytes (about as long as a kernel launch round trip); never "
        "measured here.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
