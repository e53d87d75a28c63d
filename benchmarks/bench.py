"""kto-pipeline vs trl.KTOTrainer (1.16), same model, data and settings, measured in one run.

    python benchmarks/bench.py                 # full benchmark (`make bench`), writes benchmarks/RESULTS.md
    python benchmarks/bench.py --size smoke    # a minute-long run of every path (used by the tests)
    python benchmarks/bench.py --only lora     # LoRA rows only, updates their section of RESULTS.md
    python benchmarks/bench.py --only smollm2  # the real model (SmolLM2-135M-Instruct) on HH-RLHF, its own section
    python benchmarks/bench.py --only scale    # preprocessing at 20k/200k/1M rows (bench_scale.py), RESULTS-scale.md
    python benchmarks/bench.py --only append   # precompute --append of 1% new rows to a 200k-row cache, the same file

Every measurement runs in a fresh subprocess (`bench.py worker NAME`), its peak RSS its own. Both tools run in
float32 with gradient checkpointing off (trl 1.16 defaults to bf16 and gradient checkpointing, even on CPU), the same
global batch, sequential order, max_length; no speed is reported unless their reference log-probs agree row by row.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import harness
from harness import SIZES, SMOLLM2_SIZES, median_step, ours_train_tokens, provenance, raw_steps, table, vs_row

CASES = {"random": SIZES, "smollm2": SMOLLM2_SIZES, "scale": harness.SCALE_SIZES, "append": harness.APPEND_SIZES}
SWEEP_BETAS = (0.05, 0.1, 0.2, 0.5)
LEARNING_RATE = 1e-5
# ours' reference pass: a forward's token budget (the random case's rows are uniform, so big passes pay); the attention
# pairs of `--only smollm2` are counted on the cache it packed
REFERENCE_MAX_TOKENS = 16384
LORA = dict(r=16, alpha=32, dropout=0.05)
PACKAGES = ("kto-pipeline", "trl", "transformers", "torch")  # the versions each report names
# RESULTS.md: a full run rewrites the main table (`render`) and keeps these sections, written by their own runs
LORA_HEADING = "## LoRA"  # --only lora
SMOLLM2_HEADING = "## Real model: SmolLM2-135M-Instruct on HH-RLHF"  # --only smollm2
# the workers of each case, in order: the two reference passes first (their log-probs are compared)
SMOLLM2_NAMES = ("ours_precompute", "trl_precompute", "ours_train", "trl_train_online", "trl_train_precomputed")
MAIN_NAMES = (*SMOLLM2_NAMES, "ours_sweep", "trl_sweep_online", "trl_sweep_precomputed")
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta", "lambda", "zeta"]


def build_assets(work: Path, size: dict) -> None:
    """A random-weight Qwen2 with a char tokenizer (harness.random_qwen2) and a dataset of random words."""
    harness.random_qwen2(work / "model", size)
    data = work / "data.jsonl"
    if not data.exists():
        rng = random.Random(0)

        def text(lo: int, hi: int) -> str:  # random words, cut at a random length in [lo, hi]
            target, out = rng.randint(lo, hi), ""
            while len(out) < target:
                out += rng.choice(WORDS) + " "
            return out[:target]

        rows = [dict(prompt=text(*size["prompt"]), completion=text(*size["completion"])) for _ in range(size["rows"])]
        harness.write_jsonl(data, [dict(row, label=i % 2 == 0) for i, row in enumerate(rows)])


def trl_settings(size: dict, steps: int = 1, beta: float = 0.1, **more) -> dict:
    """harness.trl_trainer's settings for the trl runs here and in bench_dpo.py: float32, `steps` steps, `beta`."""
    run = dict(batch=size["batch"], max_length=size["max_length"], precompute_ref_batch_size=size["batch"])
    return dict(run, max_steps=steps, beta=beta, learning_rate=LEARNING_RATE, **harness.TRL_RUN, **more)


def ours_train(work: Path, size: dict, out: Path, **more):
    """kto-pipeline's `train` on ours_precompute's cache, set as trl's runs (bench_dpo.py's too), plus `more`."""
    from kto_pipeline import train

    settings = dict(batch=size["batch"], steps=size["steps"], learning_rate=LEARNING_RATE, **more)
    return train(harness.ours_train_config(work / "runs" / "ours_precompute", out, **settings))


