"""Precision regimes on the real model: (a) bf16 reference caches against a float32 one, (b) step-1 rewards and KL
of each cache x `train --no-bf16` / `--bf16`, (c) trl.KTOTrainer (1.16) alike, float32 and bf16, precomputed and
online. Every measurement runs in a fresh process; bf16 is emulated on a CPU without it (slow), hence few rows.

    kto-pipeline demo --workdir benchmarks/.work/demo         # once: the demo's model and data (--demo-dir)
    .venv/bin/python benchmarks/bench_precision.py            # writes benchmarks/RESULTS-precision.md
    .venv/bin/python benchmarks/bench_precision.py --pairs 8 --batch 8 --results FILE
"""

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import harness
from harness import TRL_RUN, WORK_DIR, md_row, table_head, token_keys, utc_stamp

DEMO = WORK_DIR / "demo"  # --demo-dir: `kto-pipeline demo --workdir DIR` writes the model and the data there
MODEL, DATA = "models/SmolLM2-135M-Instruct", "data/train.jsonl"  # --model, --data: under --demo-dir by default
RESULTS = harness.HERE / "RESULTS-precision.md"
SEED = TRL_RUN["seed"]  # train and trl (data order is sequential anyway)

CACHES = (  # (name, PrecomputeConfig precision settings, what it is)
    ("float32", dict(dtype="float32", bf16=False), "float32 weights, no autocast"),
    ("autocast", dict(dtype="float32", bf16=True), "float32 weights under bf16 autocast"),
    ("bf16-weights", dict(dtype="bfloat16", bf16=False), "bf16 weights, no autocast"),
)
TRAIN_REGIMES = (("no-bf16", False), ("bf16", True))
TRL_RUNS = (  # (worker name, bf16, use_cpu, precompute_ref_log_probs, datasets cache dir under work/hf-cache)
    ("trl_float32_precomputed", False, False, True, "shared"),
    ("trl_float32_online", False, False, False, "trl_float32_online"),
    ("trl_bf16", True, False, True, "trl_bf16"),  # as a GPU user writes it: transformers needs use_cpu on a CPU
    ("trl_bf16_precomputed", True, True, True, "trl_bf16_precomputed"),
    ("trl_bf16_online", True, True, False, "trl_bf16_online"),
    ("trl_bf16_after_float32", True, True, True, "shared"),  # does trl reuse the float32 reference pass?
)
# every worker's flags, with their defaults (the report's command names those that differ, and the paths given)
DEFAULTS = dict(model=None, data=None, pairs=4, batch=4, max_length=192, beta=0.1)
PATHS = {"demo_dir": "DIR", "model": "DIR", "data": "FILE"}
STEP1_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl", "logps/chosen", "logps/rejected", "loss")


def caches_worker(args: argparse.Namespace, out: Path) -> dict:
    """(a): the three caches, one after the other in this process; their reference-pass seconds."""
    from kto_pipeline import PrecomputeConfig, precompute
    from kto_pipeline.cache import read_manifest

    result = {}
    for name, precision, _ in CACHES:
        paths = dict(model=args.model, dataset=str(args.work / "pairs.jsonl"), output=str(out / name))
        config = PrecomputeConfig(**paths, max_length=args.max_length, overwrite=True, **precision)
        manifest = read_manifest(precompute(config))
        result[name] = dict(precision=list(manifest.precision), seconds=manifest.timing["reference_pass_seconds"])
    return result


def ours_train_worker(args: argparse.Namespace, out: Path) -> dict:
    """(b): one step at learning rate 0 of each cache in this worker's train regime; the step-1 metrics."""
    from kto_pipeline import train
    from kto_pipeline.cache import read_manifest
    from kto_pipeline.runtime.precision import Regime, regime_mismatch

    bf16, result = args.name == "ours_train_bf16", {}
    settings = dict(batch=args.batch, steps=1, learning_rate=0.0, bf16=bf16, seed=SEED, beta=args.beta)
    regime = Regime("float32", "bfloat16" if bf16 else None)
    for name, _, _ in CACHES:
        cache, run_dir = args.work / "runs" / "caches" / name, out / name
        res = train(harness.ours_train_config(cache, run_dir, **settings))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        step1 = next(r for r in records if r.get("step") == 1 and not any(k.startswith("eval_") for k in r))
        mismatch = regime_mismatch(Regime(*read_manifest(cache).precision), regime)
        result[name] = dict(step1={k: step1.get(k) for k in STEP1_KEYS}, step_seconds=res.step_seconds)
        result[name] |= dict(precision=harness.trainer_state(run_dir).get("precision"), warned=mismatch is not None)
        for weights in run_dir.glob("*.safetensors"):  # 0.5 GB each, and the weights did not move (lr 0)
            weights.unlink()
    return result


