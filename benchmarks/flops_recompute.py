"""What gradient checkpointing costs a training step in FLOPs: the MFU ceiling it sets.

    python benchmarks/flops_recompute.py                          # the GPU matrix's ~1.5B shape, depth cut (minutes)
    python benchmarks/flops_recompute.py --preset tiny --max-length 128 --layers 1 2   # the code path (seconds)

MFU counts model FLOPs (gpu_harness.Flops), not the FLOPs a step executes: gradient checkpointing runs each layer's
forward again in the backward. So a step's MFU is at most its share of the peak on executed FLOPs times model /
executed FLOPs. Measured on the CPU, eagerly, float32: torch's FlopCounterMode around one KTO step, with and without
checkpointing, of a random model of the preset's shape cut to a few depths (`--layers`: the full depth's LM head takes
a CPU minutes), on gpu_harness's data (HH-RLHF's lengths scaled to `--max-length`). The executed FLOPs (a fixed part
plus a part a layer) are fitted on the depths (least squares) and carried to the preset's depth.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import gpu_harness
import harness


def step_flops(work: Path, preset: dict, layers: int, max_length: int) -> dict:
    """Executed FLOPs of one KTO step with and without gradient checkpointing, the model FLOPs, the tokens run."""
    from torch.utils.flop_counter import FlopCounterMode

    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.cache import open_cache

    where = work / f"layers-{layers}"
    shape = dict(preset, layers=layers, max_length=max_length, loss_type="kto", rows=8)
    harness.random_qwen2(where / "model", shape)
    gpu_harness.build_data(where / "data.jsonl", shape)
    paths = dict(model=str(where / "model"), dataset=str(where / "data.jsonl"), output=str(where / "cache"))
    cache = precompute(PrecomputeConfig(**paths, overwrite=True, max_length=max_length, attention_kernel="dense"))
    rows = gpu_harness.row_lengths(open_cache(cache).table, max_length)
    out = dict(layers=layers, model=gpu_harness.Flops(shape).train(rows))
    for checkpointing in (False, True):
        run_dir = where / f"run-{checkpointing}"
        run = harness.ours_train_config(cache, run_dir, batch=8, steps=1, learning_rate=1e-6, attention_kernel="dense")
        with FlopCounterMode(display=False) as counter:  # (eager: the counter sees every product)
            train(dataclasses.replace(run, gradient_checkpointing=checkpointing, torch_compile=False))
        state = harness.trainer_state(run_dir) or {}
        out[checkpointing] = dict(
            executed=counter.get_total_flops(), tokens=state.get("tokens_executed"), kl=state.get("kl_forward")
        )
    out["tokens_needed"] = state.get("tokens_needed")
    return out


def report(runs: list[dict], depth: int, name: str, max_length: int) -> list[str]:
    """The table: per depth measured, and carried to `depth`, executed / model FLOPs with and without checkpointing."""
    lines = [
        f"| {name}, max_length {max_length} | model GFLOP | executed GFLOP, no checkpointing (/ model) | "
        "executed GFLOP, checkpointing (/ model) | tokens run (needed) without / with |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        no, yes = r[False], r[True]
        lines.append(
            f"| {r['layers']} layer(s), measured | {r['model'] / 1e9:,.2f} | {no['executed'] / 1e9:,.1f} "
            f"({no['executed'] / r['model']:.3f}) | {yes['executed'] / 1e9:,.1f} ({yes['executed'] / r['model']:.3f}) "
            f"| {no['tokens']} / {yes['tokens']} ({r['tokens_needed']}) |"
        )
    at = {}
    for key in ("model", False, True):  # least squares: a fixed part plus a part a layer
        counted = [r["model"] if key == "model" else r[key]["executed"] for r in runs]
        fit = statistics.linear_regression([r["layers"] for r in runs], counted)
        at[key] = fit.intercept + fit.slope * depth
    lines.append(
        f"| {depth} layers, fitted | {at['model'] / 1e9:,.1f} | {at[False] / 1e9:,.1f} ({at[False] / at['model']:.3f}) "
        f"| {at[True] / 1e9:,.1f} ({at[True] / at['model']:.3f}) | |"
    )
    kl = {k: runs[0][k]["kl"] for k in (False, True)}
    lines += [
        "",
        f"- the KL forward without checkpointing: {kl[False]}; with checkpointing: {kl[True]}",
        f"- at {depth} layers, an MFU of 40% needs {0.4 * at[False] / at['model']:.0%} of the peak on executed FLOPs "
        f"without checkpointing, {0.4 * at[True] / at['model']:.0%} with",
    ]
    return lines


def main() -> None:
    parser = harness.script_parser(__doc__, work=str(harness.WORK_DIR / "flops-recompute"))
    parser.add_argument("--preset", default="qwen2-1.5b", choices=sorted(harness.GPU_PRESETS))
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if len(set(args.layers)) < 2:
        sys.exit("--layers: at least two depths to fit a layer's FLOPs")
    preset = harness.GPU_PRESETS[args.preset]
    runs = [step_flops(Path(args.work), preset, n, args.max_length) for n in sorted(set(args.layers))]
    print(f"machine: {harness.machine()}; command: python benchmarks/flops_recompute.py {' '.join(sys.argv[1:])}")
    print("\n".join(report(runs, preset["layers"], args.preset, args.max_length)))


if __name__ == "__main__":
    main()
