"""Precision regimes on the real model: how far a bf16 reference cache is from a float32 one, the step-1 rewards
and KL when the cache and the policy computed in the same or different regimes, then trl.KTOTrainer alike.

    kto-pipeline demo --workdir benchmarks/.work/demo         # once: the demo's model and data (--demo-dir)
    .venv/bin/python benchmarks/bench_precision.py            # writes benchmarks/RESULTS-precision.md
    .venv/bin/python benchmarks/bench_precision.py --pairs 8 --batch 8 --results FILE

--model (default: the demo's SmolLM2-135M-Instruct in --demo-dir) and --data (the demo's paired conversational
rows; the first --pairs pairs, each -> a chosen and a rejected row). (a) three caches of the same rows (max length
192): float32; float32 weights under bf16 autocast; bf16 weights, compared with the float32 one (sequence and
per-token log-probs). (b) one step at learning rate 0 of each cache x {train --no-bf16, --bf16}: step-1 rewards and
KL. (c) trl.KTOTrainer (1.16) on the same rows, float32 and bf16, precomputed and online; one more run checks
whether trl reuses a float32 reference pass in a bf16 run (its cache is keyed by the dataset's fingerprint, the
weights' hash and whether KL is computed, not the precision). Every measurement runs in a fresh process; bf16 is
emulated on a CPU without native bf16 (slow), hence the few rows by default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from harness import (
    HERE,
    TRL_RUN,
    WORK_DIR,
    md_row,
    ours_train_config,
    print_result,
    provenance,
    publish,
    run_worker,
    script_parser,
    table_head,
    time_calls,
    token_keys,
    trainer_state,
    trl_trainer,
    unpaired_rows,
    utc_stamp,
    write_jsonl,
)

DEMO = WORK_DIR / "demo"  # --demo-dir: `kto-pipeline demo --workdir DIR` writes the model and the data there
MODEL, DATA = "models/SmolLM2-135M-Instruct", "data/train.jsonl"  # --model, --data: under --demo-dir by default
RESULTS = HERE / "RESULTS-precision.md"
SEED = TRL_RUN["seed"]  # train and trl (data order is sequential anyway)

# (name, PrecomputeConfig precision settings, what it is)
CACHES = (
    ("float32", dict(dtype="float32", bf16=False), "float32 weights, no autocast"),
    ("autocast", dict(dtype="float32", bf16=True), "float32 weights under bf16 autocast"),
    ("bf16-weights", dict(dtype="bfloat16", bf16=False), "bf16 weights, no autocast"),
)
TRAIN_REGIMES = (("no-bf16", False), ("bf16", True))
# trl runs: (worker name, bf16, use_cpu, precompute_ref_log_probs, datasets cache dir under work/hf-cache)
TRL_RUNS = (
    ("trl_float32_precomputed", False, False, True, "shared"),
    ("trl_float32_online", False, False, False, "trl_float32_online"),
    # bf16=True as a GPU user writes it (transformers refuses it on a CPU unless use_cpu=True)
    ("trl_bf16", True, False, True, "trl_bf16"),
    ("trl_bf16_precomputed", True, True, True, "trl_bf16_precomputed"),
    ("trl_bf16_online", True, True, False, "trl_bf16_online"),
    # the same datasets cache as trl_float32_precomputed: does trl reuse the float32 reference pass?
    ("trl_bf16_after_float32", True, True, True, "shared"),
)
# the flags every worker gets, with their defaults (the command in the report names those that differ; paths as
# their flag's name)
DEFAULTS = dict(model=None, data=None, pairs=4, batch=4, max_length=192, beta=0.1)
PATHS = {"demo_dir": "DIR", "model": "DIR", "data": "FILE"}
STEP1_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl", "logps/chosen", "logps/rejected", "loss")


def write_rows(data: Path, pairs: int, batch: int, work: Path) -> tuple[Path, Path]:
    """(the first `pairs` paired rows, as the demo feeds precompute; the first `batch` of the same rows unpaired,
    for trl: pair i -> its chosen answer as a desirable row, then its rejected one as an undesirable row, the order
    of kto-pipeline's example ids 2i and 2i+1). trl gets only the step-1 batch: its KL completions come from within
    the batch, so the other rows would only lengthen its (emulated bf16) reference pass."""
    lines = [ln for ln in data.read_text(encoding="utf-8").splitlines() if ln.strip()][:pairs]
    if len(lines) < pairs:
        raise SystemExit(f"{data} has only {len(lines)} pairs, --pairs asks for {pairs}")
    paired, unpaired = work / "pairs.jsonl", work / "rows.jsonl"
    paired.write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_jsonl(unpaired, unpaired_rows(json.loads(line) for line in lines)[:batch])
    return paired, unpaired


def caches_worker(args: argparse.Namespace, out: Path) -> dict:
    """(a): the three caches, one after the other in this process; their reference-pass seconds."""
    from kto_pipeline import PrecomputeConfig, precompute
    from kto_pipeline.cache import read_manifest

    result = {}
    for name, precision, _ in CACHES:
        paths = dict(model=args.model, dataset=str(args.work / "pairs.jsonl"), output=str(out / name))
        path = precompute(PrecomputeConfig(**paths, max_length=args.max_length, overwrite=True, **precision))
        manifest = read_manifest(path)
        timing = dict(
            seconds=manifest.timing["reference_pass_seconds"], tokens_executed=manifest.timing.get("tokens_executed")
        )
        result[name] = dict(path=str(path), precision=list(manifest.precision), **timing)
    return result


def ours_train_worker(args: argparse.Namespace, out: Path, bf16: bool) -> dict:
    """(b): one step at learning rate 0 of each cache, this process's train regime; the step-1 metrics."""
    from kto_pipeline import train
    from kto_pipeline.cache import read_manifest
    from kto_pipeline.runtime.precision import Regime, regime_mismatch

    result = {}
    for name, _, _ in CACHES:
        cache = args.work / "runs" / "caches" / name
        run_dir = out / name
        settings = dict(batch=args.batch, steps=1, learning_rate=0.0, bf16=bf16, seed=SEED, beta=args.beta)
        res = train(ours_train_config(cache, run_dir, **settings))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        step1 = next(r for r in records if r.get("step") == 1 and not any(k.startswith("eval_") for k in r))
        run_regime = Regime("float32", "bfloat16" if bf16 else None)
        result[name] = dict(
            step1={k: step1.get(k) for k in STEP1_KEYS},
            precision=trainer_state(run_dir).get("precision"),
            warned=regime_mismatch(Regime(*read_manifest(cache).precision), run_regime) is not None,
            step_seconds=res.step_seconds,
        )
        for weights in run_dir.glob("*.safetensors"):  # 0.5 GB each, and the weights did not move (lr 0)
            weights.unlink()
    return result


def trl_worker(args: argparse.Namespace, out: Path, bf16: bool, use_cpu: bool, precompute: bool) -> dict:
    """(c): trl's step-1 metrics, its reference forwards and (precomputed) its reference log-probs by token ids."""
    from trl import KTOTrainer

    forwards = []
    time_calls(KTOTrainer, "compute_ref_log_probs", lambda seconds, *a, **kw: forwards.append(seconds))
    # as bench.py's trl runs (a float32 policy instance, a disk-backed dataset, sequential order, gradient
    # checkpointing off), with bf16 on or off, batches of --batch and learning rate 0: one step, logged
    run = dict(batch=args.batch, max_length=args.max_length, precompute=precompute, bf16=bf16, use_cpu=use_cpu)
    run |= dict(beta=args.beta, learning_rate=0.0, max_steps=1, precompute_ref_batch_size=args.batch, **TRL_RUN)
    trainer = trl_trainer(args.model, args.work / "rows.jsonl", out, **run)
    reference_forwards_before_training = len(forwards)
    result = dict(
        mixed_precision=str(trainer.accelerator.mixed_precision),
        reference_forwards_before_training=reference_forwards_before_training,
    )
    if precompute:
        ds = trainer.train_dataset
        keys = token_keys(ds["prompt_ids"], ds["completion_ids"], args.max_length)
        result["ref"] = [
            dict(key=key, ref_logp=r, ref_kl_logp=k)
            for key, r, k in zip(keys, ds["ref_logps"], ds["ref_KL_logps"], strict=True)
        ]
    if args.name == "trl_bf16_after_float32" and reference_forwards_before_training > 0:
        # it ran its own bf16 reference pass: its step 1 would be trl_bf16_precomputed's (an emulated-bf16 step saved)
        return dict(result, skipped=True)
    start = time.perf_counter()
    trainer.train()
    result["train_seconds"] = time.perf_counter() - start
    step1 = next(r for r in trainer.state.log_history if r.get("step") == 1 and "loss" in r)
    result["step1"] = {k: step1.get(k) for k in STEP1_KEYS}
    return result


def worker(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    if args.name == "caches":
        return caches_worker(args, out)
    if args.name.startswith("ours_train_"):
        return ours_train_worker(args, out, bf16=args.name == "ours_train_bf16")
    for name, bf16, use_cpu, precompute, _ in TRL_RUNS:
        if args.name == name:
            return trl_worker(args, out, bf16, use_cpu, precompute)
    raise SystemExit(f"unknown worker {args.name}")


def read_cache(path: Path) -> dict:
    from kto_pipeline.cache import open_cache

    table = open_cache(path).table
    return {name: table.column(name).to_pylist() for name in table.schema.names}


def diff_stats(a: list[float], b: list[float]) -> dict:
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return dict(max=max(diffs), mean=statistics.fmean(diffs), n=len(diffs))


def compare_caches(caches: dict[str, dict]) -> dict[str, dict]:
    """Each bf16 cache against the float32 one: the same rows and tokens, then |diff| of the log-probs."""
    base = caches["float32"]
    out = {}
    for name, other in caches.items():
        if name == "float32":
            continue
        for column in ("example_id", "prompt_ids", "completion_ids", "kl_completion_ids"):
            if other[column] != base[column]:
                raise SystemExit(f"cache {name} does not hold the rows of the float32 cache ({column} differs)")
        tokens_base = [x for row in base["ref_token_logps"] + base["ref_kl_token_logps"] for x in row]
        tokens = [x for row in other["ref_token_logps"] + other["ref_kl_token_logps"] for x in row]
        out[name] = dict(
            ref_logp=diff_stats(other["ref_logp"], base["ref_logp"]),
            ref_kl_logp=diff_stats(other["ref_kl_logp"], base["ref_kl_logp"]),
            tokens=diff_stats(tokens, tokens_base),
        )
    return out


def trl_reference_stats(trl: dict, caches: dict[str, dict], max_length: int) -> dict:
    """trl's bf16 reference pass against its float32 one, and trl's float32 against our float32 cache."""
    out: dict = {"vs_trl_float32": {}}
    f32 = trl.get("trl_float32_precomputed", {}).get("ref")
    for name, t in trl.items():
        if f32 and t.get("ref"):
            out["vs_trl_float32"][name] = dict(
                ref_logp=diff_stats([r["ref_logp"] for r in t["ref"]], [r["ref_logp"] for r in f32]),
                ref_kl_logp=diff_stats([r["ref_kl_logp"] for r in t["ref"]], [r["ref_kl_logp"] for r in f32]),
            )
    if f32:
        c = caches["float32"]
        ours = dict(zip(token_keys(c["prompt_ids"], c["completion_ids"], max_length), c["ref_logp"], strict=True))
        common = [r for r in f32 if r["key"] in ours]
        out["trl_float32_vs_ours"] = dict(
            matched=len(common),
            rows=len(f32),
            **(diff_stats([r["ref_logp"] for r in common], [ours[r["key"]] for r in common]) if common else {}),
        )
    return out


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3g}"


def _rewards(step1: dict) -> list[str]:
    """The rewards/chosen, rewards/rejected, rewards/margins and kl cells of a run's step 1."""
    return [*(_signed(step1[f"rewards/{k}"]) for k in ("chosen", "rejected", "margins")), _g(step1["kl"])]


def render(r: dict, args: argparse.Namespace, seconds: float, loads: tuple) -> str:
    caches, stats, trains = r["cache_rows"], r["cache_stats"], r["train"]
    labels = {name: what for name, _, what in CACHES}
    f32 = caches["float32"]
    n_rows, n_tokens = len(f32["ref_logp"]), stats[next(iter(stats))]["tokens"]["n"]
    abs_logp = [abs(x) for x in f32["ref_logp"]]
    abs_kl = [abs(x) for x in f32["ref_kl_logp"]]
    abs_tok = [abs(x) for row in f32["ref_token_logps"] + f32["ref_kl_token_logps"] for x in row]
    date = r.get("date") or utc_stamp()
    command_ = f"`{command(args)}` (from the repository root, with the project's .venv)"
    head = provenance(command_, seconds, "kto-pipeline", "trl", "transformers", "torch", date=date)
    head[1] += (
        f"; load average (1 min) {loads[0]:.2f} before the first worker, {loads[1]:.2f} at the end (the workers use "
        f"{os.cpu_count()} threads: a higher load means other processes shared the cores, and every time below is "
        "slower than on an idle machine)"
    )
    lines = [
        "# Precision regimes on SmolLM2-135M-Instruct",
        "",
        *head,
        f"- model: {_shown(args.model, MODEL, args.demo_dir)}",
        f"- data: the first {args.pairs} pairs of {_shown(args.data, DATA, args.demo_dir)} (the demo's HH-RLHF "
        "harmless-base single-turn conversational pairs, the rows `kto_pipeline/demo/run.py` trains on), each -> a "
        f"desirable (chosen) and an undesirable (rejected) row: {n_rows} rows, {n_tokens} scored tokens (completions "
        f"+ KL completions); max_length {args.max_length} (the demo's). A subsample: bf16 is emulated on this CPU and "
        "slow.",
        f"- training: one step at learning rate 0, batch {args.batch} (the first {args.batch} rows: sequential "
        f"order), beta {args.beta}, seed {SEED}; metrics of step 1 (computed before the optimizer step, so the "
        "learning rate does not enter them).",
        "",
        "## (a) bf16 caches against the float32 cache",
        "",
        f"- date: {date}",
        "",
        f"Typical magnitudes in the float32 cache: |ref_logp| mean {statistics.fmean(abs_logp):.3g} (median "
        f"{statistics.median(abs_logp):.3g}, max {max(abs_logp):.3g}); |ref_kl_logp| mean "
        f"{statistics.fmean(abs_kl):.3g}; per-token |log-prob| mean {statistics.fmean(abs_tok):.3g}.",
        "",
        *table_head(
            "| cache | ref_logp max abs diff | ref_logp mean abs diff | mean abs diff / mean abs ref_logp | "
            "ref_kl_logp max abs diff | ref_kl_logp mean abs diff | per-token max abs diff | per-token mean abs diff | "
            "reference pass (s) |"
        ),
    ]
    for name, s in stats.items():
        lines.append(
            f"| {labels[name]} | {_g(s['ref_logp']['max'])} | {_g(s['ref_logp']['mean'])} | "
            f"{s['ref_logp']['mean'] / statistics.fmean(abs_logp):.2%} | {_g(s['ref_kl_logp']['max'])} | "
            f"{_g(s['ref_kl_logp']['mean'])} | {_g(s['tokens']['max'])} | {_g(s['tokens']['mean'])} | "
            f"{r['caches'][name]['seconds']:.1f} |"
        )
    lines += [
        "",
        f"- rows: each diff is over the {n_rows} rows (sequence sums) or the {n_tokens} completion and KL-completion "
        "tokens (per token) of the same token ids in both caches (checked). The float32 cache's reference pass took "
        f"{r['caches']['float32']['seconds']:.1f} s.",
        f"- at beta {args.beta} a sequence log-prob diff d moves that row's reward by beta x d.",
        "",
        "## (b) kto-pipeline: step-1 rewards and KL of each cache x train regime",
        "",
        f"- date: {date}",
        "",
        *table_head(
            "| cache made in | train in | regimes match | train warned | rewards/chosen | rewards/rejected | "
            "rewards/margins | kl | policy logps/chosen | step (s) |"
        ),
    ]
    for cache_name, _, what in CACHES:
        for regime_name, bf16 in TRAIN_REGIMES:
            run = trains.get(regime_name, {}).get(cache_name)
            if run is None:
                continue
            match = r["caches"][cache_name]["precision"] == ["float32", "bfloat16" if bf16 else None]
            regime, yes = f"`train --{regime_name}` ({run['precision']})", {True: "yes", False: "no"}
            policy, seconds = f"{run['step1']['logps/chosen']:.7g}", f"{run['step_seconds'][0]:.0f}"
            lines.append(md_row(what, regime, yes[match], yes[run["warned"]], *_rewards(run["step1"]), policy, seconds))
    lines += [
        "",
        "- rewards/chosen, rewards/rejected: the mean over the batch's desirable / undesirable rows of beta x (policy "
        "log-prob - cached reference log-prob) of the completion. At step 1 the policy is the reference, so they "
        "measure only the difference of the two stages' roundings.",
        "- kl: KTO's reference point z0 = max(0, mean over the batch of (policy - reference) log-prob of the KL "
        "completions) (not multiplied by beta; clamped at 0 as trl does, so a negative mean shows as 0).",
        "- policy logps/chosen: the policy's mean sequence log-prob of the desirable rows (its regime shows here).",
        "- train warned: `train` printed its regime-mismatch warning (kto_pipeline/runtime/precision.py).",
        "",
        "## (c) trl.KTOTrainer in the same setting",
        "",
        f"- date: {r.get('trl_reused_from') or date}",
        "",
        f"trl gets the step-1 batch only (the first {args.batch} rows above, the same token ids: checked below).",
        *(
            [
                "",
                f"These trl runs are reused from this benchmark's run of {r['trl_reused_from']} (`--reuse-trl`): "
                "trl, its settings and the rows are the same; only kto-pipeline's side was run again.",
            ]
            if r.get("trl_reused_from")
            else []
        ),
        "",
        *table_head(
            "| trl run | KTOConfig | reference | reference forwards before training | its ref_logps vs trl's float32 "
            "pass: max abs diff (mean) | rewards/chosen | rewards/rejected | rewards/margins | kl | train (s) |"
        ),
    ]
    ts = r["trl_ref_stats"]
    for name, bf16, use_cpu, precompute, cache_dir in TRL_RUNS:
        t = r["trl"].get(name)
        if t is None:
            continue
        config = f"bf16={bf16}" + (", use_cpu=True" if use_cpu else "")
        reference = "precompute_ref_log_probs=True" if precompute else "online (reference model)"
        if cache_dir == "shared" and bf16:
            reference += ", datasets cache shared with trl_float32_precomputed"
        if "failed" in t:
            lines.append(f"| {name} | {config} | {reference} | FAILED: `{t['failed']}` | | | | | | |")
            continue
        d = ts.get("vs_trl_float32", {}).get(name)
        versus = "n/a (online)" if d is None else f"{_g(d['ref_logp']['max'])} ({_g(d['ref_logp']['mean'])})"
        if name == "trl_float32_precomputed":
            versus = "(itself)"
        head = [name, f"{config} (accelerate: {t['mixed_precision']})", reference]
        head += [t["reference_forwards_before_training"], versus]
        if t.get("skipped"):
            skipped = "not trained: it ran its own reference pass, so its step 1 is trl_bf16_precomputed's"
            lines.append(md_row(*head, skipped, "", "", "", ""))
        else:
            lines.append(md_row(*head, *_rewards(t["step1"]), f"{t['train_seconds']:.0f}"))
    lines += [""]
    d = ts.get("vs_trl_float32", {}).get("trl_bf16_precomputed")
    if d is not None:
        lines.append(
            f"- trl's bf16 reference pass (float32 weights under bf16 autocast) against its float32 one, over "
            f"{d['ref_logp']['n']} rows: ref_logps max abs diff {_g(d['ref_logp']['max'])}, mean "
            f"{_g(d['ref_logp']['mean'])}; ref_KL_logps max {_g(d['ref_kl_logp']['max'])}, mean "
            f"{_g(d['ref_kl_logp']['mean'])} (kto-pipeline's autocast cache in (a): max "
            f"{_g(stats['autocast']['ref_logp']['max'])}, mean {_g(stats['autocast']['ref_logp']['mean'])})."
        )
    if "trl_float32_vs_ours" in ts:
        s = ts["trl_float32_vs_ours"]
        lines.append(
            f"- sanity: trl's float32 reference log-probs against kto-pipeline's float32 cache: {s['matched']} of "
            f"{s['rows']} rows have the same token ids, max abs diff {_g(s.get('max'))}."
        )
    shared = r["trl"].get("trl_bf16_after_float32", {})
    if "reference_forwards_before_training" in shared:
        reused = shared["reference_forwards_before_training"] == 0
        lines.append(
            "- trl_bf16_after_float32: a bf16 run whose datasets cache already holds the float32 precomputed run's "
            "reference pass (trl keys it by the dataset's fingerprint, the model's weight hash and whether KL is "
            "computed). "
            + (
                "trl ran no reference forward: it reused the float32 reference log-probs for a bf16 policy, "
                "silently, so its step 1 is the mismatched combination (float32 cache, bf16 training)."
                if reused
                else f"trl ran {shared['reference_forwards_before_training']} reference forwards: it did not reuse "
                "the float32 pass."
            )
        )
    lines += [
        "- trl computes its KL completions as each row's prompt with the previous row's completion in the batch; "
        "kto-pipeline's KL partners are the cache's seeded cycle, so the two tools' kl values are over different "
        "sequences. The rewards are over the same rows.",
        "- trl online: the reference model (loaded by trl in the policy's dtype, float32) runs in the same step, "
        "under the same autocast as the policy. trl precomputed: the reference pass runs before training with the "
        "policy model, under the accelerator's autocast.",
        "",
        "## Summary (computed from the tables above)",
        "",
        *summary_lines(r),
        "",
        "Worker processes (s): "
        + ", ".join(
            f"{name} " + (f"{res['process_seconds']:.0f}" if "process_seconds" in res else "(failed)")
            for name, res in r["processes"].items()
        ),
        "",
    ]
    return "\n".join(lines)


def summary_lines(r: dict) -> list[str]:
    def largest(runs: list[dict]) -> float:
        return max(abs(x["step1"][k]) for x in runs for k in ("rewards/chosen", "rewards/rejected"))

    matched, mismatched = [], []
    for cache_name, _, _ in CACHES:
        for regime_name, bf16 in TRAIN_REGIMES:
            run = r["train"].get(regime_name, {}).get(cache_name)
            if run is not None:
                same = r["caches"][cache_name]["precision"] == ["float32", "bfloat16" if bf16 else None]
                (matched if same else mismatched).append((cache_name, regime_name, run))
    out = []
    for label, runs in (("matching", matched), ("mismatched", mismatched)):
        if runs:
            worst = max(runs, key=lambda x: largest([x[2]]))
            out.append(
                f"- kto-pipeline, {label} regimes ({len(runs)} runs): largest step-1 |reward| "
                f"{largest([x[2] for x in runs]):.3g} (cache {worst[0]}, train --{worst[1]}); largest kl "
                f"{max(x[2]['step1']['kl'] for x in runs):.3g}."
            )
    bf16_matched = r["train"].get("bf16", {}).get("autocast")
    if bf16_matched is not None and mismatched:
        worst = largest([x[2] for x in mismatched])
        out.append(
            f"- kto-pipeline, bf16 cache (float32 weights under autocast) with train --bf16: |reward| up to "
            f"{largest([bf16_matched]):.3g}, {largest([bf16_matched]) / worst:.0%} of the largest mismatched one "
            f"({worst:.3g}); float32 with float32: {largest([r['train']['no-bf16']['float32']]):.3g}."
        )
    trl_ok = {k: v for k, v in r["trl"].items() if "step1" in v}
    for name, t in trl_ok.items():
        out.append(f"- {name}: step-1 |reward| up to {largest([t]):.3g}, kl {t['step1']['kl']:.3g}.")
    failed = {k: v["failed"] for k, v in r["trl"].items() if "failed" in v}
    for name, error in failed.items():
        out.append(f"- {name} failed: `{error}`")
    return out


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__, str(WORK_DIR / "precision"), results="Markdown file to write", default=str(RESULTS))
    d = DEFAULTS
    parser.add_argument("--demo-dir", type=Path, default=DEMO, help=f"the demo's workdir (default {DEMO})")
    parser.add_argument("--model", help=f"Hugging Face model directory (or hub id; default DEMO_DIR/{MODEL})")
    parser.add_argument("--data", help=f"paired conversational rows (.jsonl; default DEMO_DIR/{DATA})")
    parser.add_argument("--pairs", type=int, default=d["pairs"], help="use the first PAIRS pairs (2 rows each)")
    parser.add_argument("--batch", type=int, default=d["batch"], help="per-device train batch of every training run")
    parser.add_argument("--max-length", type=int, default=d["max_length"], help="the demo's max length")
    parser.add_argument("--beta", type=float, default=d["beta"])
    parser.add_argument("--no-trl", action="store_true", help="skip (c), the trl runs")
    reuse_help = "(c) from the last run's WORK/results.json instead of running trl"
    parser.add_argument("--reuse-trl", action="store_true", help=reuse_help)
    render_help = "rewrite --results from the last run's WORK/results.json"
    parser.add_argument("--render-only", action="store_true", help=render_help)
    args = parser.parse_args()
    args.work = Path(args.work).resolve()
    args.given = [flag for flag in PATHS if getattr(args, flag) not in (None, DEMO)]
    args.model, args.data = args.model or str(args.demo_dir / MODEL), args.data or str(args.demo_dir / DATA)
    return args


