"""kto-pipeline's DPO (pair loss, sigmoid) vs trl.DPOTrainer (1.16): training steps on the same model, pairs, settings.

    python benchmarks/bench_dpo.py                 # full size (`make bench`), its section of benchmarks/RESULTS.md
    python benchmarks/bench_dpo.py --size smoke    # every path in minutes (used by the tests)

kto-pipeline: `precompute --pairs-only` (each pair one tree), then `train --loss-type sigmoid`; trl: DPOTrainer with
reference log-probs precomputed and online. Each measurement runs in a fresh subprocess (`bench_dpo.py worker NAME`).
"""

import argparse
import time
from pathlib import Path

import harness
from bench import LEARNING_RATE, PACKAGES, ours_train, trl_settings
from harness import efficiency, median_step, vs_row

# --size: the first `pairs` single-turn HH-RLHF pairs, `steps` training steps of `batch` pairs
DPO_SIZES = {
    "full": dict(pairs=160, max_turns=1, steps=8, batch=8, max_length=256, model="smollm2"),
    "smoke": dict(pairs=8, max_turns=1, steps=2, batch=2, max_length=1024, model="tiny"),
}
MODELS = {
    "smollm2": harness.SMOLLM2_TEXT,
    "tiny": "a tiny Llama (2 layers, hidden 64) built by `kto_pipeline.demo.tiny`: every path, not a measure of speed",
}
HEADING = "## DPO step: SmolLM2-135M-Instruct on HH-RLHF pairs"
BETA = 0.1
PAIRS = "pairs.jsonl"  # under --work: {prompt, chosen, rejected} rows
# the workers, in order: the reference passes (compared first), the timed training runs, the same under FlopCounterMode
TRAIN_NAMES = ("ours_train", "trl_train_precomputed", "trl_train_online")
FLOP_NAMES = ("ours_flops", "trl_flops_precomputed", "trl_flops_online")
LABELS = ("ours", "trl precomputed", "trl online")  # the three training runs, as the report names them
NAMES = ("ours_precompute", "trl_precompute", *TRAIN_NAMES, *FLOP_NAMES)


def worker(name: str, work: Path, size: dict, out: Path, model: Path) -> dict:
    """One measurement of NAMES, in this fresh process."""
    # trl: DPOTrainer as bench.py's trl runs (float32, gradient checkpointing off), sequential, sigmoid loss
    dpo = dict(pairs=True, train_sampling_strategy="sequential", loss_type=["sigmoid"])
    trl = trl_settings(size, size["steps"], BETA, precompute=name.endswith(("precompute", "precomputed")), **dpo)
    pairs = work / PAIRS
    if name == "ours_precompute":  # each pair one tree, no KL completions
        paths = dict(model=str(model), dataset=str(pairs), output=str(out))
        return harness.ours_reference_pass(**paths, max_length=size["max_length"], dtype="float32", pairs_only=True)
    if name == "trl_precompute":
        return harness.trl_reference_pass(model, pairs, out, **trl)
    if name == "ours_train":
        res = ours_train(work, size, out, loss_type="sigmoid")
        return dict(step_seconds=res.step_seconds, token_counts=harness.ours_train_tokens(out))
    if name in TRAIN_NAMES:
        return harness.trl_train(model, pairs, out, **trl)
    # FLOP_NAMES: the timed run's training under the counter (trl's reference pass, in its constructor, is outside)
    from torch.utils.flop_counter import FlopCounterMode

    trainer = None if name == "ours_flops" else harness.trl_trainer(model, pairs, out, **trl)
    with FlopCounterMode(display=False) as counter:
        run = ours_train(work, size, out, loss_type="sigmoid") if trainer is None else trainer.train()
    steps, total = run.global_step, counter.get_total_flops() / 1e9
    by_op = {str(op): n / 1e9 for op, n in counter.get_flop_counts()["Global"].items()}
    return dict(steps=steps, gflop=total, gflop_per_step=total / max(steps, 1), gflop_by_op=by_op)