def worker(name: str, work: Path, size: dict, out: Path, model: Path | None = None, data: Path | None = None) -> dict:
    """One measurement in this fresh process (harness.measured): NAME of MAIN_NAMES, ours_train_lora or
    trl_train_lora on the case's `model` directory and `data` file (default: build_assets' in `work`); scale_* and
    append_*: bench_scale.py's."""
    if name.startswith("append_"):  # bench_scale.py: the CLI's process, imports timed (so nothing is imported first)
        from bench_scale import append_worker

        return append_worker(name, size, out, model, data)
    model, data = model or work / "model", data or work / "data.jsonl"
    if name.startswith("scale_"):  # bench_scale.py: preprocessing only, its own timers, peaks and baseline
        from bench_scale import scale_worker

        return harness.measured(lambda: scale_worker(name, size, out, model, data), peak=False)
    if name not in (*MAIN_NAMES, "ours_train_lora", "trl_train_lora"):
        raise SystemExit(f"unknown worker {name}")
    return harness.measured(lambda: measurement(name, work, size, out, model, data))


def measurement(name: str, work: Path, size: dict, out: Path, model: Path, data: Path) -> dict:
    """The reference passes: their timing and every sequence's log-prob; training runs: their step times and (but
    with LoRA) the tokens their batches ran; the sweeps: their seconds (trl's: counting the reference passes run)."""
    lora, precomputed = name.endswith("lora"), name.endswith("precomputed")
    if name == "ours_precompute":
        from kto_pipeline import PrecomputeConfig

        # the real case runs the CLI's default batch_size
        batch = dict(batch_size=size.get("reference_batch", PrecomputeConfig.batch_size))
        batch["max_tokens_per_batch"] = REFERENCE_MAX_TOKENS
        paths = dict(model=str(model), dataset=str(data), output=str(out))
        return harness.ours_reference_pass(**paths, max_length=size["max_length"], dtype="float32", **batch)
    if name == "trl_precompute":  # batches of size["batch"] in dataset order
        return harness.trl_reference_pass(model, data, out, **trl_settings(size))
    if name.startswith("ours_train"):  # on ours_precompute's cache
        adapters = dict(lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"]) if lora else {}
        res = ours_train(work, size, out, **adapters)
        return dict(step_seconds=res.step_seconds, **({} if lora else {"token_counts": ours_train_tokens(out)}))
    if name.startswith("trl_train"):  # with LoRA, trl computes the reference online, adapters disabled
        settings = trl_settings(size, size["steps"])
        return harness.trl_train(model, data, out, precompute=precomputed, lora=LORA if lora else None, **settings)
    if name == "ours_sweep":  # one reference pass, then one training run per beta, all in this process
        from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train

        start = time.perf_counter()
        paths = dict(model=str(model), dataset=str(data), output=str(out / "cache"))
        cache = precompute(PrecomputeConfig(**paths, max_length=size["max_length"], overwrite=True, batch_size=64))
        run = dict(per_device_train_batch_size=size["batch"], max_steps=size["sweep_steps"], bf16=False)
        run |= dict(learning_rate=LEARNING_RATE, train_sampling_strategy="sequential", overwrite_output_dir=True)
        for beta in SWEEP_BETAS:
            train(TrainConfig(cache=str(cache), output_dir=str(out / f"beta{beta}"), beta=beta, **run))
        return dict(seconds=time.perf_counter() - start)
    from trl import KTOTrainer  # trl_sweep_online / trl_sweep_precomputed: one trainer per beta

    passes = []
    harness.time_calls(KTOTrainer, "_precompute_ref_logps", lambda seconds, *args, **kwargs: passes.append(seconds))
    start = time.perf_counter()
    for beta in SWEEP_BETAS:
        settings = trl_settings(size, size["sweep_steps"], beta, precompute=precomputed)
        harness.trl_trainer(model, data, out / f"beta{beta}", **settings).train()
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, reference_passes=len(passes), reference_pass_seconds=[round(p, 2) for p in passes])


def bench_worker(name: str, work: Path, size_name: str, case="random", model=None, data=None) -> dict:
    """`bench.py worker NAME` in a fresh process (harness.run_worker)."""
    flags = ["--size", size_name, "--case", case]
    flags += [x for flag, path in (("--model", model), ("--data", data)) if path is not None for x in (flag, str(path))]
    return harness.run_worker(Path(__file__), name, work, flags)