def command(args: argparse.Namespace) -> str:
    """The command as run: the paths given, then the flags of DEFAULTS that differ from their default."""
    paths = [f"--{k.replace('_', '-')} {kind}" for k, kind in PATHS.items() if k in args.given]
    changed = [k for k, v in DEFAULTS.items() if v is not None and getattr(args, k) != v]
    return " ".join(
        [
            "python benchmarks/bench_precision.py",
            *paths,
            *(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in changed),
        ]
    )


def _shown(path: str, default: str, demo: Path) -> str:
    """A path of the report, without the machine's directories: its place in the demo's workdir, else its name."""
    return (
        f"`{default}` of the demo's workdir (`--demo-dir`)"
        if Path(path) == Path(demo) / default
        else f"`{Path(path).name}`"
    )


def main() -> None:
    args = parse_args()
    if args.mode == "worker":
        print_result(worker(args))
        return
    if args.render_only:
        write_report(json.loads((args.work / "results.json").read_text()), args)
        return
    if args.batch > 2 * args.pairs:
        raise SystemExit(f"--batch {args.batch} needs at least {args.batch} rows: --pairs >= {-(-args.batch // 2)}")
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    work = args.work
    earlier = json.loads((work / "results.json").read_text()) if args.reuse_trl else None
    shutil.rmtree(work, ignore_errors=True)  # from scratch: no cache, run or datasets cache of an earlier run
    work.mkdir(parents=True)
    write_rows(Path(args.data), args.pairs, args.batch, work)
    # every worker gets the flags of DEFAULTS with their values in `args`
    flags = [x for flag in DEFAULTS for x in (f"--{flag.replace('_', '-')}", str(getattr(args, flag)))]
    script = Path(__file__)

    def run(name: str, cache_dir: str | None = None, must_succeed: bool = True) -> dict:
        env = {"HF_DATASETS_CACHE": str(work / "hf-cache" / (cache_dir or name))}
        return run_worker(script, name, work, flags, env=env, must_succeed=must_succeed, width=26)

    r: dict = {"processes": {}}
    print(f"(a) three caches of {2 * args.pairs} rows ...", flush=True)
    r["caches"] = run("caches")
    r["processes"]["caches"] = r["caches"]
    r["cache_rows"] = {name: read_cache(work / "runs" / "caches" / name) for name, _, _ in CACHES}
    r["cache_stats"] = compare_caches(r["cache_rows"])
    print("(b) one step at learning rate 0 of each cache, train --no-bf16 and --bf16 ...", flush=True)
    r["train"] = {}
    for regime_name, _ in TRAIN_REGIMES:
        res = run(f"ours_train_{regime_name.replace('-', '_')}")
        r["processes"][f"ours_train_{regime_name}"] = res
        r["train"][regime_name] = {k: v for k, v in res.items() if isinstance(v, dict)}
    r["trl"] = {}
    if earlier is not None:
        r["trl"], r["trl_reused_from"] = earlier["trl"], earlier.get("trl_reused_from") or earlier["date"]
        r["processes"].update({name: earlier["processes"][name] for name in earlier["trl"]})
    elif not args.no_trl:
        print("(c) trl.KTOTrainer, float32 and bf16, precomputed and online ...", flush=True)
        for name, _, _, _, cache_dir in TRL_RUNS:
            r["trl"][name] = run(name, cache_dir, must_succeed=False)
            r["processes"][name] = r["trl"][name]
    r["trl_ref_stats"] = trl_reference_stats(r["trl"], r["cache_rows"], args.max_length)
    r["seconds"], r["loads"], r["date"] = time.perf_counter() - started, (load_start, os.getloadavg()[0]), utc_stamp()
    (work / "results.json").write_text(json.dumps(r))  # `--render-only` rewrites the report from it
    write_report(r, args)


def write_report(r: dict, args: argparse.Namespace) -> None:
    publish(render(r, args, r["seconds"], r["loads"]), args.results)


if __name__ == "__main__":
    main()
