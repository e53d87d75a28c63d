"""kto-pipeline's DPO (pair loss, sigmoid) vs trl.DPOTrainer (1.16): one training step on the same model, pairs and
settings, measured in one run.

    python benchmarks/bench_dpo.py                 # full size (`make bench`), its section of benchmarks/RESULTS.md
    python benchmarks/bench_dpo.py --size smoke    # every path in minutes (used by the tests)

SmolLM2-135M-Instruct on single-turn HH-RLHF pairs (bench.py's SmolLM2 data, kept paired). kto-pipeline scores each
pair once, as one tree (`precompute --pairs-only`: the prompt once, then both answers), and trains its pair loss
(`train --loss-type sigmoid`) on that cache; trl runs DPOTrainer with its reference log-probs precomputed
(`precompute_ref_log_probs=True`) and online (a reference model in memory). Every measurement runs in a fresh
subprocess (`bench_dpo.py worker NAME`, harness.py), so each one's peak RSS is its own; both tools in float32 with
gradient checkpointing off, the same batch of pairs, sequential order and max_length. Before any speed is reported,
the reference log-probs of the two tools are compared answer by answer. The FLOPs of the training runs are counted
(torch.utils.flop_counter.FlopCounterMode) in processes of their own, apart from the timed ones.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import LEARNING_RATE, PACKAGES
from harness import (
    SMOLLM2_TEXT,
    TRL_RUN,
    WORK_DIR,
    default_results,
    efficiency,
    hh_rlhf_pairs,
    md_row,
    measure,
    measured,
    median_step,
    ours_reference_pass,
    ours_train_config,
    ours_train_tokens,
    print_result,
    provenance,
    publish,
    run_notes,
    run_worker,
    script_parser,
    smollm2_dir,
    table_head,
    trl_reference_pass,
    trl_train,
    trl_trainer,
    vs_row,
)

# --size: the first `pairs` single-turn (max_turns) HH-RLHF pairs, `steps` training steps of `batch` pairs; `model`:
# SmolLM2-135M-Instruct, or (smoke: every path in about a minute) the tests' tiny 2-layer Llama with its character
# tokenizer and chat template, built locally (kto_pipeline.demo.tiny)
DPO_SIZES = {
    "full": dict(pairs=160, max_turns=1, steps=8, batch=8, max_length=256, model="smollm2"),
    "smoke": dict(pairs=8, max_turns=1, steps=2, batch=2, max_length=1024, model="tiny"),
}
MODELS = {
    "smollm2": SMOLLM2_TEXT,
    "tiny": "a tiny Llama (2 layers, hidden 64) with a character tokenizer and a chat template, built locally by "
    "`kto_pipeline.demo.tiny.ensure_tiny_model` (the smoke size: every path, not a measurement of speed)",
}
HEADING = "## DPO step: SmolLM2-135M-Instruct on HH-RLHF pairs"
BETA = 0.1
# the workers, in order: the two reference passes first (their log-probs are compared before anything is timed),
# then the timed training runs, then the same runs under the FLOP counter
REFERENCE_NAMES = ("ours_precompute", "trl_precompute")
TRAIN_NAMES = ("ours_train", "trl_train_precomputed", "trl_train_online")
FLOP_NAMES = ("ours_flops", "trl_flops_precomputed", "trl_flops_online")
NAMES = (*REFERENCE_NAMES, *TRAIN_NAMES, *FLOP_NAMES)


def trl_settings(size: dict, precompute: bool) -> dict:
    """harness.trl_trainer's settings for every trl run here (trl.DPOTrainer, the paired .jsonl loaded disk-backed;
    trl online loads its reference from the same directory, float32 like the policy): size's batch of pairs for
    training and for the reference pass, max_length, its steps at LEARNING_RATE, beta, the sigmoid loss (DPO), float32
    and gradient checkpointing off (trl's defaults are both on), sequential order, TRL_RUN."""
    run = dict(batch=size["batch"], max_length=size["max_length"], max_steps=size["steps"], precompute=precompute)
    run |= dict(precompute_ref_batch_size=size["batch"], train_sampling_strategy="sequential", pairs=True)
    return dict(run, learning_rate=LEARNING_RATE, beta=BETA, loss_type=["sigmoid"], **TRL_RUN)


def pairs_file(work: Path) -> Path:
    """The paired conversational rows `build_assets` writes (each line {prompt, chosen, rejected})."""
    return work / "pairs.jsonl"


def build_assets(work: Path, size: dict) -> Path:
    """The model's directory (SmolLM2 fetched once into ~/.cache/kto-pipeline, or the tiny model built in `work`),
    and `pairs_file`: the first size["pairs"] single-turn HH-RLHF pairs of the bundled sample, kept paired."""
    hh_rlhf_pairs(pairs_file(work), size["pairs"], size["max_turns"])
    if size["model"] == "tiny":
        from kto_pipeline.demo.tiny import ensure_tiny_model

        return ensure_tiny_model(work / "tiny-llama")
    return smollm2_dir()


def ours_train_run(work: Path, size: dict, out: Path):
    """kto-pipeline's DPO training run on the cache that ours_precompute wrote in `work`."""
    from kto_pipeline import train

    cache = work / "runs" / "ours_precompute"
    settings = dict(batch=size["batch"], steps=size["steps"], learning_rate=LEARNING_RATE, loss_type="sigmoid")
    return train(ours_train_config(cache, out, **settings))


# Each worker measures one thing in this fresh process: (name, work, size, out, model) -> its numbers.


def ours_precompute_worker(name: str, work: Path, size: dict, out: Path, model: Path) -> dict:
    """kto-pipeline's `precompute --pairs-only` (each pair one tree, no KL completions): its timing (from the
    manifest) and every answer's reference log-prob."""
    paths = dict(model=str(model), dataset=str(pairs_file(work)), output=str(out))
    return ours_reference_pass(**paths, max_length=size["max_length"], dtype="float32", pairs_only=True)


def trl_precompute_worker(name: str, work: Path, size: dict, out: Path, model: Path) -> dict:
    """trl's `precompute_ref_log_probs` pass (every pair once, in batches of precompute_ref_batch_size in dataset
    order) and every answer's reference log-prob."""
    return trl_reference_pass(model, pairs_file(work), out, **trl_settings(size, True))


def ours_train_worker(name: str, work: Path, size: dict, out: Path, model: Path) -> dict:
    """Step times and the tokens the run recorded (trainer_state.json)."""
    res = ours_train_run(work, size, out)
    return dict(step_seconds=res.step_seconds, token_counts=ours_train_tokens(out))


def trl_train_worker(name: str, work: Path, size: dict, out: Path, model: Path) -> dict:
    """trl_train_precomputed / trl_train_online: step times and the tokens its policy's batches ran."""
    return trl_train(model, pairs_file(work), out, **trl_settings(size, name.endswith("precomputed")))


def flops_worker(name: str, work: Path, size: dict, out: Path, model: Path) -> dict:
    """ours_flops / trl_flops_precomputed / trl_flops_online: the training run of its timed counterpart under
    FlopCounterMode, around the whole train call (trl's reference pass, in its constructor, is outside)."""
    from torch.utils.flop_counter import FlopCounterMode

    if name == "ours_flops":
        with FlopCounterMode(display=False) as counter:
            steps = ours_train_run(work, size, out).global_step
    else:
        trainer = trl_trainer(model, pairs_file(work), out, **trl_settings(size, name.endswith("precomputed")))
        with FlopCounterMode(display=False) as counter:
            trainer.train()
        steps = trainer.state.global_step
    total = counter.get_total_flops() / 1e9
    by_op = {str(op): n / 1e9 for op, n in counter.get_flop_counts()["Global"].items()}
    return dict(steps=steps, gflop=total, gflop_per_step=total / max(steps, 1), gflop_by_op=by_op)


WORKERS = dict(ours_precompute=ours_precompute_worker, trl_precompute=trl_precompute_worker)
WORKERS |= dict(ours_train=ours_train_worker, trl_train_precomputed=trl_train_worker, trl_train_online=trl_train_worker)
WORKERS |= dict.fromkeys(FLOP_NAMES, flops_worker)


def dpo_worker(name: str, work: Path, size_name: str, model: Path) -> dict:
    """`bench_dpo.py worker NAME` in a fresh process (harness.run_worker), with a datasets cache of its own: no
    worker reuses another's tokenized data or trl's cached reference log-probs."""
    env = {"HF_DATASETS_CACHE": str(work / "hf-datasets-cache" / name)}
    return run_worker(Path(__file__), name, work, ["--size", size_name, "--model", str(model)], env=env)


def main() -> None:
    parser = script_parser(
        __doc__, str(WORK_DIR / "dpo"), results="Markdown file to write (default: RESULTS.md for full)"
    )
    parser.add_argument("--size", default="full", choices=sorted(DPO_SIZES))
    parser.add_argument("--model", help=argparse.SUPPRESS)  # workers: model directory
    args = parser.parse_args()
    work, size = Path(args.work), DPO_SIZES[args.size]
    if args.mode == "worker":
        if args.name not in WORKERS:
            raise SystemExit(f"unknown worker {args.name}")
        run = WORKERS[args.name]
        print_result(measured(lambda: run(args.name, work, size, Path(args.out), Path(args.model))))
        return
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"{size['model']} and {size['pairs']} HH-RLHF pairs in {work} ...", flush=True)
    model = build_assets(work, size)
    # correctness first: the two reference passes must agree (rel 1e-4 as tests/test_real_model.py) before any
    # training run is timed
    r, n_common, max_diff = measure(NAMES, lambda name: dpo_worker(name, work, args.size, model), work, rtol=1e-4)
    report = render(r, size, args.size, max_diff, n_common, time.perf_counter() - started)
    publish(report, default_results(args.results, args.size == "full"), HEADING)