def trl_worker(args: argparse.Namespace, out: Path) -> dict:
    """(c): trl's step-1 metrics, its reference forwards and (precomputed) its reference log-probs by token ids."""
    from trl import KTOTrainer

    bf16, use_cpu, precompute, _ = {name: run for name, *run in TRL_RUNS}[args.name]
    forwards = []
    harness.time_calls(KTOTrainer, "compute_ref_log_probs", lambda seconds, *a, **kw: forwards.append(seconds))
    # bench.py's trl runs (float32 policy, disk-backed dataset, sequential, no gradient checkpointing): one step
    run = dict(batch=args.batch, max_length=args.max_length, precompute=precompute, bf16=bf16, use_cpu=use_cpu)
    run |= dict(beta=args.beta, learning_rate=0.0, max_steps=1, precompute_ref_batch_size=args.batch, **TRL_RUN)
    trainer = harness.trl_trainer(args.model, args.work / "rows.jsonl", out, **run)
    before = len(forwards)
    result = dict(mixed_precision=str(trainer.accelerator.mixed_precision), reference_forwards_before_training=before)
    if precompute:
        ds = trainer.train_dataset
        keys = token_keys(ds["prompt_ids"], ds["completion_ids"], args.max_length)
        refs = zip(keys, ds["ref_logps"], ds["ref_KL_logps"], strict=True)
        result["ref"] = [dict(key=key, ref_logp=r, ref_kl_logp=k) for key, r, k in refs]
    if args.name == "trl_bf16_after_float32" and before > 0:  # its step 1 would be trl_bf16_precomputed's
        return dict(result, skipped=True)
    start = time.perf_counter()
    trainer.train()
    result["train_seconds"] = time.perf_counter() - start
    step1 = next(r for r in trainer.state.log_history if r.get("step") == 1 and "loss" in r)
    return result | dict(step1={k: step1.get(k) for k in STEP1_KEYS})


def diff_stats(a: list[float], b: list[float]) -> dict:
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return dict(max=max(diffs), mean=statistics.fmean(diffs), n=len(diffs))


def all_tokens(cache: dict) -> list[float]:
    return [x for row in cache["ref_token_logps"] + cache["ref_kl_token_logps"] for x in row]


def compare_caches(caches: dict[str, dict]) -> dict[str, dict]:
    """Each bf16 cache against the float32 one: the same rows and tokens, then |diff| of the log-probs."""
    base, out = caches["float32"], {}
    for name, other in ((name, c) for name, c in caches.items() if name != "float32"):
        for column in ("example_id", "prompt_ids", "completion_ids", "kl_completion_ids"):
            if other[column] != base[column]:
                raise SystemExit(f"cache {name} does not hold the rows of the float32 cache ({column} differs)")
        out[name] = {k: diff_stats(other[k], base[k]) for k in ("ref_logp", "ref_kl_logp")}
        out[name]["tokens"] = diff_stats(all_tokens(other), all_tokens(base))
    return out


def trl_reference_stats(trl: dict, caches: dict[str, dict], max_length: int) -> dict:
    """trl's bf16 reference passes against its float32 one, and trl's float32 against our float32 cache."""
    out: dict = {"vs_trl_float32": {}}
    f32 = trl.get("trl_float32_precomputed", {}).get("ref")
    if not f32:
        return out
    for name, t in trl.items():
        if t.get("ref"):
            pairs = {k: ([x[k] for x in t["ref"]], [x[k] for x in f32]) for k in ("ref_logp", "ref_kl_logp")}
            out["vs_trl_float32"][name] = {k: diff_stats(*v) for k, v in pairs.items()}
    c = caches["float32"]
    ours = dict(zip(token_keys(c["prompt_ids"], c["completion_ids"], max_length), c["ref_logp"], strict=True))
    common = [x for x in f32 if x["key"] in ours]
    stats = diff_stats([x["ref_logp"] for x in common], [ours[x["key"]] for x in common]) if common else {}
    out["trl_float32_vs_ours"] = dict(matched=len(common), rows=len(f32), **stats)
    return out


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _rewards(step1: dict) -> list[str]:
    signed = (step1[f"rewards/{k}"] for k in ("chosen", "rejected", "margins"))
    return [*("n/a" if x is None else f"{x:+.3g}" for x in signed), _g(step1["kl"])]


