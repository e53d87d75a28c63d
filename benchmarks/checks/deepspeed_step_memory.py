"""One-off check: what DeepSpeed ZeRO-3 itself holds on each process during a training step, in units of the
process's shard of the weights. It reads the training rows of bench_loading's DeepSpeed table, whose peak stands
above baseline + 4 x the shard (the weights' shard, a gradient and two AdamW moments).

    python benchmarks/checks/deepspeed_step_memory.py    # after `python benchmarks/bench_loading.py --engine deepspeed`

Under `accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml` (zero3_init_flag true, 2 CPU
processes, float32), `kto-pipeline train` runs 1 step on the cache of bench_loading's 436M random Qwen2, with
DeepSpeed's stage-3 optimizer's `_optimizer_step` (the update of one sub-group, where the step's buffers are all
alive) wrapped to read the process's private memory (RssAnon) and the bytes of each of the optimizer's own
buffers (distinct storages, each counted once). Each process writes what it read; this script prints the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the one hop: benchmarks/ (bench_loading, harness)

from bench_loading import MIB, launch_variant, weights  # noqa: E402
from harness import HERE, WORK_DIR, launch_env, proc_status  # noqa: E402


def _tally(opt) -> dict[str, float]:
    """MiB of each of the stage-3 optimizer's buffers, a storage counted once (under its first name)."""
    import torch

    seen: set[int] = set()

    def mib(tensors) -> float:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total / MIB

    moments = (v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    buckets = (getattr(b, "buffer", None) for b in getattr(opt, "ipg_buckets", {}).values())
    return {
        "weights partition (what the engine trains)": mib(opt.fp16_partitioned_groups_flat),
        "master weights partition (a copy where its dtype differs)": mib(opt.fp32_partitioned_groups_flat),
        "gradient partition (reduced gradients)": mib([opt.grad_partitions_flat_buffer]),
        "the step's float32 gradient (flattened anew)": mib(t.grad for t in opt.fp32_partitioned_groups_flat),
        "AdamW moments": mib(moments),
        "reduce buckets": mib(buckets),
    }


def worker(out: Path, args: list[str]) -> None:
    """Under accelerate launch: train with the optimizer step observed, then write rank-R.json."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    seen: list[dict] = []
    original = DeepSpeedZeroOptimizer_Stage3._optimizer_step

    def observed(self, sub_group_id):
        seen.append(
            {"sub_group": sub_group_id, "rss_anon_mib": proc_status()["RssAnon"] / 1024, "buffers_mib": _tally(self)}
        )
        return original(self, sub_group_id)

    DeepSpeedZeroOptimizer_Stage3._optimizer_step = observed
    from kto_pipeline.cli import main

    sys.argv = ["kto-pipeline", *args]
    try:
        main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else WORK_DIR / "loading"
    cache = work / "runs" / "cache-deepspeed-model-big-main-reads"
    if not (cache / "manifest.json").exists():
        raise SystemExit(f"{cache}: run `python benchmarks/bench_loading.py --engine deepspeed` first")
    out = work / "deepspeed-step-memory"
    env, launcher, flags = launch_variant("deepspeed", one_reader=True)  # as bench_loading's runs (zero3_init_flag)
    train = ["train", "--cache", str(cache), "--output-dir", str(work / "runs" / "train-step-memory")]
    train += ["--overwrite-output-dir", "--max-steps", "1", "--per-device-train-batch-size", "2", "--save-steps", "0"]
    log = work / "deepspeed-step-memory.log"
    with open(log, "w") as f:
        cmd = [sys.executable, "-m", *launcher, __file__, "--worker", str(out), *train, *flags]
        proc = subprocess.run(cmd, env=launch_env(env), stdout=f, stderr=subprocess.STDOUT, cwd=HERE.parent)
    if proc.returncode != 0:
        raise SystemExit(f"the launch failed ({proc.returncode}); see {log}")
    total = weights(work / "model-big")["total_mib"]  # float32
    shard = total / 2
    print(f"model {total:.0f} MiB in float32, one process's shard {shard:.0f} MiB")
    for rank_file in sorted(out.glob("rank-*.json")):
        for seen in json.loads(rank_file.read_text()):
            print(f"\n{rank_file.stem}, sub-group {seen['sub_group']}: RssAnon {seen['rss_anon_mib']:.0f} MiB")
            print("| buffer | MiB | x shard |\n| --- | --- | --- |")
            buffers = seen["buffers_mib"]
            for name, mib in buffers.items():
                print(f"| {name} | {mib:.0f} | {mib / shard:.2f} |")
            print(f"| all of them | {sum(buffers.values()):.0f} | {sum(buffers.values()) / shard:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3:])
    else:
        main()