# ------------------------------------------------------------------------------------------- the report


def _ops(run_: dict) -> str:
    """The counted ops of a FLOP run, largest first: "aten.mm 99.6%, aten.bmm 0.4%"."""
    ops = sorted(run_["gflop_by_op"].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{op} {n / max(run_['gflop'], 1e-12):.1%}" for op, n in ops) or "none"


def _efficiency(counts: dict | None) -> str:
    """ "93.1% (1234 / 1325)" (needed / executed), or "n/a" where the run did not record its token counts."""
    return efficiency(counts, recorded=False)[0]


def table_rows(r: dict, steps_text: str) -> list[str]:
    """The section's table: reference pass speed, training step and process times, peak RSS, FLOPs per step and
    token efficiency, ours against trl's."""
    op, tp = r["ours_precompute"], r["trl_precompute"]
    ot, ttp, tto = (r[x] for x in TRAIN_NAMES)
    of, tfp, tfo = (r[x] for x in FLOP_NAMES)
    o_step, pre_step, on_step = (median_step(x["step_seconds"]) for x in (ot, ttp, tto))
    o_rss, pre_rss, on_rss = (x["peak_rss_mib"] for x in (ot, ttp, tto))
    whole = f"train, whole process (s, {steps_text})"
    ref_rates = (op["tokens"] / op["seconds"], tp["tokens"] / tp["seconds"])
    rows = [
        vs_row("reference pass, tokens/s (ours `--pairs-only`)", *ref_rates, ".0f", "ours / trl"),
        vs_row("train, median step (s), vs trl precomputed", o_step, pre_step, ".2f", goal=">= 1.5x"),
        vs_row("train, median step (s), vs trl online", o_step, on_step, ".2f"),
        vs_row(f"{whole}, vs trl precomputed", ot["process_seconds"], ttp["process_seconds"], ".1f"),
        vs_row(f"{whole}, vs trl online", ot["process_seconds"], tto["process_seconds"], ".1f"),
        vs_row(
            "precompute + train processes (s) vs one trl online process",
            op["process_seconds"] + ot["process_seconds"],
            tto["process_seconds"],
            ".1f",
        ),
        vs_row("train peak RSS (MiB), vs trl precomputed", o_rss, pre_rss, ".0f", "ours / trl"),
        vs_row("train peak RSS (MiB), vs trl online", o_rss, on_rss, ".0f", "ours / trl"),
        vs_row("GFLOP per step, vs trl precomputed", of["gflop_per_step"], tfp["gflop_per_step"], ".4g"),
        vs_row("GFLOP per step, vs trl online", of["gflop_per_step"], tfo["gflop_per_step"], ".4g"),
    ]
    for what, ours, theirs in (("reference pass", op, tp), (f"training ({steps_text})", ot, ttp)):
        text, trl_text = (_efficiency(x.get("token_counts")) for x in (ours, theirs))
        rows.append(md_row(f"token efficiency (needed / executed), {what}", text, trl_text, "", "-", "-"))
    return rows


def ceiling_line(r: dict) -> str:
    """The FLOP ratio as the bound on the step-time ratio at equal FLOP rates, with the rates each run reached."""
    ot, ttp, tto = (r[x] for x in TRAIN_NAMES)
    of, tfp, tfo = (r[x] for x in FLOP_NAMES)
    o_step, pre_step, on_step = (median_step(x["step_seconds"]) for x in (ot, ttp, tto))
    parts = []
    for what, flops, step in (("trl precomputed", tfp, pre_step), ("trl online", tfo, on_step)):
        bound, measured_ = flops["gflop_per_step"] / of["gflop_per_step"], step / o_step
        parts.append(f"vs {what}, FLOP ratio {bound:.2f}x, step-time ratio measured {measured_:.2f}x")
    runs = (("ours", of, o_step), ("trl precomputed", tfp, pre_step), ("trl online", tfo, on_step))
    rates = ", ".join(f"{what} {flops['gflop_per_step'] / step:.0f}" for what, flops, step in runs)
    return (
        "- FLOP ceiling: at equal FLOP rates the step-time ratio (trl / ours) cannot exceed the ratio of FLOPs per "
        f"step: {'; '.join(parts)}. GFLOP/s reached (GFLOP per step / median step): {rates}."
    )


def render(r: dict, size: dict, size_name: str, max_diff: float, n_common: int, seconds: float) -> str:
    from kto_pipeline import PrecomputeConfig

    op, tp = r["ours_precompute"], r["trl_precompute"]
    ot, ttp, tto = (r[x] for x in TRAIN_NAMES)
    of, tfp, tfo = (r[x] for x in FLOP_NAMES)
    steps, batch = size["steps"], size["batch"]
    steps_text = f"{steps} steps x batch {batch} pairs"
    command = f"`python benchmarks/bench_dpo.py --size {size_name}` (in `make bench`)"
    lines = [
        HEADING,
        "",
        *provenance(command, seconds, *PACKAGES),
        f"- model: {MODELS[size['model']]}",
        f"- data: the first {size['pairs']} single-turn pairs of the bundled HH-RLHF harmless-base sample, kept "
        f"paired (conversational prompt, chosen, rejected; rendered with the model's chat template): "
        f"{tp['pairs']} pairs after trl's drop of prompts that reach max_length, {op['rows']} answers "
        f"scored by kto-pipeline; max_length {size['max_length']}",
        f"- settings, both tools: DPO (sigmoid loss), beta {BETA}, float32 (bf16 off), gradient checkpointing off, "
        f"batch {batch} pairs x 1 process, sequential order, {steps} steps, AdamW lr {LEARNING_RATE}; each stage in "
        "a fresh process with a datasets cache of its own. kto-pipeline: `precompute --pairs-only` (each pair one "
        f"tree: its prompt once, then both answers; the CLI's default `--batch-size {PrecomputeConfig.batch_size}`, "
        "packed) and `train --loss-type sigmoid` on that cache. trl precomputed = DPOTrainer with "
        f"`precompute_ref_log_probs=True` (`precompute_ref_batch_size` {batch}); trl online = DPOTrainer with its "
        "reference model (loaded by trl from the same directory, float32).",
        f"- correctness: reference log-probs agree on {n_common} answers (rel 1e-4), max |diff| {max_diff:.1e}",
        "",
        *table_head("| measurement | kto-pipeline | trl | ratio | goal | met |"),
        *table_rows(r, steps_text),
        "",
        ceiling_line(r),
        "- reference pass: kto-pipeline's `precompute --pairs-only` (length-sorted, token-budgeted batches, each pair "
        "one tree) vs trl's `precompute_ref_log_probs` pass (batches of "
        f"{batch} pairs in dataset order, each a padded batch of 2 x {batch} sequences); tokens = the unpadded tokens "
        "of prompt+chosen and prompt+rejected (each prompt counted twice), the same count for both tools "
        f"(ours {op['tokens']}, trl {tp['tokens']}).",
        "- train step: median over steps 2..N (the first pays warm-up costs); whole process = the worker process "
        "from start to exit (imports, model and data loading, trl's tokenizing and, for trl precomputed, its "
        "reference pass, the steps, saving). kto-pipeline's training reads the cache written by its precompute "
        "process.",
        "- peak RSS: the training process's (ru_maxrss); trl online holds its reference model as well.",
        f"- FLOPs: `torch.utils.flop_counter.FlopCounterMode` around the whole training call ({of['steps']}, "
        f"{tfp['steps']} and {tfo['steps']} steps), in processes of their own (not the timed ones); trl "
        "precomputed's reference pass runs in its constructor, outside the count; trl online's count includes its "
        f"reference model's forward of every batch. Total GFLOP: ours {of['gflop']:.1f}, trl precomputed "
        f"{tfp['gflop']:.1f}, trl online {tfo['gflop']:.1f}. Counted ops: ours {_ops(of)}; trl precomputed "
        f"{_ops(tfp)}; trl online {_ops(tfo)} (an op the counter does not know, such as the CPU's attention kernel, "
        "is not counted, for either tool).",
        "- token efficiency: needed = each pair's prompt once plus its chosen and rejected answers (truncated to "
        "max_length), no padding. kto-pipeline: `timing` of the cache's manifest.json (reference pass) and the "
        "training run's trainer_state.json (n/a where the run did not record them). trl: derived from its batching: "
        "DataCollatorForPreference truncates each prompt+chosen and prompt+rejected to max_length and pads the "
        f"2 x {batch} sequences of a batch on the right to the longest of them, one forward, so executed = "
        f"2 x {batch} x width, summed over the reference pass's batches and over the {steps} training batches "
        "(sequential). The training row counts the policy's forward; trl online runs the same padded batch through "
        f"its reference model as well, twice the executed tokens ({_efficiency(tto.get('token_counts'))} for its "
        "policy passes alone).",
        *run_notes({"ours": ot, "trl precomputed": ttp, "trl online": tto}),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