def train_runs(r: dict):
    """(cache name, what it is, train regime, regimes match, run) of each kto-pipeline training run, in table order."""
    for cache_name, _, what in CACHES:
        for regime_name, bf16 in TRAIN_REGIMES:
            if (run := r["train"].get(regime_name, {}).get(cache_name)) is not None:
                match = r["caches"][cache_name]["precision"] == ["float32", "bfloat16" if bf16 else None]
                yield cache_name, what, regime_name, match, run


def section(title: str, date: str, header: str, *text: str) -> list[str]:
    return ["", f"## {title}", "", f"- date: {date}", "", *(x for p in text for x in (p, "")), *table_head(header)]


def render(r: dict, args: argparse.Namespace, seconds: float, loads: tuple) -> str:
    stats, f32, vs = r["cache_stats"], r["cache_rows"]["float32"], r["trl_ref_stats"].get("vs_trl_float32", {})
    n_rows, n_tokens = len(f32["ref_logp"]), stats[next(iter(stats))]["tokens"]["n"]
    abs_logp = [abs(x) for x in f32["ref_logp"]]
    mean_logp = statistics.fmean(abs_logp)
    date, reused = r.get("date") or utc_stamp(), r.get("trl_reused_from")
    command_ = f"`{command(args)}` (from the repository root, with the project's .venv)"
    head = harness.provenance(command_, seconds, "kto-pipeline", "trl", "transformers", "torch", date=date)
    head[1] += f"; load average (1 min) {loads[0]:.2f} before the first worker, {loads[1]:.2f} at the end (workers: "
    head[1] += f"{os.cpu_count()} threads; a higher load means shared cores, every time below slower than when idle)"
    lines = [
        "# Precision regimes on SmolLM2-135M-Instruct",
        "",
        *head,
        f"- model: {_shown(args.model, MODEL, args.demo_dir)}",
        f"- data: the first {args.pairs} pairs of {_shown(args.data, DATA, args.demo_dir)} (the demo's HH-RLHF "
        f"harmless-base single-turn pairs, chosen desirable, rejected undesirable): {n_rows} rows, {n_tokens} scored "
        f"tokens (completions + KL completions), max_length {args.max_length}; few: bf16 is emulated on this CPU.",
        f"- training: one step at learning rate 0 (step-1 metrics come before the optimizer step), batch {args.batch} "
        f"(the first {args.batch} rows), beta {args.beta}, seed {SEED}.",
        *section(
            "(a) bf16 caches against the float32 cache",
            date,
            "| cache | ref_logp max abs diff | ref_logp mean abs diff | mean abs diff / mean abs ref_logp | "
            "ref_kl_logp max abs diff | ref_kl_logp mean abs diff | per-token max abs diff | per-token mean abs diff | "
            "reference pass (s) |",
            f"Typical magnitudes in the float32 cache: |ref_logp| mean {mean_logp:.3g} (median "
            f"{statistics.median(abs_logp):.3g}, max {max(abs_logp):.3g}); |ref_kl_logp| mean "
            f"{statistics.fmean(abs(x) for x in f32['ref_kl_logp']):.3g}; per-token |log-prob| mean "
            f"{statistics.fmean(abs(x) for x in all_tokens(f32)):.3g}.",
        ),
    ]
    labels = {name: what for name, _, what in CACHES}
    for name, s in stats.items():
        cells = [_g(s[k][m]) for k in ("ref_logp", "ref_kl_logp", "tokens") for m in ("max", "mean")]
        share = f"{s['ref_logp']['mean'] / mean_logp:.2%}"
        lines.append(md_row(labels[name], *cells[:2], share, *cells[2:], f"{r['caches'][name]['seconds']:.1f}"))
    lines += [
        "",
        f"- diffs over {n_rows} rows (sequence sums) or {n_tokens} tokens, same token ids in both caches (checked); "
        f"float32 reference pass {r['caches']['float32']['seconds']:.1f} s. A log-prob diff d moves a row's reward by "
        f"beta x d (beta {args.beta}).",
        *section(
            "(b) kto-pipeline: step-1 rewards and KL of each cache x train regime",
            date,
            "| cache made in | train in | regimes match | train warned | rewards/chosen | rewards/rejected | "
            "rewards/margins | kl | policy logps/chosen | step (s) |",
        ),
    ]
    yes = {True: "yes", False: "no"}
    for _, what, regime_name, match, run in train_runs(r):
        cells = [what, f"`train --{regime_name}` ({run['precision']})", yes[match], yes[run["warned"]]]
        cells += [*_rewards(run["step1"]), f"{run['step1']['logps/chosen']:.7g}", f"{run['step_seconds'][0]:.0f}"]
        lines.append(md_row(*cells))
    reuse = f" Runs reused from {reused} (`--reuse-trl`: same trl, settings, rows)." if reused else ""
    lines += [
        "",
        "- rewards/chosen, rewards/rejected: the batch's mean over its desirable / undesirable rows of beta x (policy "
        "- cached reference log-prob); at step 1 the policy is the reference: only rounding differs. kl: KTO's z0 = "
        "max(0, the batch's mean (policy - reference) log-prob of the KL completions), not times beta (as in trl).",
        "- policy logps/chosen: the policy's mean sequence log-prob of the desirable rows (its regime shows here); "
        "train warned: `train` printed its regime-mismatch warning.",
        *section(
            "(c) trl.KTOTrainer in the same setting",
            reused or date,
            "| trl run | KTOConfig | reference | reference forwards before training | its ref_logps vs trl's float32 "
            "pass: max abs diff (mean) | rewards/chosen | rewards/rejected | rewards/margins | kl | train (s) |",
            f"trl gets the step-1 batch only (the first {args.batch} rows above, the same token ids: checked below)."
            + reuse,
        ),
    ]
    for name, bf16, use_cpu, precompute, cache_dir in TRL_RUNS:
        if (t := r["trl"].get(name)) is None:
            continue
        config = f"bf16={bf16}" + (", use_cpu=True" if use_cpu else "")
        reference = "precompute_ref_log_probs=True" if precompute else "online (reference model)"
        reference += ", datasets cache shared with trl_float32_precomputed" if cache_dir == "shared" and bf16 else ""
        if "failed" in t:
            lines.append(f"| {name} | {config} | {reference} | FAILED: `{t['failed']}` | | | | | | |")
            continue
        d = vs.get(name)
        versus = "n/a (online)" if d is None else f"{_g(d['ref_logp']['max'])} ({_g(d['ref_logp']['mean'])})"
        versus = "(itself)" if name == "trl_float32_precomputed" else versus
        cells = [name, f"{config} (accelerate: {t['mixed_precision']})", reference]
        cells += [t["reference_forwards_before_training"], versus]
        if t.get("skipped"):
            cells += ["not trained: it ran its own reference pass, so its step 1 is trl_bf16_precomputed's", *[""] * 4]
        else:
            cells += [*_rewards(t["step1"]), f"{t['train_seconds']:.0f}"]
        lines.append(md_row(*cells))
    lines += [""]
    if (d := vs.get("trl_bf16_precomputed")) is not None:
        ref, kl, ours = d["ref_logp"], d["ref_kl_logp"], stats["autocast"]["ref_logp"]
        lines.append(
            f"- trl's bf16 reference pass (float32 weights under bf16 autocast) vs its float32 one, {ref['n']} rows: "
            f"ref_logps max abs diff {_g(ref['max'])}, mean {_g(ref['mean'])}; ref_KL_logps max {_g(kl['max'])}, mean "
            f"{_g(kl['mean'])} (kto-pipeline's autocast cache in (a): max {_g(ours['max'])}, mean {_g(ours['mean'])})."
        )
    if (s := r["trl_ref_stats"].get("trl_float32_vs_ours")) is not None:
        same = f"{s['matched']} of {s['rows']} rows have the same token ids, max abs diff {_g(s.get('max'))}"
        lines.append(f"- sanity: trl's float32 reference log-probs against kto-pipeline's float32 cache: {same}.")
    if (forwards := r["trl"].get("trl_bf16_after_float32", {}).get("reference_forwards_before_training")) is not None:
        found = f"{forwards} reference forwards: it did not reuse the float32 pass"
        if forwards == 0:
            found = "no reference forward: it silently reused the float32 log-probs (float32 cache, bf16 training)"
        lines.append(
            "- trl_bf16_after_float32: a bf16 run on trl_float32_precomputed's datasets cache (trl keys the reference "
            f"pass by the dataset's fingerprint, the weights' hash and whether KL is computed); trl ran {found}."
        )
    processes = [
        f"{name} " + (f"{x['process_seconds']:.0f}" if "process_seconds" in x else "(failed)")
        for name, x in r["processes"].items()
    ]
    lines += [
        "- trl's KL completions pair each row's prompt with the previous row's completion, kto-pipeline's follow the "
        "cache's seeded cycle: kl is over different sequences, the rewards over the same rows.",
        "- trl online: the reference model (float32, the policy's dtype) runs in the step under the policy's autocast; "
        "trl precomputed: the policy runs the reference pass before training, under the accelerator's autocast.",
        "",
        "## Summary (computed from the tables above)",
        "",
        *summary_lines(r),
        "",
        "Worker processes (s): " + ", ".join(processes),
        "",
    ]
    return "\n".join(lines)


