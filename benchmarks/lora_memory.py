"""Peak RSS of `train` with full fine-tuning vs LoRA with and without LoRA dropout, on the benchmark's cache.

    python benchmarks/lora_memory.py --cache benchmarks/.work/runs/ours_precompute   (after `make bench`)

Each setting runs in its own process (`lora_memory.py worker MODE`, harness.py) so each peak is its own.
"""

from pathlib import Path

from harness import WORK_DIR, peak_rss_mib, print_result, run_worker, script_parser

MODES = (("full", "full fine-tune"), ("0.05", "LoRA r=16, dropout 0.05"), ("0.0", "LoRA r=16, dropout 0"))


def main() -> None:
    parser = script_parser(__doc__, work=str(WORK_DIR / "lora-memory"))  # worker NAME: the MODES entry to run
    parser.add_argument("--cache", required=True)
    args = parser.parse_args()
    if args.mode == "worker":  # `train` with full fine-tuning ("full") or LoRA r=16 with dropout NAME
        from kto_pipeline import TrainConfig, train

        lora = {} if args.name == "full" else dict(lora_r=16, lora_alpha=32, lora_dropout=float(args.name))
        run = dict(cache=args.cache, output_dir=args.out, overwrite_output_dir=True, per_device_train_batch_size=8)
        run |= dict(max_steps=4, learning_rate=1e-5, train_sampling_strategy="sequential", bf16=False)
        train(TrainConfig(**run, **lora))
        print_result({"peak_rss_mib": peak_rss_mib()})
        return
    for mode, label in MODES:
        peak = run_worker(Path(__file__), mode, Path(args.work), ["--cache", args.cache])["peak_rss_mib"]
        print(f"{label:<28} peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
