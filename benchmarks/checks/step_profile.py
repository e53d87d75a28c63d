"""One-off check: where a SmolLM2 training step's CPU time goes, kto-pipeline against trl online, by operator
(torch.profiler around the whole training call, the bench's settings: float32, batch 8, sequential, max_length 256).

    python benchmarks/bench.py --size full --only smollm2   # writes the data and kto-pipeline's cache
    python benchmarks/checks/step_profile.py ours 3
    python benchmarks/checks/step_profile.py trl 3
    python benchmarks/checks/step_profile.py ours 2 6       # the steps after the first ones, alone

Prints the share of self CPU time in `aten::mm` / `aten::addmm` (the FLOPs `step_flops.py` counts), in attention,
and in everything else: where a tool's time goes besides its counted FLOPs. With a second step count, the same
process runs the training call twice, STEPS then MORE steps, each profiled and timed from outside, and prints their
difference per step: the later steps alone (steps STEPS+1..MORE of the longer run), without the loading, the set-up
and the first steps that both runs share, and how much of their wall time is spent outside torch ops.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the one hop: benchmarks/ (bench, harness)

from bench import smollm2_training  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

KINDS = ("matmul", "attention", "other")


def kind(key: str) -> str:
    if "scaled_dot_product" in key:
        return "attention"
    return "matmul" if key in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm") else "other"


def profiled_run(which: str, steps: int) -> dict:
    """One training call of `steps` steps under torch.profiler: wall seconds (the call, from outside), self CPU
    seconds of torch ops by kind, and the top ops' seconds."""
    with tempfile.TemporaryDirectory() as out:
        run = smollm2_training(which, steps, Path(out))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run()
            wall = time.perf_counter() - start
    events = prof.key_averages()
    seconds = dict.fromkeys(KINDS, 0.0)
    for e in events:
        seconds[kind(e.key)] += e.self_cpu_time_total / 1e6
    top = {e.key: e.self_cpu_time_total / 1e6 for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]}
    threads: dict[int, float] = {}
    for e in prof.events():  # which threads ran the ops (a thread that builds batches runs beside the step)
        threads[e.thread] = threads.get(e.thread, 0.0) + e.self_cpu_time_total / 1e6
    return {"wall": wall, "ops": sum(seconds.values()), **seconds, "top": top, "threads": threads}


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    counts = [int(x) for x in sys.argv[2:4]] or [3]
    if which not in ("ours", "trl") or (len(counts) == 2 and counts[1] <= counts[0]):
        sys.exit("usage: step_profile.py ours|trl [STEPS [MORE]]   (MORE > STEPS)")
    runs = [profiled_run(which, steps) for steps in counts]
    if len(runs) == 1:
        r = runs[0]
        print(
            json.dumps(
                {
                    "tool": which,
                    "steps": counts[0],
                    "self_cpu_seconds": round(r["ops"], 1),
                    "share": {k: round(r[k] / r["ops"], 3) for k in KINDS},
                    "top": {k: round(v / r["ops"], 3) for k, v in list(r["top"].items())[:8]},
                }
            )
        )
        return
    short, long = runs
    n = counts[1] - counts[0]
    per_step = {k: (long[k] - short[k]) / n for k in ("wall", "ops", *KINDS)}
    top = {k: round((v - short["top"].get(k, 0.0)) / n, 3) for k, v in list(long["top"].items())[:8]}
    print(
        json.dumps(
            {
                "tool": which,
                "steps": f"{counts[0] + 1}..{counts[1]} (a {counts[1]}-step run minus a {counts[0]}-step run)",
                "runs_wall_seconds": [round(r["wall"], 2) for r in runs],
                "per_step_seconds": {k: round(v, 3) for k, v in per_step.items()},
                "outside_torch_ops": round(1 - per_step["ops"] / per_step["wall"], 3),
                "share_of_ops": {k: round(per_step[k] / per_step["ops"], 3) for k in KINDS},
                "ops_per_step_by_thread": {
                    str(t): round((v - short["threads"].get(t, 0.0)) / n, 3) for t, v in long["threads"].items()
                },
                "top_per_step_seconds": top,
            }
        )
    )


if __name__ == "__main__":
    main()