def summary_lines(r: dict) -> list[str]:
    def largest(runs: list[dict]) -> float:
        return max(abs(x["step1"][k]) for x in runs for k in ("rewards/chosen", "rewards/rejected"))

    out, runs = [], list(train_runs(r))
    for label, match in (("matching", True), ("mismatched", False)):
        if found := [(cache, regime, run) for cache, _, regime, m, run in runs if m == match]:
            cache, regime, _ = max(found, key=lambda x: largest([x[2]]))
            out.append(
                f"- kto-pipeline, {label} regimes ({len(found)} runs): largest step-1 |reward| "
                f"{largest([x[2] for x in found]):.3g} (cache {cache}, train --{regime}); largest kl "
                f"{max(x[2]['step1']['kl'] for x in found):.3g}."
            )
    mismatched = [run for *_, m, run in runs if not m]
    if (matched := r["train"].get("bf16", {}).get("autocast")) is not None and mismatched:
        worst, best = largest(mismatched), largest([matched])
        out.append(
            f"- kto-pipeline, bf16 cache (float32 weights under autocast) with train --bf16: |reward| up to "
            f"{best:.3g}, {best / worst:.0%} of the largest mismatched one ({worst:.3g}); float32 with float32: "
            f"{largest([r['train']['no-bf16']['float32']]):.3g}."
        )
    for name, t in r["trl"].items():
        if "step1" in t:
            out.append(f"- {name}: step-1 |reward| up to {largest([t]):.3g}, kl {t['step1']['kl']:.3g}.")
    return out + [f"- {name} failed: `{t['failed']}`" for name, t in r["trl"].items() if "failed" in t]


