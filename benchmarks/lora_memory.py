"""Peak RSS of `train` with full fine-tuning vs LoRA with and without LoRA dropout, on the benchmark's cache.

    python benchmarks/lora_memory.py --cache benchmarks/.work/runs/ours_precompute   (after `make bench`)

Each setting runs in its own process so each peak is its own.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys


def run_one(cache: str, mode: str, out: str) -> None:
    from kto_pipeline import TrainConfig, train

    kw = dict(
        cache=cache,
        output_dir=out,
        overwrite_output_dir=True,
        per_device_train_batch_size=8,
        max_steps=4,
        learning_rate=1e-5,
        train_sampling_strategy="sequential",
        bf16=False,
    )
    if mode != "full":
        kw.update(lora_r=16, lora_alpha=32, lora_dropout=float(mode))
    train(TrainConfig(**kw))
    print(f"PEAK {mode} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", default="/tmp/kto-lora-memory")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.cache, args.one, args.out)
        return
    env = {**os.environ, "TQDM_DISABLE": "1"}
    for mode, label in (
        ("full", "full fine-tune"),
        ("0.05", "LoRA r=16, dropout 0.05"),
        ("0.0", "LoRA r=16, dropout 0"),
    ):
        proc = subprocess.run(
            [sys.executable, __file__, "--cache", args.cache, "--out", args.out, "--one", mode],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        peak = next(line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("PEAK"))
        print(f"{label:<28} peak RSS {peak} MiB")


if __name__ == "__main__":
    main()