def main() -> None:
    work_dir, results_help = str(harness.WORK_DIR / "dpo"), "Markdown file (default: RESULTS.md for full)"
    parser = harness.script_parser(__doc__, work_dir, results=results_help)
    parser.add_argument("--size", default="full", choices=sorted(DPO_SIZES))
    parser.add_argument("--model", help=argparse.SUPPRESS)  # workers: model directory
    args = parser.parse_args()
    work, size = Path(args.work), DPO_SIZES[args.size]
    if args.mode == "worker":
        if args.name not in NAMES:
            raise SystemExit(f"unknown worker {args.name}")
        harness.print_result(harness.measured(lambda: worker(args.name, work, size, Path(args.out), Path(args.model))))
        return
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"{size['model']} and {size['pairs']} HH-RLHF pairs in {work} ...", flush=True)
    harness.hh_rlhf_pairs(work / PAIRS, size["pairs"], size["max_turns"])
    if size["model"] == "tiny":
        from kto_pipeline.demo.tiny import ensure_tiny_model

        model = ensure_tiny_model(work / "tiny-llama")
    else:
        model = harness.smollm2_dir()

    def run(name: str) -> dict:  # a fresh process with its own datasets cache: no reuse of trl's reference pass
        env = {"HF_DATASETS_CACHE": str(work / "hf-datasets-cache" / name)}
        return harness.run_worker(Path(__file__), name, work, ["--size", args.size, "--model", str(model)], env=env)

    r, n_common, max_diff = harness.measure(NAMES, run, work, rtol=1e-4)  # the reference passes agree before any timing
    report = render(r, size, args.size, max_diff, n_common, time.perf_counter() - started)
    harness.publish(report, harness.default_results(args.results, args.size == "full"), HEADING)


