"""Preprocessing rows/s and peak RSS at 20,000 / 200,000 / 1,000,000 short unpaired rows, kto-pipeline against
trl.KTOTrainer 1.16 with 1 and 2 processes (`bench.py --only scale`), and `precompute --append` of 1% new rows to a
200,000-row cache against its full precompute (`--only append`). Each run: a fresh process (`bench.py worker
scale_<tool>_<num_proc>` or `append_<form>_<rows>`) with its own, empty HF_DATASETS_CACHE.
"""

from __future__ import annotations

import hashlib
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import harness

SCALE_HEADING = "## Scale: preprocessing 20k / 200k / 1M rows"
# tool -> num_proc values. kto-pipeline's --num-proc 1 maps in-process (num_proc=None); trl's dataset_num_proc=1
# does not (datasets 5 runs any num_proc >= 1 in a Pool), so trl's default (None) is measured too
VARIANTS = {"ours": (1, 2), "trl": (None, 1, 2)}
LABELS = {"ours": "kto-pipeline", "trl": "trl"}
PROCS = {None: "default (None)", 1: "1", 2: "2"}  # the num_proc column
CHECK_ROWS = 100  # rows whose token ids must agree across the tools before speed is reported
TRL_SKIP_SECONDS = 300  # trl is skipped at a size where its rate at the size below predicts more than this
DATA_VERSION = 1  # bump when the row generator changes
SPEEDUP_GOAL = 1.7  # goal: --num-proc 2 tokenizes at least 1.7x faster than 1
GROWTH_GOAL_MB = 150  # goal: peak RSS at 200,000 rows at most 150 MB (10^6 bytes) above the one at 20,000
MIB = 1 << 20
TOKENIZERS = {
    "smollm2": "SmolLM2-135M-Instruct's (BPE, vocab 49152)",
    "char": "the character-level one of `kto_pipeline.demo.tiny`",
}
BENCH = harness.HERE / "bench.py"  # the workers run as `bench.py worker scale_...` (`append_...`)
RUNS = {f"scale_{tool}_{p or 'default'}": (tool, p) for tool, procs in VARIANTS.items() for p in procs}  # worker names
NAMES = {run: name for name, run in RUNS.items()}  # (tool, num_proc) -> its worker's name


_WORDS = (
    "the a an and or but if then so because while when where what which who how why is are was were be been "
    "have has had do does did can could would should will may might must not no yes very more most less some "
    "any every each all many few one two three first last next new old good bad best better worse small large "
    "long short high low fast slow easy hard simple clear open closed free full empty early late right wrong "
    "time day week year people person way thing world life hand part child eye woman man place work case point "
    "government company number group problem fact water money story book word business issue side kind head "
    "house service friend father mother power hour game line end member law car city community name president "
    "team minute idea body information back parent face level office door health art war history party result "
    "change morning reason research girl guy moment air teacher force education food recipe code function error "
    "file list table data model test question answer email letter plan trip price market phone computer program "
    "make get know think take see come want look use find give tell ask seem feel try leave call keep let begin "
    "help talk turn start show hear play run move like live believe hold bring happen write provide sit stand "
    "lose pay meet include continue set learn lead understand watch follow stop create speak read allow add "
    "spend grow offer remember love consider appear buy wait serve die send expect build stay fall cut reach "
    "explain cook fix install compare translate summarize recommend"
).split()
_NUMBERS = ("2", "3", "10", "12", "42", "100", "2024", "3.5", "0.25", "1,000", "$20", "15%", "7pm", "v2")
_RARE = ("café", "naïve", "résumé", "Zürich", "São Paulo", "—", "€5", "°C", "über", "🙂")  # BPE byte fallback
_OPENERS = ("Can you", "How do I", "What is", "Why does", "Please", "Write", "Explain", "Tell me", "Is it", "I need")
_STARTS = ("Sure,", "Yes,", "No,", "Of course.", "Here is", "You can", "It depends:", "I think", "Try", "Well,")