def parse_args() -> argparse.Namespace:
    parser = harness.script_parser(
        __doc__, str(WORK_DIR / "precision"), results="Markdown file to write", default=str(RESULTS)
    )
    parser.add_argument("--demo-dir", type=Path, default=DEMO, help=f"the demo's workdir (default {DEMO})")
    parser.add_argument("--model", help=f"Hugging Face model directory (or hub id; default DEMO_DIR/{MODEL})")
    parser.add_argument("--data", help=f"paired conversational rows (.jsonl; default DEMO_DIR/{DATA})")
    parser.add_argument("--pairs", type=int, default=DEFAULTS["pairs"], help="use the first PAIRS pairs (2 rows each)")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="per-device batch of every training run")
    parser.add_argument("--max-length", type=int, default=DEFAULTS["max_length"], help="the demo's max length")
    parser.add_argument("--beta", type=float, default=DEFAULTS["beta"])
    parser.add_argument("--no-trl", action="store_true", help="skip (c), the trl runs")
    parser.add_argument("--reuse-trl", action="store_true", help="(c) from the last run's WORK/results.json")
    parser.add_argument("--render-only", action="store_true", help="rewrite --results from WORK/results.json")
    args = parser.parse_args()
    args.work = Path(args.work).resolve()
    args.given = [flag for flag in PATHS if getattr(args, flag) not in (None, DEMO)]
    args.model, args.data = args.model or str(args.demo_dir / MODEL), args.data or str(args.demo_dir / DATA)
    return args


def command(args: argparse.Namespace) -> str:
    """The command as run: the paths given, then the flags of DEFAULTS that differ from their default."""
    paths = [f"--{k.replace('_', '-')} {kind}" for k, kind in PATHS.items() if k in args.given]
    changed = [k for k, v in DEFAULTS.items() if v is not None and getattr(args, k) != v]
    flags = [*paths, *(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in changed)]
    return " ".join(["python benchmarks/bench_precision.py", *flags])


