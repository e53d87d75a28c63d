"""One-off check: where a SmolLM2 training step's CPU time goes, kto-pipeline against trl online, by operator
(torch.profiler around the whole training call, the bench's settings: float32, batch 8, sequential, max_length 256).

    python benchmarks/bench.py --size full --only smollm2   # writes the data and kto-pipeline's cache
    python benchmarks/checks/step_profile.py ours 3
    python benchmarks/checks/step_profile.py trl 3

Prints the share of self CPU time in `aten::mm` / `aten::addmm` (the FLOPs `step_flops.py` counts), in attention,
and in everything else: where a tool's time goes besides its counted FLOPs.
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the one hop: benchmarks/ (bench, harness)

from bench import bench_train_config, trl_settings  # noqa: E402
from harness import SMOLLM2_SIZES, WORK_DIR, trl_trainer  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main() -> None:
    which, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if which not in ("ours", "trl"):
        sys.exit("usage: step_profile.py ours|trl [steps]")
    from kto_pipeline.demo.smollm2 import default_cache_dir, fetch_smollm2

    work = WORK_DIR / "smollm2"
    size = dict(SMOLLM2_SIZES["full"], steps=steps)
    if not (work / "data.jsonl").exists() or not (work / "runs" / "ours_precompute").exists():
        sys.exit(f"run `python benchmarks/bench.py --size full --only smollm2` first ({work} lacks its data or cache)")
    with tempfile.TemporaryDirectory() as out:
        if which == "trl":
            model = fetch_smollm2(default_cache_dir())
            trainer = trl_trainer(model, work / "data.jsonl", Path(out), precompute=False, **trl_settings(size, steps))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.train()
        else:
            from kto_pipeline import train

            config = bench_train_config(work, size, Path(out))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                train(config)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    share = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        kind = "matmul" if e.key in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm") else "other"
        kind = "attention" if "scaled_dot_product" in e.key else kind
        share[kind] += e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    print(
        json.dumps(
            {
                "tool": which,
                "steps": steps,
                "self_cpu_seconds": round(total / 1e6, 1),
                "share": {k: round(v / total, 3) for k, v in share.items()},
                "top": {e.key: round(e.self_cpu_time_total / total, 3) for e in top},
            }
        )
    )


if __name__ == "__main__":
    main()
