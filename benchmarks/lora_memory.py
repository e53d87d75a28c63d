"""Peak RSS of `train` with full fine-tuning vs LoRA with and without LoRA dropout, on the benchmark's cache.

    python benchmarks/lora_memory.py --cache benchmarks/.work/runs/ours_precompute   (after `make bench`)

Each setting runs in its own process (`lora_memory.py worker MODE`, harness.py) so each peak is its own.
"""

from __future__ import annotations

from pathlib import Path

from harness import WORK_DIR, peak_rss_mib, print_result, run_worker, script_parser

MODES = (("full", "full fine-tune"), ("0.05", "LoRA r=16, dropout 0.05"), ("0.0", "LoRA r=16, dropout 0"))


def worker(cache: str, mode: str, out: Path) -> dict:
    """`train` on `cache` with full fine-tuning (`mode` "full") or LoRA r=16 with dropout `mode`."""
    from kto_pipeline import TrainConfig, train

    kw = dict(cache=cache, output_dir=str(out), overwrite_output_dir=True, per_device_train_batch_size=8, max_steps=4)
    kw |= dict(learning_rate=1e-5, train_sampling_strategy="sequential", bf16=False)
    if mode != "full":
        kw.update(lora_r=16, lora_alpha=32, lora_dropout=float(mode))
    train(TrainConfig(**kw))
    return {"peak_rss_mib": peak_rss_mib()}


def main() -> None:
    parser = script_parser(__doc__, work=str(WORK_DIR / "lora-memory"))  # worker NAME: the MODES entry to run
    parser.add_argument("--cache", required=True)
    args = parser.parse_args()
    if args.mode == "worker":
        print_result(worker(args.cache, args.name, Path(args.out)))
        return
    for mode, label in MODES:
        peak = run_worker(Path(__file__), mode, Path(args.work), ["--cache", args.cache])["peak_rss_mib"]
        print(f"{label:<28} peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