def main() -> None:
    parser = harness.script_parser(__doc__, results="Markdown file (full: RESULTS.md; scale, append: RESULTS-scale.md)")
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    only = ["lora", "smollm2", "scale", "append"]
    parser.add_argument("--only", choices=only, help="Run only these rows and update their section of --results")
    rows_help = "--only scale: comma-separated row counts; --only append: the cache sizes (default: the --size's)"
    parser.add_argument("--scale-rows", help=rows_help)
    tok_help = "--only scale or append: the tokenizer (default: smollm2 for full, char for smoke)"
    parser.add_argument("--scale-tokenizer", choices=["smollm2", "char"], help=tok_help)
    parser.add_argument("--case", default="random", choices=sorted(CASES), help=argparse.SUPPRESS)  # workers
    parser.add_argument("--model", help=argparse.SUPPRESS)  # workers: model directory
    parser.add_argument("--data", help=argparse.SUPPRESS)  # workers: dataset file
    args = parser.parse_args()
    work, size_name = Path(args.work), args.size
    if args.mode == "worker":
        model, data = (Path(x) if x else None for x in (args.model, args.data))
        harness.print_result(worker(args.name, work, CASES[args.case][size_name], Path(args.out), model, data))
        return

    work.mkdir(parents=True, exist_ok=True)
    name = "RESULTS-scale.md" if args.only in ("scale", "append") else "RESULTS.md"
    results, started = harness.default_results(args.results, size_name == "full", name), time.perf_counter()
    if args.only in ("scale", "append"):
        import bench_scale

        rows = tuple(int(x) for x in args.scale_rows.split(",")) if args.scale_rows else None
        run = bench_scale.run_scale if args.only == "scale" else bench_scale.run_append
        return run(work / args.only, size_name, results, rows, args.scale_tokenizer)
    if args.only == "smollm2":
        return run_smollm2(work / "smollm2", size_name, results)
    size = SIZES[size_name]
    print(f"building the model and data in {work} ...", flush=True)
    build_assets(work, size)
    if args.only == "lora":  # both tools' LoRA training on the main table's cache (precomputed first if absent)
        if not (work / "runs" / "ours_precompute" / "manifest.json").exists():
            bench_worker("ours_precompute", work, size_name)
        r = {name: bench_worker(name, work, size_name) for name in ("ours_train_lora", "trl_train_lora")}
        return harness.publish(render_lora(r, size, size_name), results, LORA_HEADING)
    # the main table: both tools' reference pass, training (online and precomputed) and 4-run sweep
    r, n_common, max_diff = harness.measure(MAIN_NAMES, lambda name: bench_worker(name, work, size_name), work)
    report = render(r, size, size_name, max_diff, n_common, time.perf_counter() - started)
    print("\n" + report)
    if results:
        results.write_text(with_other_sections(report, results.read_text() if results.exists() else ""))
        print(f"written to {results}")


def with_other_sections(report: str, old: str) -> str:
    """The main table's `report`, then every section of the `old` RESULTS.md it does not write."""
    written = {line for line in report.splitlines() if line.startswith("## ")}
    kept = [line for line in old.splitlines() if line.startswith("## ") and line not in written]
    return report + "".join("\n" + harness.get_section(old, heading) for heading in kept)


def run_smollm2(work: Path, size_name: str, results: Path | None) -> None:
    """`--only smollm2`: both tools on the real model, each stage in a fresh process, written to its own section, with
    the (query, key) pairs of its batches, dense against block mask (counted: nothing runs)."""
    from kto_pipeline import PrecomputeConfig

    # kto-pipeline's reference pass: the CLI's default batch_size (as in its worker), unless the size sets one
    size, started = {"reference_batch": PrecomputeConfig.batch_size} | SMOLLM2_SIZES[size_name], time.perf_counter()
    print(f"SmolLM2-135M-Instruct and {size['pairs']} HH-RLHF pairs in {work} ...", flush=True)
    # the first `pairs` single-turn pairs as unpaired rows (chosen desirable, then rejected), one file for both tools
    rows = harness.unpaired_rows(harness.hh_rlhf_pairs(work / "pairs.jsonl", size["pairs"], size["max_turns"]))
    model, data = harness.smollm2_dir(), harness.write_jsonl(work / "data.jsonl", rows, ensure_ascii=False)
    # a 30-layer model sums ~100 token log-probs a row: tests/test_real_model.py's relative tolerance too
    r, n_common, max_diff = harness.measure(
        SMOLLM2_NAMES, lambda name: bench_worker(name, work, size_name, "smollm2", model, data), work, rtol=1e-4
    )
    cache = work / "runs" / "ours_precompute"
    counts = count_pairs(cache, size["batch"], size["steps"], size["reference_batch"], REFERENCE_MAX_TOKENS)
    section = render_smollm2(r, size, size_name, max_diff, n_common, time.perf_counter() - started, counts)
    harness.publish(section, results, SMOLLM2_HEADING)