def _shown(path: str, default: str, demo: Path) -> str:
    """A path of the report without the machine's directories: its place in the demo's workdir, else its name."""
    in_demo = Path(path) == Path(demo) / default
    return f"`{default}` of the demo's workdir (`--demo-dir`)" if in_demo else f"`{Path(path).name}`"


def main() -> None:
    args = parse_args()
    if args.mode == "worker":
        workers = dict(caches=caches_worker, ours_train_no_bf16=ours_train_worker, ours_train_bf16=ours_train_worker)
        harness.print_result(workers.get(args.name, trl_worker)(args, Path(args.out)))
        return
    if args.render_only:
        r = json.loads((args.work / "results.json").read_text())
        harness.publish(render(r, args, r["seconds"], r["loads"]), args.results)
        return
    if args.batch > 2 * args.pairs:
        raise SystemExit(f"--batch {args.batch} needs at least {args.batch} rows: --pairs >= {-(-args.batch // 2)}")
    started, load_start, work = time.perf_counter(), os.getloadavg()[0], args.work
    earlier = json.loads((work / "results.json").read_text()) if args.reuse_trl else None
    shutil.rmtree(work, ignore_errors=True)  # from scratch: no cache, run or datasets cache of an earlier run
    work.mkdir(parents=True)
    # the first PAIRS pairs, for precompute; for trl, the step-1 batch of the same rows unpaired (pair i -> its chosen,
    # then its rejected row, as kto-pipeline's example ids 2i, 2i+1): trl's KL rows come from the batch
    lines = [ln for ln in Path(args.data).read_text(encoding="utf-8").splitlines() if ln.strip()][: args.pairs]
    if len(lines) < args.pairs:
        raise SystemExit(f"{args.data} has only {len(lines)} pairs, --pairs asks for {args.pairs}")
    (work / "pairs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    harness.write_jsonl(work / "rows.jsonl", harness.unpaired_rows(json.loads(line) for line in lines)[: args.batch])
    flags = [x for flag in DEFAULTS for x in (f"--{flag.replace('_', '-')}", str(getattr(args, flag)))]

    def run(name: str, cache_dir: str | None = None, must_succeed: bool = True) -> dict:
        env = {"HF_DATASETS_CACHE": str(work / "hf-cache" / (cache_dir or name))}
        return harness.run_worker(Path(__file__), name, work, flags, env=env, must_succeed=must_succeed, width=26)

    r: dict = {"processes": {}, "train": {}, "trl": {}}
    print(f"(a) three caches of {2 * args.pairs} rows ...", flush=True)
    r["caches"] = r["processes"]["caches"] = run("caches")
    from kto_pipeline.cache import open_cache

    r["cache_rows"] = {name: open_cache(work / "runs" / "caches" / name).table.to_pydict() for name, _, _ in CACHES}
    r["cache_stats"] = compare_caches(r["cache_rows"])
    print("(b) one step at learning rate 0 of each cache, train --no-bf16 and --bf16 ...", flush=True)
    for regime_name, _ in TRAIN_REGIMES:
        res = r["processes"][f"ours_train_{regime_name}"] = run(f"ours_train_{regime_name.replace('-', '_')}")
        r["train"][regime_name] = {k: v for k, v in res.items() if isinstance(v, dict)}
    if earlier is not None:
        r["trl"], r["trl_reused_from"] = earlier["trl"], earlier.get("trl_reused_from") or earlier["date"]
        r["processes"].update({name: earlier["processes"][name] for name in earlier["trl"]})
    elif not args.no_trl:
        print("(c) trl.KTOTrainer, float32 and bf16, precomputed and online ...", flush=True)
        for name, _, _, _, cache_dir in TRL_RUNS:
            r["trl"][name] = r["processes"][name] = run(name, cache_dir, must_succeed=False)
    r["trl_ref_stats"] = trl_reference_stats(r["trl"], r["cache_rows"], args.max_length)
    r["seconds"], r["loads"], r["date"] = time.perf_counter() - started, (load_start, os.getloadavg()[0]), utc_stamp()
    (work / "results.json").write_text(json.dumps(r))  # `--render-only` rewrites the report from it
    harness.publish(render(r, args, r["seconds"], r["loads"]), args.results)


if __name__ == "__main__":
    main()