def _ops(run_: dict) -> str:
    ops = sorted(run_["gflop_by_op"].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{op} {n / max(run_['gflop'], 1e-12):.1%}" for op, n in ops) or "none"


def render(r: dict, size: dict, size_name: str, max_diff: float, n_common: int, seconds: float) -> str:
    from kto_pipeline import PrecomputeConfig

    op, tp, ot, ttp, tto, of, tfp, tfo = (r[x] for x in NAMES)
    step = [median_step(x["step_seconds"]) for x in (ot, ttp, tto)]
    rate = [x["tokens"] / x["seconds"] for x in (op, tp)]
    process = [x["process_seconds"] for x in (op, ot, ttp, tto)]
    rss = [x["peak_rss_mib"] for x in (ot, ttp, tto)]
    gflop = [x["gflop_per_step"] for x in (of, tfp, tfo)]
    steps, batch = size["steps"], size["batch"]
    steps_text = f"{steps} steps x batch {batch} pairs"
    whole = f"train, whole process (s, {steps_text})"
    table = [
        vs_row("reference pass, tokens/s (ours `--pairs-only`)", *rate, ".0f", "ours / trl"),
        vs_row("train, median step (s), vs trl precomputed", step[0], step[1], ".2f", goal=">= 1.5x"),
        vs_row("train, median step (s), vs trl online", step[0], step[2], ".2f"),
        vs_row(f"{whole}, vs trl precomputed", process[1], process[2], ".1f"),
        vs_row(f"{whole}, vs trl online", process[1], process[3], ".1f"),
        vs_row("precompute + train processes (s) vs one trl online process", sum(process[:2]), process[3], ".1f"),
        vs_row("train peak RSS (MiB), vs trl precomputed", rss[0], rss[1], ".0f", "ours / trl"),
        vs_row("train peak RSS (MiB), vs trl online", rss[0], rss[2], ".0f", "ours / trl"),
        vs_row("GFLOP per step, vs trl precomputed", gflop[0], gflop[1], ".4g"),
        vs_row("GFLOP per step, vs trl online", gflop[0], gflop[2], ".4g"),
    ]
    for what, ours, theirs in (("reference pass", op, tp), (f"training ({steps_text})", ot, ttp)):
        cells = (efficiency(x.get("token_counts"), recorded=False)[0] for x in (ours, theirs))
        table.append(harness.md_row(f"token efficiency (needed / executed), {what}", *cells, "", "-", "-"))
    ceiling = "; ".join(
        f"vs {what}, FLOP ratio {gflop[i] / gflop[0]:.2f}x, step-time ratio measured {step[i] / step[0]:.2f}x"
        for i, what in enumerate(LABELS[1:], 1)
    )
    rates = ", ".join(f"{what} {g / t:.0f}" for what, g, t in zip(LABELS, gflop, step, strict=True))
    command = f"`python benchmarks/bench_dpo.py --size {size_name}` (in `make bench`)"
    lines = [
        HEADING,
        "",
        *harness.provenance(command, seconds, *PACKAGES),
        f"- model: {MODELS[size['model']]}",
        f"- data: first {size['pairs']} single-turn pairs of the bundled HH-RLHF harmless-base sample, {tp['pairs']} "
        f"left after trl drops prompts reaching max_length ({size['max_length']}); {op['rows']} answers scored by ours",
        f"- settings, both tools: DPO (sigmoid loss), beta {BETA}, float32, gradient checkpointing off, batch {batch} "
        f"pairs x 1 process, sequential order, {steps} steps, AdamW lr {LEARNING_RATE}; each stage a fresh process, "
        "own datasets cache. Ours: `precompute --pairs-only` (each pair one tree: the prompt, then both answers; "
        f"`--batch-size {PrecomputeConfig.batch_size}`, packed), `train --loss-type sigmoid`. trl: DPOTrainer, "
        f"precomputed (`precompute_ref_batch_size` {batch}) or online (its reference model, float32).",
        f"- correctness: reference log-probs agree on {n_common} answers (rel 1e-4), max |diff| {max_diff:.1e}",
        "",
        *harness.table_head("| measurement | kto-pipeline | trl | ratio | goal | met |"),
        *table,
        "",
        "- FLOP ceiling: at equal FLOP rates the step-time ratio (trl / ours) cannot exceed the ratio of FLOPs per "
        f"step: {ceiling}. GFLOP/s reached (GFLOP per step / median step): {rates}.",
        f"- reference pass: ours in length-sorted, token-budgeted batches; trl's in dataset order, {batch} pairs (2 x "
        f"{batch} padded sequences) a batch; tokens: unpadded prompt+answer (ours {op['tokens']}, trl {tp['tokens']}).",
        "- train step: median over steps 2..N (the first pays warm-up); whole process = the worker from start to exit "
        "(imports, loading, tokenizing, trl precomputed's reference pass, the steps, saving; ours reads its cache); "
        "peak RSS: the training process's ru_maxrss (trl online's includes its reference model).",
        f"- FLOPs: FlopCounterMode around the training call ({of['steps']}, {tfp['steps']} and {tfo['steps']} steps) "
        "in untimed processes, without trl precomputed's reference pass (in its constructor), with trl online's "
        f"reference forwards; total GFLOP ours {of['gflop']:.1f}, trl precomputed {tfp['gflop']:.1f}, trl online "
        f"{tfo['gflop']:.1f}; counted ops: ours {_ops(of)}; trl precomputed {_ops(tfp)}; trl online {_ops(tfo)} (not "
        "counted for either tool: ops the counter does not know, such as the CPU's attention kernel).",
        "- token efficiency: needed = each pair's prompt once plus both answers (truncated to max_length), no padding; "
        "ours as its cache's manifest.json and run's trainer_state.json record it (else n/a). trl's collator pads the "
        f"2 x {batch} sequences of a batch to the longest: executed = 2 x {batch} x width, over the reference pass's "
        f"and the {steps} training batches. Training counts the policy's forward; trl online's reference model runs "
        f"it again ({efficiency(tto.get('token_counts'), recorded=False)[0]} for its policy alone).",
        *harness.run_notes(dict(zip(LABELS, (ot, ttp, tto), strict=True))),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