def _text(rng: random.Random, n_words: int, openers: tuple[str, ...], end: str) -> str:
    words = rng.choices(_WORDS, k=n_words)
    for i in range(n_words):
        r = rng.random()
        if r < 0.06:
            words[i] = rng.choice(_NUMBERS)
        elif r < 0.075:
            words[i] = rng.choice(_RARE)
        elif r < 0.11:
            words[i] += ","
        elif r < 0.13 and i < n_words - 1:
            words[i] += "."
            words[i + 1] = words[i + 1].capitalize()
    text = rng.choice(openers) + " " + " ".join(words)
    if rng.random() < 0.1:
        cut = text.rfind(" ", 0, len(text) // 2)
        text = text[:cut] + ("\n" if rng.random() < 0.5 else "\n\n") + text[cut + 1 :] if cut > 0 else text
    return text + end


def row_stream(seed: int = 0):
    """Short unpaired rows, endlessly: mixed prompts and completions, labels about 55% desirable."""
    rng = random.Random(seed)
    while True:
        prompt = _text(rng, rng.randint(10, 30), _OPENERS, rng.choice(("?", "?", ".", ":", "?\n")))
        completion = _text(rng, rng.randint(5, 20), _STARTS, rng.choice((".", ".", "!", "")))
        if rng.random() < 0.8:
            completion = " " + completion
        yield {"prompt": prompt, "completion": completion, "label": rng.random() < 0.55}


def data_file(work: Path, stop: int, start: int = 0) -> Path:
    """Rows `start` .. `stop - 1` of `row_stream` as .jsonl in `work`, written once and kept between runs."""
    path = work / f"data-v{DATA_VERSION}-{f'{start}-new{stop - start}' if start else stop}.jsonl"
    if not path.exists():
        print(f"writing {path.name} ...", flush=True)
        part = path.with_name(path.name + ".part")
        harness.write_jsonl(part, islice(row_stream(), start, stop), ensure_ascii=False).replace(path)
    return path


def build_model(work: Path, tokenizer: str) -> Path:
    """The tokenizer both tools use and a tiny Llama over its vocabulary (trl's trainer needs a model), made once."""
    from transformers import AutoTokenizer

    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model

    path = work / f"model-{tokenizer}"
    if not path.exists():  # built aside, then renamed: a stopped build leaves no model to reuse
        tok = AutoTokenizer.from_pretrained(harness.smollm2_dir()) if tokenizer == "smollm2" else build_char_tokenizer()
        tmp = path.with_name(path.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_model(tok).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.replace(path)
    return path


def _sized(work: Path, size: dict, key: str, given: tuple[int, ...] | None, tokenizer: str | None):
    """(a --size's settings with the sizes (`key`, ascending) and tokenizer given on the command line, the model)."""
    size = dict(size, **{key: tuple(sorted(given or size[key]))}, tokenizer=tokenizer or size["tokenizer"])
    work.mkdir(parents=True, exist_ok=True)
    return size, build_model(work, size["tokenizer"])


def own_cache_worker(name: str, work: Path, size_name: str, model: Path, data: Path, env: dict | None = None) -> dict:
    """`bench.py worker NAME` (case: NAME's first word) with a fresh HF_DATASETS_CACHE of its own, removed after it."""
    cache = work / "runs" / f"hf-datasets-cache-{name}"  # GBs
    flags = ["--size", size_name, "--case", name.split("_")[0], "--model", str(model), "--data", str(data)]
    try:
        return harness.run_worker(BENCH, name, work, flags, env={"HF_DATASETS_CACHE": str(cache), **(env or {})})
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _peaks() -> dict:
    return {"peak_rss_mib": harness.peak_rss_mib(), "children_peak_rss_mib": harness.children_peak_rss_mib()}


def scale_worker(name: str, size: dict, out: Path, model: Path, data: Path) -> dict:
    """One measurement (scale_<tool>_<num_proc or default>) in this fresh process; its baseline: datasets imported."""
    import datasets  # noqa: F401

    baseline = harness.rss_mib()
    if name not in RUNS:
        raise SystemExit(f"unknown worker {name}")
    tool, num_proc = RUNS[name]
    return dict((_ours if tool == "ours" else _trl)(num_proc, size, out, model, data), baseline_rss_mib=baseline)


def _ours(num_proc: int, size: dict, out: Path, model: Path, data: Path) -> dict:
    """What `precompute` runs before it loads the model (`prepare_rows`), timed whole."""
    import numpy as np

    from kto_pipeline import PrecomputeConfig
    from kto_pipeline.models import load_tokenizer
    from kto_pipeline.stages.precompute.data import load_source
    from kto_pipeline.stages.precompute.stage import prepare_rows

    tokenizer = load_tokenizer(str(model))
    start = time.perf_counter()
    source_rows = len(load_source(str(data)))
    load_seconds = time.perf_counter() - start
    paths = dict(model=str(model), dataset=str(data), output=str(out))
    config = PrecomputeConfig(**paths, max_length=size["max_length"], num_proc=num_proc)
    start = time.perf_counter()
    prepared = prepare_rows(config, tokenizer)  # load, check, tokenize, select, pair: all of it, as precompute
    seconds, peaks = time.perf_counter() - start, _peaks()
    if prepared.cached:
        raise SystemExit("kto-pipeline read its tokenized rows from a cache: the measurement is void")
    rows, first = prepared.rows, np.arange(min(CHECK_ROWS, len(prepared.rows)))
    first_rows = {col: rows.take(first, col) for col in ("prompt_ids", "completion_ids")}
    run = dict(source_rows=source_rows, kept_rows=len(rows), load_seconds=load_seconds, seconds=seconds, **peaks)
    return dict(run, tokenize_seconds=prepared.tokenize_seconds, first_rows=first_rows)


def _trl(num_proc: int | None, size: dict, out: Path, model: Path, data: Path) -> dict:
    """`KTOTrainer._prepare_dataset` as its constructor runs it; apart: the load, the constructor, the model."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model)
    before, start = harness.rss_mib(), time.perf_counter()
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    run = dict(model_seconds=time.perf_counter() - start, model_rss_mib=harness.rss_mib() - before)
    start = time.perf_counter()
    dataset = load_dataset("json", data_files=str(data), split="train")
    run.update(load_seconds=time.perf_counter() - start, source_rows=len(dataset))
    # _prepare_dataset, with the peaks as it returns; __init__ alone (its KTOConfig is built before it)
    harness.time_calls(KTOTrainer, "_prepare_dataset", lambda s, *a, **kw: run.update(seconds=s, **_peaks()))
    harness.time_calls(KTOTrainer, "__init__", lambda s, *a, **kw: run.update(init_seconds=s))
    settings = dict(tokenizer=tokenizer, batch=size["batch"], max_length=size["max_length"], dataset_num_proc=num_proc)
    ds = harness.trl_trainer(policy, dataset, out, precompute=False, **settings).train_dataset
    first = ds.select(range(min(CHECK_ROWS, len(ds))))
    first_rows = {col: [list(x) for x in first[col]] for col in ("prompt_ids", "completion_ids")}
    return dict(run, kept_rows=len(ds), first_rows=first_rows)


def first_apart(a: list, b: list) -> int:
    """The first row at which two runs' token ids differ (the shorter's length where one only runs on)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def check_tokens(results: dict[str, dict], rows: int) -> None:
    """Every run of one size kept the same rows and tokenized the first ones alike; pops their ids."""
    named = {name: r.pop("first_rows") for name, r in results.items()}
    ref_name = next(iter(named))
    ref, ref_kept = named[ref_name], results[ref_name]["kept_rows"]
    for name, got in named.items():
        kept, differ = results[name]["kept_rows"], [col for col in ref if got[col] != ref[col]]
        if kept != ref_kept or differ:
            where = ", ".join(f"{c} from row {first_apart(ref[c], got[c])}" for c in differ) or "none"
            what = f"{name} kept {kept} rows ({ref_name} {ref_kept}), token ids differ: {where}"
            raise SystemExit(f"{rows} rows: {what}: not reporting speed")
    agree = f"token ids agree on the first {len(ref['prompt_ids'])} rows across {', '.join(named)}"
    print(f"  {agree} ({ref_kept} rows kept)", flush=True)


def run_scale(work: Path, size_name: str, results: Path | None, rows: tuple[int, ...] | None, tokenizer: str | None):
    """`--only scale`: every size, both tools, 1 and 2 processes, each in a fresh process and datasets cache."""
    started = time.perf_counter()
    size, model = _sized(work, harness.SCALE_SIZES[size_name], "rows", rows, tokenizer)
    measured: dict[int, dict[str, dict]] = {n: {} for n in size["rows"]}
    skipped: dict[tuple[int, str], str] = {}  # (rows, worker) -> why it did not run
    for n in size["rows"]:
        print(f"{n:,} rows ({size['tokenizer']} tokenizer):", flush=True)
        data, size_dir = data_file(work, n), work / f"rows{n}"
        shutil.rmtree(size_dir, ignore_errors=True)
        for name, (tool, _) in RUNS.items():
            below = [m for m in measured if m < n and name in measured[m]]  # at its rate at the size below
            estimate = measured[max(below)][name]["seconds"] * n / max(below) if below else 0
            if tool == "trl" and size.get("trl_largest_only") and n != size["rows"][-1]:
                skipped[n, name] = f"not run: trl at {size['rows'][-1]:,} rows only (--size {size_name})"
            elif tool == "trl" and estimate > TRL_SKIP_SECONDS:
                skipped[n, name] = f"skipped: {estimate:.0f} s expected (> {TRL_SKIP_SECONDS} s)"
            if (n, name) in skipped:
                print(f"  {name:<24} {skipped[n, name]}", flush=True)
            else:
                measured[n][name] = own_cache_worker(name, size_dir, size_name, model, data)
        check_tokens(measured[n], n)
        shutil.rmtree(size_dir, ignore_errors=True)
    seconds = time.perf_counter() - started
    harness.publish(render_scale(measured, skipped, size, size_name, seconds), results, SCALE_HEADING)


def _scale_tables(measured: dict, skipped: dict, size: dict) -> tuple[list[str], ...]:
    """(the main table: seconds, rows/s, peaks, speed-up of 2 processes against 1 and None; the details: load, trl's
    constructor, RSS growth; the goals; the note on peak RSS growth from the smaller size to the larger, if two ran)."""
    table = harness.table_head(
        "| rows | tool | num_proc | seconds | rows/s | peak RSS MiB (parent) | peak RSS MiB (children) | "
        "speed-up 2 vs 1 proc |"
    )
    details = harness.table_head(
        "| rows | tool | num_proc | load s (JSON -> Arrow) | trl: constructor s (its _prepare_dataset included) | "
        "trl: policy model load s | post-import RSS MiB | parent RSS growth MiB |"
    )
    goals, growth = [], []
    for n, runs in measured.items():
        for name, (tool, num_proc) in RUNS.items():
            head = (f"{n:,}", LABELS[tool], PROCS[num_proc])
            if name not in runs:
                table.append(harness.md_row(*head, skipped.get((n, name), "not run"), "-", "-", "-", "-"))
                continue
            r = runs[name]
            ones = [p for p in (1, None) if num_proc == 2 and NAMES.get((tool, p)) in runs]
            speedups = [f"{runs[NAMES[tool, p]]['seconds'] / r['seconds']:.2f}x vs {PROCS[p]}" for p in ones]
            speedup = speedups[0].split(" vs ")[0] if len(speedups) == 1 else ", ".join(speedups) or "-"
            cells = (f"{r['seconds']:.2f}", f"{r['source_rows'] / r['seconds']:,.0f}", f"{r['peak_rss_mib']:.0f}")
            table.append(harness.md_row(*head, *cells, f"{r['children_peak_rss_mib']:.0f}", speedup))
            trl_cells = (f"{r['init_seconds']:.2f}", f"{r['model_seconds']:.2f}") if tool == "trl" else ("-", "-")
            rss = (f"{r['baseline_rss_mib']:.0f}", f"{r['peak_rss_mib'] - r['baseline_rss_mib']:.0f}")
            details.append(harness.md_row(*head, f"{r['load_seconds']:.2f}", *trl_cells, *rss))
            if tool == "ours" and ones:
                one = runs[NAMES["ours", 1]]
                ratio = one["tokenize_seconds"] / r["tokenize_seconds"]
                goal = (
                    f"kto-pipeline: --num-proc 2 tokenizes at least {SPEEDUP_GOAL}x faster than 1 ({n:,} rows; the "
                    f"datasets.map: {one['tokenize_seconds']:.1f} s vs {r['tokenize_seconds']:.1f} s; all of the "
                    f"preprocessing: {one['seconds'] / r['seconds']:.2f}x)"
                )
                goals.append((goal, f"{ratio:.2f}x", ratio >= SPEEDUP_GOAL))
    small, big = (20_000, 200_000) if {20_000, 200_000} <= set(size["rows"]) else (size["rows"][0], size["rows"][-1])
    for name, (tool, num_proc) in RUNS.items():
        a, b = measured[small].get(name), measured[big].get(name)
        if small == big or not (a and b):
            continue
        parent = b["peak_rss_mib"] - a["peak_rss_mib"]
        children = b["children_peak_rss_mib"] - a["children_peak_rss_mib"]
        text = f"{parent:+.0f} MiB parent" + (f", {children:+.0f} MiB children" if a["children_peak_rss_mib"] else "")
        growth.append(f"{LABELS[tool]} num_proc {PROCS[num_proc]}: {text}")
        if name == NAMES["ours", 1]:
            goal = (
                f"preprocessing's peak RSS at {big:,} rows at most {GROWTH_GOAL_MB} MB above at {small:,} "
                "(kto-pipeline, 1 process; the goal for the whole precompute is tested in tests/test_memory.py)"
            )
            goals.append((goal, f"{parent:+.0f} MiB", parent * MIB <= GROWTH_GOAL_MB * 1e6))
    notes = [f"- preprocessing peak RSS growth {small:,} -> {big:,} rows: " + "; ".join(growth) + ".", ""]
    return table, details, harness.goals_table(*goals), notes if growth else []


def render_scale(measured: dict, skipped: dict, size: dict, size_name: str, seconds: float) -> str:
    table, details, goals, notes = _scale_tables(measured, skipped, size)
    model_rss = max((r.get("model_rss_mib", 0.0) for m in measured.values() for r in m.values()), default=0.0)
    command = f"`python benchmarks/bench.py --size {size_name} --only scale` (in `make bench`)"
    lines = [
        SCALE_HEADING + "\n",
        *harness.provenance(command, seconds, "kto-pipeline", "trl", "datasets", "transformers", "tokenizers", "torch"),
        "- data: the first N rows of `bench_scale.row_stream` as .jsonl (prompts of 10-30 words, completions of 5-20, "
        "punctuation, numbers, line breaks, about 1.5% non-ASCII words); tokenizer, both tools: "
        f"{TOKENIZERS[size['tokenizer']]}; max_length {size['max_length']} (no row dropped)",
        "- each run: a fresh process, its own empty HF_DATASETS_CACHE. Timed: **kto-pipeline**'s `prepare_rows`, "
        "what `precompute` runs before loading the model (load_source of the Arrow file already built, check_source, "
        "content_hash, preprocess = a batched datasets.map, select_rows, assign_kl_partners); **trl**'s "
        "`KTOTrainer._prepare_dataset` as `__init__` calls it (EOS map, tokenize map, max_length filter, KL map "
        f"(batch_size {size['batch']}), label count; num_proc=dataset_num_proc). num_proc None and kto-pipeline's 1 "
        "map in-process, trl's 1 in a pool of one. Apart: the JSON -> Arrow load (`load_dataset('json')`, both), "
        f"trl's constructor, its tiny Llama policy (loaded first, in its parent RSS: {model_rss:.0f} MiB at most).",
        "- rows/s = source rows / seconds. peak RSS (parent): ru_maxrss (trl: as `_prepare_dataset` returns); "
        "(children): RUSAGE_CHILDREN's, the largest ended child (the map's pool or manager; forked, so shared pages "
        f"count in both), 0 if none. Checked first: at each size all runs kept the same rows and the same prompt_ids "
        f"and completion_ids for the first {CHECK_ROWS} rows. trl is skipped where its rate at the size below "
        f"predicts over {TRL_SKIP_SECONDS} s.\n",
        *table,
        "",
        *details,
        "",
        *goals,
        "",
        *notes,
    ]
    return "\n".join(lines)


APPEND_HEADING = "## Append: `precompute --append` of 1% new rows to a 200,000-row cache"
# torch's threads in every run (OMP_NUM_THREADS; None: one per core). 2 threads on 2 cores shared with another torch
# process stall at each barrier (2026-11-24: the tiny reference pass fell from 111 rows/s to 7.5; 51 with 1 thread).
APPEND_THREADS = 1
APPEND_FORMS = {"full": "full precompute", "log": "append, grown log", "new": "append, new rows only"}
APPEND_GOAL = 0.02  # appending 1% new rows costs at most 2% of a full pass, plus a fixed overhead
SMOLLM2_TOKENS_PER_S = 726  # SmolLM2-135M's reference pass on this CPU (RESULTS.md, the real-model case, 2026-11-24)
FLAT_MIB = 50  # "memory stays flat": an append's peak RSS grows at most this much from the smaller cache to the larger
# The timed functions of kto_pipeline.stages.precompute.stage, by the part of an append's cost they are
_FIXED = ("precompute", "setup", "open_base", "held_keys", "match_keys", "load_reference", "plan_output", "finish")
PHASES = dict.fromkeys(_FIXED, "fixed") | {"prepare_rows": "other"}
PHASES |= dict.fromkeys(("load_source", "check_source", "content_hash", "content_keys", "open_keys"), "data")
PHASES |= dict.fromkeys(("preprocess", "select_rows", "_kl_partners", "score_shards"), "rows")
BUCKETS = {
    "start": "process start, imports, exit",
    "fixed": "fixed (tokenizer, manifest + keys files, matching, model load, writes)",
    "data": "dataset: JSON -> Arrow, sha256, content keys",
    "rows": "new rows: tokenize, score",
    "other": "other (prepare_rows' own)",
}
# the phases table's columns
SHOWN = ("load_source", "content_hash", "content_keys", "preprocess", "score_shards", "load_reference", "setup")
SHOWN += ("open_base", "held_keys", "match_keys", "plan_output", "finish")


def _time_phases(module, names) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Wrap the functions `names` of `module`: (their exclusive seconds, the rows of each call that loads or maps)."""
    exclusive: dict[str, float] = {}
    rows: dict[str, list[int]] = {"load_source": [], "preprocess": [], "content_keys": []}
    stack: list[float] = []  # per running call, the seconds of the timed calls inside it

    def wrap(name, original):
        def timed(*args, **kwargs):
            stack.append(0.0)
            start = time.perf_counter()
            try:
                out = original(*args, **kwargs)
            finally:
                seconds, inner = time.perf_counter() - start, stack.pop()
                if stack:
                    stack[-1] += seconds
                exclusive[name] = exclusive.get(name, 0.0) + (seconds - inner)
            if name in rows:  # the rows it returns (load_source) or maps (its first argument)
                rows[name].append(len(out if name == "load_source" else args[0]))
            return out

        return timed

    for name in names:
        setattr(module, name, wrap(name, getattr(module, name)))
    return exclusive, rows


def append_worker(name: str, size: dict, out: Path, model: Path, data: Path) -> dict:
    """One run of `kto-pipeline precompute [--append]` in this fresh process (nothing heavy imported yet)."""
    started = time.perf_counter()
    import datasets  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import kto_pipeline.cli as cli
    import kto_pipeline.stages.precompute.stage as stage
    from kto_pipeline.cache import read_manifest

    imports_seconds = time.perf_counter() - started
    form = name.split("_")[1]
    if form not in APPEND_FORMS:
        raise SystemExit(f"unknown worker {name}")
    exclusive, rows = _time_phases(stage, PHASES)
    argv = ["kto-pipeline", "precompute", "--model", str(model), "--dataset", str(data), "--output", str(out)]
    sys.argv = argv = argv + ["--max-length", str(size["max_length"])] + (["--append"] if form != "full" else [])
    start = time.perf_counter()
    try:
        cli.main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise SystemExit(f"{' '.join(argv)} exited with {exc.code}") from None
    cli_seconds = time.perf_counter() - start
    usage, peaks = resource.getrusage(resource.RUSAGE_SELF), _peaks()
    manifest = read_manifest(out)
    segment = {k: manifest["segments"][-1][k] for k in ("index", "rows", "matched_rows", "timing", "shards")}
    run = dict(form=form, imports_seconds=imports_seconds, cli_seconds=cli_seconds, phases=exclusive, segment=segment)
    run |= dict(cpu_seconds=usage.ru_utime + usage.ru_stime, segments=len(manifest["segments"]))
    run |= dict(source_rows=next(iter(rows["load_source"]), None), keyed_rows=sum(rows["content_keys"]))
    run |= dict(tokenized_rows=sum(rows["preprocess"]), tokenize_calls=len(rows["preprocess"]))
    return dict(run, cache_rows=manifest.counts["rows"], threads=torch.get_num_threads(), **peaks)


def _file_hashes(cache: Path) -> dict[str, str]:
    """sha256 of every shard and keys file of a cache (the manifest and the lock file left out)."""
    paths = [path for folder in ("shards", "keys") for path in sorted((cache / folder).glob("*"))]
    return {f"{p.parent.name}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def check_append(r: dict, base: dict[str, str], cache: Path, cache_rows: int, new: int) -> dict:
    """What an append must have done (the benchmark stops otherwise); returns what was checked."""
    name = f"{APPEND_FORMS[r['form']]} ({cache_rows:,} rows)"
    seg, t = r["segment"], r["segment"]["timing"]
    matched = cache_rows if r["form"] == "log" else 0  # the grown log's old rows are found in the cache
    after = _file_hashes(cache)
    changed = sorted(f for f, h in base.items() if after.get(f) != h)
    added = sorted(set(after) - set(base))
    start = time.perf_counter()  # `kto-pipeline inspect CACHE --verify` in its own process
    cmd = [sys.executable, "-m", "kto_pipeline.cli", "inspect", str(cache), "--verify"]
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=offline)
    verify_seconds = time.perf_counter() - start
    last = ([ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()] or ["no output"])[-1]
    problems = []
    if r["tokenized_rows"] != new or r["tokenize_calls"] != 1:
        problems.append(f"tokenized {r['tokenized_rows']} rows in {r['tokenize_calls']} calls, not {new} in 1")
    if t["rows_scored"] != new or seg["rows"] != new or seg["index"] != 1 or r["segments"] != 2:
        problems.append(f"segment {seg['index']} of {r['segments']}: {seg['rows']} rows, {t['rows_scored']} scored")
    if seg["matched_rows"] != matched:
        problems.append(f"{seg['matched_rows']} rows matched in the cache, expected {matched}")
    if r["cache_rows"] != cache_rows + new:
        problems.append(f"the cache holds {r['cache_rows']} rows, expected {cache_rows + new}")
    if changed:
        problems.append(f"files of the cache changed or vanished: {changed[:5]}")
    if sorted(set(seg["shards"]) | {"keys/segment-00001.arrow"}) != added:
        problems.append(f"new files {added}, the segment lists {seg['shards']}")
    if proc.returncode != 0 or not last.startswith("OK"):
        problems.append(f"kto-pipeline inspect --verify: {last}")
    if problems:
        raise SystemExit(f"{name}: " + "; ".join(problems) + ": not reporting numbers")
    done = f"tokenized and scored {new} rows, {len(base)} files of the cache unchanged, inspect --verify OK"
    print(f"  {name}: {done} ({verify_seconds:.1f} s)", flush=True)
    return {"unchanged_files": len(base), "new_files": {f: after[f] for f in added}}


def run_append(work: Path, size_name: str, results: Path | None, caches: tuple[int, ...] | None, tokenizer: str | None):
    """`--only append`: per cache size, a full precompute, then both appends into copies of its cache (checked)."""
    started = time.perf_counter()
    size, model = _sized(work, harness.APPEND_SIZES[size_name], "caches", caches, tokenizer)
    if size["goal_cache"] not in size["caches"]:
        size["goal_cache"] = size["caches"][-1]
    new, runs = size["new"], work / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    threads = {"OMP_NUM_THREADS": str(APPEND_THREADS), "MKL_NUM_THREADS": str(APPEND_THREADS)} if APPEND_THREADS else {}
    measured: dict[int, dict[str, dict]] = {n: {} for n in size["caches"]}
    for n in size["caches"]:
        print(f"{n:,}-row cache, {new:,} new rows ({size['tokenizer']} tokenizer):", flush=True)
        sources = {"full": data_file(work, n), "log": data_file(work, n + new), "new": data_file(work, n + new, n)}
        for form, source in sources.items():
            name = f"append_{form}_{n}"
            if form != "full":  # a copy of the full precompute's cache, appended to
                shutil.copytree(runs / f"append_full_{n}", runs / name)
            load = os.getloadavg()[0]
            r = measured[n][form] = own_cache_worker(name, work, size_name, model, source, threads)
            r.update(load_before=load, load_after=os.getloadavg()[0])
            if form == "full":
                base = _file_hashes(runs / name)
            else:
                r |= check_append(r, base, runs / name, n, new)
                shutil.rmtree(runs / name, ignore_errors=True)  # the copy, checked
        log_files, new_files = (measured[n][form]["new_files"] for form in ("log", "new"))
        if log_files != new_files:
            raise SystemExit(f"{n:,} rows: the two appends wrote different files: {log_files} vs {new_files}")
        print(f"  both appends wrote the same {len(log_files)} files, byte for byte", flush=True)
    seconds = time.perf_counter() - started
    harness.publish(render_append(measured, size, size_name, seconds), results, APPEND_HEADING)


def append_buckets(r: dict) -> dict[str, float]:
    """A run's wall time (process_seconds, from outside) split into BUCKETS (seconds)."""
    out = dict.fromkeys(BUCKETS, 0.0)
    for name, seconds in r["phases"].items():
        out[PHASES[name]] += seconds
    out["start"] = r["process_seconds"] - r["cli_seconds"]
    out["other"] += r["cli_seconds"] - sum(r["phases"].values())  # the CLI around the stage (typer)
    return out


def _append_tables(measured: dict) -> tuple[list[str], list[str], list[str]]:
    """(the runs: times, rows, tokens, peaks; the split of each run's time; the phases that matter, seconds)."""
    runs = harness.table_head(
        "| cache rows | run | dataset rows | rows tokenized | rows scored | tokens scored | process s (outside) | "
        "manifest: wall s | preprocess s | reference pass s | CPU s | peak RSS MiB | vs full pass |"
    )
    split = harness.table_head("| cache rows | run | " + " | ".join(BUCKETS.values()) + " | total s |")
    phases = harness.table_head("| cache rows | run | imports | " + " | ".join(SHOWN) + " |")
    for n, forms in measured.items():
        for form, r in forms.items():
            head, t, b = (f"{n:,}", APPEND_FORMS[form]), r["segment"]["timing"], append_buckets(r)
            ratio = "-" if form == "full" else f"{r['process_seconds'] / forms['full']['process_seconds']:.2%}"
            counts = (f"{x:,}" for x in (r["source_rows"], r["tokenized_rows"], t["rows_scored"], t["tokens_scored"]))
            times = (r["process_seconds"], t["wall_seconds"], t["preprocess_seconds"], t["reference_pass_seconds"])
            cpu_rss = (f"{r['cpu_seconds']:.0f}", f"{r['peak_rss_mib']:.0f}")
            runs.append(harness.md_row(*head, *counts, *(f"{x:.1f}" for x in times), *cpu_rss, ratio))
            split.append(harness.md_row(*head, *(f"{b[k]:.2f}" for k in BUCKETS), f"{sum(b.values()):.1f}"))
            cells = [f"{r['phases'].get(p, 0.0):.2f}" for p in SHOWN]
            phases.append(harness.md_row(*head, f"{r['imports_seconds']:.2f}", *cells))
    return runs, split, phases


def _append_goals(measured: dict, size: dict) -> tuple[list[str], list[str]]:
    """(the goals table, the notes that go with it), about the appends to the goal's cache."""
    n, new, small = size["goal_cache"], size["new"], size["caches"][0]
    full = measured[n]["full"]
    full_s, full_peak, ft = full["process_seconds"], full["peak_rss_mib"], full["segment"]["timing"]
    full_rows_s = append_buckets(full)["rows"]
    cost, only_new, peaks, flat, fixed_notes, rate_notes = [], [], [], [], [], []
    for form in ("log", "new"):
        label, r = APPEND_FORMS[form], measured[n][form]
        b, t, p = append_buckets(r), r["segment"]["timing"], r["phases"]
        fixed, total = b["start"] + b["fixed"], sum(b.values())
        variable, budget = total - fixed, APPEND_GOAL * full_s
        goal = (
            f"{label}: {new:,} new rows ({new / n:.0%}) to a {n:,}-row cache cost at most {APPEND_GOAL:.0%} of the "
            f"full pass ({budget:.1f} s of {full_s:.1f} s) + a fixed overhead X = {fixed:.1f} s (measured: process "
            "start and imports, tokenizer, manifest and keys files, matching, model load, writes)"
        )
        what = (
            f"{total:.1f} s in all = X + {variable:.1f} s ({variable / full_s:.2%} of the full pass; the whole "
            f"append {total / full_s:.2%})"
        )
        cost.append((goal, what, variable <= budget))
        per_row, full_per_row = (x["tokens_scored"] / max(x["rows_scored"], 1) for x in (t, ft))
        what = (
            f"tokenized {r['tokenized_rows']:,}, scored {t['rows_scored']:,} rows ({t['tokens_scored']:,} tokens, "
            f"{per_row:.1f} a row; the full pass {full_per_row:.1f}); hashed (content keys, no tokenizer) "
            f"{r['keyed_rows']:,}; {r['unchanged_files']} files of the cache unchanged (sha256); inspect --verify OK"
        )
        only_new.append((f"{label}: only the new rows are tokenized and scored", what, "yes"))
        peak = r["peak_rss_mib"]
        what = f"{peak:.0f} MiB vs {full_peak:.0f} MiB ({peak - full_peak:+.0f})"
        peaks.append((f"{label}: peak RSS at most the full pass's", what, peak <= full_peak))
        if small != n:
            a = measured[small][form]
            goal = (
                f"{label}: memory stays flat: peak RSS of the {new:,}-row append to a {n:,}-row cache at most "
                f"{FLAT_MIB} MiB above the one to a {small:,}-row cache"
            )
            growth = peak - a["peak_rss_mib"]
            flat.append((goal, f"{a['peak_rss_mib']:.0f} -> {peak:.0f} MiB ({growth:+.0f})", growth <= FLAT_MIB))
            a_fixed = sum(append_buckets(a)[k] for k in ("start", "fixed"))
            both = f"{small:,}-row cache {a_fixed:.1f} s, {n:,}-row cache {fixed:.1f} s"
            fixed_notes.append(f"- fixed overhead X of the {label}: {both}.")
        rate, full_rate = (x["rows_scored"] / x["reference_pass_seconds"] for x in (t, ft))
        rate_notes.append(
            f"- {label}: its new-row part ({b['rows']:.1f} s: tokenize {p.get('preprocess', 0):.2f} s, score "
            f"{p.get('score_shards', 0):.1f} s) is {b['rows'] / full_rows_s:.2%} of the full pass's "
            f"({full_rows_s:.0f} s): it scores at {rate:.1f} rows/s, the full pass at {full_rate:.1f}."
        )
    r = measured[n]["log"]
    data_s, p = append_buckets(r)["data"], r["phases"]
    keys_s = p.get("content_keys", 0.0)
    data_note = (
        f"- the grown-log form pays for its whole log: {data_s:.1f} s for {r['source_rows']:,} rows "
        f"({r['source_rows'] / max(data_s, 1e-9):,.0f} rows/s: JSON -> Arrow {p.get('load_source', 0):.1f} s, sha256 "
        f"{p.get('content_hash', 0):.2f} s, content keys {keys_s:.1f} s = {r['keyed_rows'] / max(keys_s, 1e-9):,.0f} "
        f"rows/s); the new-rows form {append_buckets(measured[n]['new'])['data']:.2f} s. The full pass's keys of its "
        f"{full['source_rows']:,} rows: {full['phases'].get('content_keys', 0):.1f} s of its "
        f"{ft['preprocess_seconds']:.1f} s of preprocessing."
    )
    return harness.goals_table(*cost, *only_new, *peaks, *flat), [*fixed_notes, *rate_notes, data_note]


def render_append(measured: dict, size: dict, size_name: str, seconds: float) -> str:
    runs, split, phases = _append_tables(measured)
    goals, notes = _append_goals(measured, size)
    new = size["new"]
    t = measured[size["goal_cache"]]["full"]["segment"]["timing"]
    tokens, tiny = t["tokens_scored"], t["tokens_scored"] / t["reference_pass_seconds"]
    loads = ", ".join(f"{r['load_before']:.1f}/{r['load_after']:.1f}" for m in measured.values() for r in m.values())
    threads = max(r["threads"] for m in measured.values() for r in m.values())
    command = f"`python benchmarks/bench.py --size {size_name} --only append`"
    head = harness.provenance(command, seconds, "kto-pipeline", "datasets", "transformers", "tokenizers", "torch")
    head[2] += (
        f"; 1-minute load average before / after each run: {loads} (a run keeps {threads} torch thread(s) busy, "
        f"OMP_NUM_THREADS={APPEND_THREADS}: more load means a shared machine)"
    )
    lines = [
        APPEND_HEADING + "\n",
        *head,
        f"- data: `bench_scale.row_stream`: the cache = the first N rows; the grown log = the first N + {new:,}; the "
        f"new rows = rows N .. N + {new - 1:,}. Tokenizer: {TOKENIZERS[size['tokenizer']]}; reference: "
        "`build_model`'s tiny random Llama (hidden 64, 2 layers; mostly its 49152-way output layer), float32, the "
        f"CLI's defaults otherwise (max_length {size['max_length']}, --num-proc 1, batch 16 sequences / 16384 tokens, "
        f"shards of 2048 rows). SmolLM2-135M scored {SMOLLM2_TOKENS_PER_S} tokens/s on this CPU with 2 threads "
        f"(real-model section, 2026-11-24): {tokens / SMOLLM2_TOKENS_PER_S / 3600:.1f} hours for the full pass's "
        f"{tokens:,} tokens; the tiny model {tiny:,.0f} tokens/s with 1 thread ({tiny / SMOLLM2_TOKENS_PER_S:.0f}x "
        "faster): with the real model both reference passes grow that much, and an append's fixed and dataset costs "
        "(model-independent but the load) weigh that much less.",
        "- each run (`bench.py worker append_<full|log|new>_N`): `kto-pipeline precompute [--append]` in a fresh "
        "process, its own empty HF_DATASETS_CACHE; appends into copies of the full pass's cache. process s: start to "
        "exit; manifest: the segment's `timing` (from setup); CPU s: user + system; peak RSS: ru_maxrss.",
        "- split (`PHASES`, exclusive seconds): 'process start, ...' = process s - the CLI call; 'fixed' = setup, "
        "open_base, held_keys + match_keys (a few bytes a cached row), load_reference, plan_output, finish, the "
        "stage's own (lock); 'dataset' = load_source, check_source, content_hash, content_keys, open_keys; 'new rows' "
        "= preprocess, select_rows, KL partners, score_shards; 'other' = prepare_rows' and the CLI's own (selecting "
        "the new rows, opening the tokenized file), counted against the 2%, not as fixed.",
        f"- checked first: each append tokenized exactly {new:,} rows in one map, scored {new:,}, recorded them as "
        "segment 1; every shard and keys file of the cache kept its sha256; `kto-pipeline inspect CACHE --verify` "
        "passed; the two appends wrote the same new files, byte for byte.\n",
        *runs,
        "\nWhere each run's time goes (seconds; the columns add up to process s):\n",
        *split,
        "\nThe phases (exclusive seconds; imports timed inside the worker):\n",
        *phases,
        "",
        *goals,
        "",
        *notes,
        "",
    ]
    return "\n".join(lines)