def count_pairs(cache_dir: Path, batch: int, steps: int, reference_batch: int, max_tokens: int) -> dict:
    """The (query, key) pairs attention computes in a cache's first `steps` training batches (both forwards) and its
    reference pass, each kernel packing the rows as a run on an accelerator would (its `AttentionCosts`); nothing
    runs on a model. {"train": [per batch: {kernel: AttentionPairs}], "reference": {kernel: AttentionPairs}}."""
    import torch
    from transformers import AutoConfig

    from kto_pipeline.cache import open_cache
    from kto_pipeline.objectives.items import batch_layout
    from kto_pipeline.objectives.kto import CacheRows, Collator
    from kto_pipeline.scoring.attention import tree_mask
    from kto_pipeline.scoring.block_mask import BLOCK_SIZE, AttentionPairs
    from kto_pipeline.scoring.logprobs import policy_attention
    from kto_pipeline.scoring.packing import AttentionCosts, layout_trees, pack_trees

    cache = open_cache(cache_dir)
    config = AutoConfig.from_pretrained(cache.manifest.reference_model)
    pair = 1.0 / (6 * config.get_text_config().hidden_size)
    costs = {"dense": AttentionCosts(pair), "block-mask": AttentionCosts(pair, block=BLOCK_SIZE)}
    rows = CacheRows(cache, cache.manifest.max_length)
    pad = cache.manifest.tokenizer.get("pad_token_id") or 0
    train = []
    for step in range(min(steps, len(rows) // batch)):
        members = [rows[i] for i in range(step * batch, (step + 1) * batch)]
        counted = {}
        for kernel, cost in costs.items():
            layout = batch_layout(Collator(pad, True, cost)(members))
            counted[kernel] = AttentionPairs()
            for queries, keys in policy_attention(layout, pair):
                counted[kernel].add(tree_mask(layout, queries, keys, None))
        train.append(counted)
    trees = [(r["prompt_ids"], [r["completion_ids"], r["kl_completion_ids"]]) for r in rows]
    sizes = [len(p) + len(c) + len(k) for p, (c, k) in trees]
    reference = {}
    for kernel, cost in costs.items():
        reference[kernel] = AttentionPairs()
        for passed in pack_trees(sizes, reference_batch, max_tokens, cost):
            members = [t for row in passed for t in row]
            local = {t: i for i, t in enumerate(members)}
            layout = layout_trees([trees[t] for t in members], [[local[t] for t in row] for row in passed], pad)
            tokens = torch.arange(layout.input_ids.numel()).reshape(layout.input_ids.shape)
            reference[kernel].add(tree_mask(layout, tokens, tokens, None))
    return {"train": train, "reference": reference}


def pairs_table(counts: dict) -> list[str]:
    """Markdown rows: one per training batch, then the training total and the reference pass."""

    def cells(pairs: dict) -> tuple:  # (query, key) pairs needed and computed, dense mask then block mask
        dense, block = pairs["dense"], pairs["block-mask"]
        return dense.needed, dense.dense, block.needed, block.block_mask

    def row(what: str, n: tuple) -> str:
        return harness.md_row(what, *(f"{x / 1e6:.2f}" for x in n), f"{n[1] / max(n[3], 1):.2f}x")

    head = "| forwards | needed (dense layout) | dense mask | needed (block-mask layout) | block mask (whole tiles) "
    lines = harness.table_head(head + "| dense / block |")
    batches = [cells(pairs) for pairs in counts["train"]]
    lines += [row(f"training batch {i}", n) for i, n in enumerate(batches, 1)]
    if batches:
        lines.append(row(f"**training, {len(batches)} batches**", [sum(x) for x in zip(*batches, strict=True)]))
    return [*lines, row("**reference pass**", cells(counts["reference"]))]


def _ratio_cells(what: str, ours: float, trl_: float, fmt: str, per: str = "trl / ours") -> tuple:
    """A row of the main and LoRA tables: (measurement, kto-pipeline, trl, the ratio taken `per`)."""
    ratio = ours / trl_ if per == "ours / trl" else trl_ / ours
    return what, f"{ours:{fmt}}", f"{trl_:{fmt}}", f"{ratio:.2f}x"


def render_smollm2(
    r: dict, size: dict, size_name: str, max_diff: float, n_common: int, seconds: float, counts: dict
) -> str:
    """The `--only smollm2` section: the table against trl and its notes, then count_pairs' `counts`."""
    op, tp, ot, tto, ttp = (r[name] for name in SMOLLM2_NAMES)
    o_step, on_step, pre_step = (median_step(x["step_seconds"]) for x in (ot, tto, ttp))
    o_proc, on_proc, pre_proc = (x["process_seconds"] for x in (ot, tto, ttp))
    o_rss, on_rss, pre_rss = (x["peak_rss_mib"] for x in (ot, tto, ttp))
    tokens_s, rows_s = ([x[what] / x["seconds"] for x in (op, tp)] for what in ("tokens", "rows"))
    steps, batch, reference_batch = size["steps"], size["batch"], size["reference_batch"]
    steps_text, both = f"{steps} steps x batch {batch}", op["process_seconds"] + o_proc
    whole = f"train, whole process (s, {steps_text})"
    rows = [
        vs_row("reference pass, tokens/s", *tokens_s, ".0f", "ours / trl", ">= 3x"),
        vs_row("reference pass, rows/s", *rows_s, ".2f", "ours / trl"),
        vs_row("train, median step (s), vs trl online", o_step, on_step, ".2f", goal=">= 4x"),
        vs_row(f"{whole}, vs trl online", o_proc, on_proc, ".1f", goal=">= 4x"),
        vs_row("train, median step (s), vs trl precomputed", o_step, pre_step, ".2f"),
        vs_row(f"{whole}, vs trl precomputed", o_proc, pre_proc, ".1f"),
        vs_row("precompute + train processes (s) vs one trl online process", both, on_proc, ".1f"),
        vs_row("train peak RSS (MiB), vs trl online", o_rss, on_rss, ".0f", "ours / trl", "<= 0.7x"),
        vs_row("train peak RSS (MiB), vs trl precomputed", o_rss, pre_rss, ".0f", "ours / trl"),
    ]
    for what, ours, theirs in (("reference pass", op, tp), (f"training ({steps_text})", ot, ttp)):
        (text, eff), (trl_text, _) = (harness.efficiency(x.get("token_counts")) for x in (ours, theirs))
        ok, label = harness.met(None if eff is None else eff >= 0.9), f"token efficiency (needed / executed), {what}"
        rows.append(harness.md_row(label, text, trl_text, "", ">= 90% (ours)", ok))
    command = f"`python benchmarks/bench.py --size {size_name} --only smollm2` (in `make bench`)"
    lines = [
        SMOLLM2_HEADING,
        "",
        *provenance(command, seconds, *PACKAGES),
        f"- model: {harness.SMOLLM2_TEXT}",
        f"- data: the first {size['pairs']} single-turn pairs of the bundled HH-RLHF harmless-base sample, each a "
        f"desirable (chosen) and an undesirable (rejected) conversational row: {op['rows']} rows scored, in the "
        f"model's ChatML template (system prompt included); max_length {size['max_length']}",
        f"- settings, both tools: float32, gradient checkpointing off, batch {batch} x 1 process, sequential order, "
        f"{steps} steps, AdamW lr {LEARNING_RATE}, beta 0.1, each stage in a fresh process; trl online: KTOTrainer "
        "with its reference model (the same directory); trl precomputed: `precompute_ref_log_probs=True`; "
        f"kto-pipeline's reference pass: the CLI's default `--batch-size {reference_batch}` (sequences, packed).",
        f"- correctness: reference log-probs agree on {n_common} sequences, max |diff| {max_diff:.1e}",
        "",
        *harness.table_head("| measurement | kto-pipeline | trl | ratio | goal | met |"),
        *rows,
        "",
        "- reference pass: kto-pipeline's `precompute` (length-sorted, token-budgeted batches) vs trl's "
        f"`precompute_ref_log_probs` (batches of {batch} in dataset order); tokens: the unpadded tokens of the "
        "completion and KL sequences (each prompt counted twice), for both tools alike.",
        "- train step: median over steps 2..N (the first pays warm-up costs); whole process: the worker from start to "
        "exit (imports, loading, the steps, saving); kto-pipeline's training reads its precompute process' cache.",
        "- token efficiency: needed = each prompt once + its completion + its KL completion (truncated to max_length); "
        "kto-pipeline's from the cache manifest's `timing` and trainer_state.json (n/a where not recorded); trl's "
        "executed = (padded completion width + padded KL width) x rows of its batches (right-padded to the longest "
        f"sequence; KL: prompt + the previous row's completion), over the reference pass's batches of {batch} and the "
        f"{steps} training batches. Training counts the policy's passes; trl online's reference model runs them too, "
        f"twice the tokens ({harness.efficiency(tto.get('token_counts'))[0]} for the policy).",
        *harness.run_notes({"ours": ot, "trl online": tto, "trl precomputed": ttp}),
        "",
        "Attention on an accelerator, counted (`bench.count_pairs` on the cache above; millions of (query, key) pairs; "
        "rows packed as each kernel runs them; the block mask runs each tile it touches whole, 128 x 128 pairs):",
        "",
        *pairs_table(counts),
        "",
    ]
    return "\n".join(lines)


def render(r: dict, size: dict, size_name: str, max_diff: float, n_common: int, seconds: float) -> str:
    op, tp, ot, tto, ttp = (r[name] for name in SMOLLM2_NAMES)
    o_step, on_step, pre_step = (median_step(x["step_seconds"]) for x in (ot, tto, ttp))
    o_rss, on_rss, pre_rss = (x["peak_rss_mib"] for x in (ot, tto, ttp))
    o_grow, on_grow, pre_grow = (x["peak_rss_mib"] - x["baseline_rss_mib"] for x in (ot, tto, ttp))
    o_sweep, on_sweep, pre_sweep = (r[x]["seconds"] for x in MAIN_NAMES[5:])
    rows_s, tokens_s = ([x[what] / x["seconds"] for x in (op, tp)] for what in ("rows", "tokens"))
    hidden = size["hidden"]
    params = size["vocab"] * hidden * 2 + size["layers"] * (4 * hidden**2 + 3 * hidden * size["intermediate"])
    ref_mib = params * 4 / 2**20
    sweep, stamp = f"sweep of {len(SWEEP_BETAS)} runs", harness.utc_stamp()
    rows = [
        ("reference pass, rows/s", *rows_s, ".1f", "ours / trl"),
        ("reference pass, tokens/s", *tokens_s, ".0f", "ours / trl"),
        ("train step (s), vs trl online", o_step, on_step, ".3f"),
        ("train step (s), vs trl precomputed", o_step, pre_step, ".3f"),
        ("train peak RSS (MiB), vs trl online", o_rss, on_rss, ".0f"),
        ("train peak RSS (MiB), vs trl precomputed", o_rss, pre_rss, ".0f"),
        ("train RSS growth above post-import baseline (MiB), vs trl online", o_grow, on_grow, ".0f"),
        ("train RSS growth above baseline (MiB), vs trl precomputed", o_grow, pre_grow, ".0f"),
        (f"{sweep} x {size['sweep_steps']} steps (s), vs trl online", o_sweep, on_sweep, ".1f"),
        (f"{sweep} (s), vs trl precomputed", o_sweep, pre_sweep, ".1f"),
    ]
    below, trl_sweep, sweep_ratio = tto["peak_rss_mib"] - o_rss, r["trl_sweep_precomputed"], on_sweep / o_sweep
    ref_ratio = rows_s[0] / rows_s[1]
    below_goal = f"train peak RSS below trl online by >= the reference model ({ref_mib:.0f} MiB)"
    lines = [
        "# Benchmark: kto-pipeline vs trl.KTOTrainer",
        "",
        *provenance(f"`python benchmarks/bench.py --size {size_name}` (`make bench`)", seconds, *PACKAGES, date=stamp),
        f"- model: Qwen2 with random weights, hidden {hidden}, {size['layers']} layers, vocab "
        f"{size['vocab']}, untied LM head: about {params / 1e6:.1f}M parameters ({ref_mib:.0f} MiB in float32)",
        f"- data: {size['rows']} unpaired rows, prompts {size['prompt'][0]}-{size['prompt'][1]} and completions "
        f"{size['completion'][0]}-{size['completion'][1]} tokens (a character each), max_length {size['max_length']}",
        f"- settings, both tools: float32 (bf16 off), gradient checkpointing off, batch {size['batch']} x 1 process, "
        f"sequential order, AdamW lr {LEARNING_RATE}, beta 0.1",
        f"- correctness: reference log-probs agree on {n_common} sequences, max |diff| {max_diff:.1e}",
        "",
        "Ratios are measured in this one run (absolute times drift on shared machines). `x` > 1 favours kto-pipeline.",
        "",
        *table("| measurement | kto-pipeline | trl | ratio (trl / ours) |", (_ratio_cells(*row) for row in rows)),
        "",
        "## Against the goals",
        "",
        f"- date: {stamp} (the run above)",
        "",
        *harness.goals_table(
            ("reference pass >= 2x trl's rows/s", f"{ref_ratio:.2f}x", ref_ratio >= 2.0),
            ("train step >= 1.4x faster than trl online", f"{on_step / o_step:.2f}x", on_step / o_step >= 1.4),
            ("train step no slower than trl precomputed", f"{pre_step / o_step:.2f}x", pre_step / o_step >= 1.0),
            (below_goal, f"{below:.0f} MiB below", below >= ref_mib),
            ("train peak RSS <= trl precomputed", f"{o_rss:.0f} vs {pre_rss:.0f} MiB", o_rss <= pre_rss),
            ("4-run sweep >= 1.5x faster than 4 trl online runs", f"{sweep_ratio:.2f}x", sweep_ratio >= 1.5),
        ),
        "",
        f"- reference passes in the sweeps: kto-pipeline 1; trl precomputed {trl_sweep['reference_passes']} "
        f"({trl_sweep['reference_pass_seconds']} s): its cache did not carry over from one beta to the next.",
        f"- the reference model's own float32 footprint is about {ref_mib:.0f} MiB; trl online holds it in memory "
        f"during training, kto-pipeline does not (peak RSS difference vs trl online: {below:.0f} MiB).",
        f"- step times are medians over steps 2..{size['steps']}; raw: ours {raw_steps(ot)}, trl online "
        f"{raw_steps(tto)}, trl precomputed {raw_steps(ttp)}.",
        "",
    ]
    return "\n".join(lines)


def render_lora(r: dict, size: dict, size_name: str) -> str:
    ours, trl_ = r["ours_train_lora"], r["trl_train_lora"]
    growth = (x["peak_rss_mib"] - x["baseline_rss_mib"] for x in (ours, trl_))
    steps = (median_step(x["step_seconds"]) for x in (ours, trl_))
    rows = [
        _ratio_cells("LoRA train step (s)", *steps, ".3f"),
        _ratio_cells("LoRA train peak RSS (MiB)", ours["peak_rss_mib"], trl_["peak_rss_mib"], ".0f"),
        _ratio_cells("LoRA RSS growth above post-import baseline (MiB)", *growth, ".0f"),
    ]
    lines = [
        LORA_HEADING,
        "",
        *provenance(f"`python benchmarks/bench.py --size {size_name} --only lora`", None, *PACKAGES),
        f"- LoRA r={LORA['r']}, alpha={LORA['alpha']}, dropout={LORA['dropout']}, all-linear, same model, data and "
        f"settings as above (float32, batch {size['batch']}, sequential, {size['steps']} steps). kto-pipeline: "
        "`train --lora-r 16` on the cache; trl: the same `peft_config`, reference online with the adapters disabled.",
        "",
        *table("| measurement | kto-pipeline | trl | ratio (trl / ours) |", rows),
        "",
        f"- raw step times: ours {raw_steps(ours)}, trl {raw_steps(trl_)}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
