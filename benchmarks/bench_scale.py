"""The scale case of the benchmark (`python benchmarks/bench.py --only scale`, part of `make bench`): preprocessing
rows/s and peak RSS at 20,000 / 200,000 / 1,000,000 short unpaired rows, kto-pipeline against trl.KTOTrainer 1.16,
with 1 and 2 processes.

Every measurement runs in a fresh process (`bench.py worker scale_<tool>_<num_proc>`) with its own, empty
HF_DATASETS_CACHE, so that nothing is read from an earlier run's cache. What each one times:

- load (both tools, reported apart): `datasets.load_dataset("json")` of the .jsonl into Arrow in the datasets cache,
  the same call in both (kto-pipeline's `load_source` makes it; trl's user makes it before building the trainer).
- kto-pipeline, preprocessing: what `precompute` runs before it loads the model, `stages.precompute.prepare_rows`
  (load_source again, now reading the Arrow file just built, check_source, content_hash of the file, preprocess =
  datasets.map batched with `num_proc` into the tokenized Arrow file; opening that file, `select_rows` and
  `assign_kl_partners`). `--num-proc 1` maps in-process.
- trl, preprocessing: `KTOTrainer._prepare_dataset` as `KTOTrainer.__init__` calls it (the EOS map, the tokenize
  map, the max_length filter, the KL map with batch_size=per_device_train_batch_size, the label count), each step
  with `num_proc=args.dataset_num_proc`, timed by wrapping the method. Measured with dataset_num_proc None (its
  default: in-process), 1 (datasets 5 runs any num_proc >= 1 in a pool, here of one worker process) and 2. The rest
  of the constructor (Trainer and accelerate setup, loading its reference model) and the loading of the policy
  model before it (a tiny Llama over the same tokenizer: the trainer needs one) are reported apart.

rows/s = source rows / preprocessing seconds. Peak RSS: ru_maxrss of the worker (RUSAGE_SELF, for trl read as
`_prepare_dataset` returns) and of its largest terminated child (RUSAGE_CHILDREN: the datasets.map pool's workers
and manager; they are forked from the worker, so their RSS counts the pages they share with it).
Before any speed is reported, the token ids of the first rows are compared across all the measurements of a size.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path

from harness import (
    HERE,
    children_peak_rss_mib,
    machine,
    peak_rss_mib,
    rss_mib,
    run_worker,
    time_calls,
    utc_stamp,
    write_section,
)

SCALE_HEADING = "## Scale: preprocessing 20k / 200k / 1M rows"
SCALE_SIZES = {
    # rows: the sizes measured, ascending; tokenizer: "smollm2" (SmolLM2-135M-Instruct's BPE) or "char" (tiny.py)
    "full": dict(rows=(20_000, 200_000, 1_000_000), tokenizer="smollm2", max_length=1024, batch=8),
    "smoke": dict(rows=(500, 2_000), tokenizer="char", max_length=1024, batch=8),
}
# the measurements: tool -> num_proc values. kto-pipeline's --num-proc 1 maps in-process (num_proc=None); trl's
# dataset_num_proc=1 does not: datasets 5 runs any num_proc >= 1 in a Pool, so trl's default (None) is measured too
VARIANTS = {"ours": (1, 2), "trl": (None, 1, 2)}
LABELS = {"ours": "kto-pipeline", "trl": "trl"}
CHECK_ROWS = 100  # rows whose token ids must agree across the tools before speed is reported
TRL_SKIP_SECONDS = 300  # trl is not run at a size where its rate at the size below predicts more than this
DATA_VERSION = 1  # bump when the row generator changes
SPEEDUP_GOAL = 1.7  # issue 12: --num-proc 2 tokenizes at least 1.7x faster than 1
GROWTH_GOAL_MB = 150  # issue 12: peak RSS at 200,000 rows at most 150 MB (10^6 bytes) above the one at 20,000
MIB = 1 << 20
BENCH = HERE / "bench.py"  # the scale workers run as `bench.py worker scale_...`, as every bench worker does


def worker_name(tool: str, num_proc: int | None) -> str:
    return f"scale_{tool}_{num_proc or 'default'}"


def _proc_label(num_proc: int | None) -> str:
    return "default (None)" if num_proc is None else str(num_proc)


# ------------------------------------------------------------------------------------------------ data

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
    """Short unpaired rows, endlessly: prompts of 10-30 words (a question or an instruction), completions of 5-20
    words, most of them starting with a space; mixed case, punctuation, numbers, line breaks and non-ASCII words
    (about 1.5% of words); labels about 55% desirable."""
    rng = random.Random(seed)
    while True:
        prompt = _text(rng, rng.randint(10, 30), _OPENERS, rng.choice(("?", "?", ".", ":", "?\n")))
        completion = _text(rng, rng.randint(5, 20), _STARTS, rng.choice((".", ".", "!", "")))
        if rng.random() < 0.8:
            completion = " " + completion
        yield {"prompt": prompt, "completion": completion, "label": rng.random() < 0.55}


def data_path(work: Path, rows: int) -> Path:
    """The .jsonl of the first `rows` rows (`write_data`)."""
    return work / f"data-v{DATA_VERSION}-{rows}.jsonl"


def model_path(work: Path, tokenizer: str) -> Path:
    """The directory `build_model` writes for `tokenizer`."""
    return work / f"model-{tokenizer}"


def write_data(work: Path, sizes: tuple[int, ...]) -> dict[int, Path]:
    """data-N.jsonl for each size, the first N rows of the same stream (written once, kept between runs)."""
    work.mkdir(parents=True, exist_ok=True)
    paths = {n: data_path(work, n) for n in sizes}
    missing = sorted(n for n, p in paths.items() if not p.exists())
    if missing:
        print(f"writing {', '.join(f'{n:,}' for n in missing)} rows of data ...", flush=True)
        files = {n: open(paths[n].with_suffix(".part"), "w", encoding="utf-8") for n in missing}
        try:
            for i, row in zip(range(max(missing)), row_stream(), strict=False):
                line = json.dumps(row, ensure_ascii=False) + "\n"
                for n, f in files.items():
                    if i < n:
                        f.write(line)
        finally:
            for f in files.values():
                f.close()
        for n in missing:
            paths[n].with_suffix(".part").replace(paths[n])
    return paths


def build_model(work: Path, tokenizer: str) -> Path:
    """A directory with the tokenizer both tools use and a tiny Llama over its vocabulary (trl's trainer needs a
    model; kto-pipeline's preprocessing reads only the tokenizer)."""
    from transformers import AutoTokenizer

    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model

    path = model_path(work, tokenizer)
    if (path / "config.json").exists():
        return path
    if tokenizer == "smollm2":
        from kto_pipeline.demo.smollm2 import default_cache_dir, fetch_smollm2

        tok = AutoTokenizer.from_pretrained(fetch_smollm2(default_cache_dir()))  # converted once into ~/.cache
    else:
        tok = build_char_tokenizer()
    model = build_tiny_model(tok)
    tmp = path.with_name(path.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------------------------- workers


def _peaks() -> dict:
    return {"peak_rss_mib": peak_rss_mib(), "children_peak_rss_mib": children_peak_rss_mib()}


def scale_worker(name: str, size: dict, out: Path, model: Path, data: Path) -> dict:
    """One measurement (`name` = scale_<tool>_<num_proc or default>) in this fresh process; returns a JSON-able
    dict. `datasets` (which trl imports lazily) is imported before the post-import baseline, for both tools."""
    import datasets  # noqa: F401

    _, tool, proc = name.split("_")
    num_proc = None if proc == "default" else int(proc)
    baseline = {"baseline_rss_mib": rss_mib()}
    if tool == "ours" and num_proc is not None:
        return {**_ours(num_proc, size, out, model, data), **baseline}
    if tool == "trl":
        return {**_trl(num_proc, size, out, model, data), **baseline}
    raise SystemExit(f"unknown worker {name}")


def _ours(num_proc: int, size: dict, out: Path, model: Path, data: Path) -> dict:
    import numpy as np

    from kto_pipeline.config import PrecomputeConfig
    from kto_pipeline.data import load_source
    from kto_pipeline.models import load_tokenizer
    from kto_pipeline.stages.precompute import prepare_rows

    tokenizer = load_tokenizer(str(model))
    start = time.perf_counter()
    source_rows = len(load_source(str(data)))
    load_seconds = time.perf_counter() - start

    config = PrecomputeConfig(
        model=str(model), dataset=str(data), output=str(out), max_length=size["max_length"], num_proc=num_proc
    )
    start = time.perf_counter()
    prepared = prepare_rows(config, tokenizer)  # load, check, tokenize, select, pair: all of it, as precompute
    seconds = time.perf_counter() - start
    peaks = _peaks()
    if prepared.cached:
        raise SystemExit("kto-pipeline read its tokenized rows from a cache: the measurement is void")
    rows = prepared.rows
    first = np.arange(min(CHECK_ROWS, len(rows)))
    return {
        "tool": "ours",
        "num_proc": num_proc,
        "source_rows": source_rows,
        "kept_rows": len(rows),
        "load_seconds": load_seconds,
        "seconds": seconds,
        "tokenize_seconds": prepared.tokenize_seconds,  # the datasets.map part of `seconds`
        "kl_partners": len(prepared.partners),
        "first_rows": {col: rows.take(first, col) for col in ("prompt_ids", "completion_ids")},
        **peaks,
    }


def _trl(num_proc: int | None, size: dict, out: Path, model: Path, data: Path) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model)
    before = rss_mib()
    start = time.perf_counter()
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model_seconds = time.perf_counter() - start
    model_rss = rss_mib() - before

    start = time.perf_counter()
    dataset = load_dataset("json", data_files=str(data), split="train")
    load_seconds = time.perf_counter() - start

    timed: dict = {}

    def prepared(seconds: float, *args, **kwargs) -> None:
        timed["seconds"] = seconds
        timed.update(_peaks())  # as _prepare_dataset returns

    time_calls(KTOTrainer, "_prepare_dataset", prepared)
    args = KTOConfig(
        output_dir=str(out),
        per_device_train_batch_size=size["batch"],
        max_length=size["max_length"],
        dataset_num_proc=num_proc,
        precompute_ref_log_probs=False,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    start = time.perf_counter()
    trainer = KTOTrainer(model=policy, args=args, train_dataset=dataset, processing_class=tokenizer)
    init_seconds = time.perf_counter() - start
    ds = trainer.train_dataset
    first = ds.select(range(min(CHECK_ROWS, len(ds))))
    return {
        "tool": "trl",
        "num_proc": num_proc,
        "source_rows": len(dataset),
        "kept_rows": len(ds),
        "load_seconds": load_seconds,
        "model_seconds": model_seconds,
        "model_rss_mib": model_rss,
        "init_seconds": init_seconds,
        **timed,
        "end_peak_rss_mib": _peaks()["peak_rss_mib"],
        "first_rows": {col: [list(x) for x in first[col]] for col in ("prompt_ids", "completion_ids")},
    }


# ------------------------------------------------------------------------------------------------ main


def check_tokens(results: dict[str, dict], rows: int) -> None:
    """The measurements of one size kept the same rows and tokenized the first ones identically, else no speed
    is reported. Pops the token ids out of `results`."""
    named = {name: r.pop("first_rows") for name, r in results.items()}
    ref_name = next(iter(named))
    ref, ref_kept = named[ref_name], results[ref_name]["kept_rows"]
    for name, got in named.items():
        if results[name]["kept_rows"] != ref_kept:
            raise SystemExit(f"{rows} rows: {name} kept {results[name]['kept_rows']} rows, {ref_name} {ref_kept}")
        for col in ("prompt_ids", "completion_ids"):
            if len(got[col]) != len(ref[col]):
                raise SystemExit(
                    f"{rows} rows: {name} returned {len(got[col])} rows of {col}, {ref_name} {len(ref[col])}"
                )
            for i, (a, b) in enumerate(zip(ref[col], got[col], strict=True)):
                if list(a) != list(b):
                    raise SystemExit(
                        f"{rows} rows: row {i} {col} differ between {ref_name} and {name}: {a[:20]}... vs "
                        f"{b[:20]}...: not reporting speed"
                    )
    n = len(ref["prompt_ids"])
    print(f"  token ids agree on the first {n} rows across {', '.join(named)} ({ref_kept} rows kept)", flush=True)


def run_scale(work: Path, size_name: str, results: Path | None, rows: tuple[int, ...] | None, tokenizer: str | None):
    """`--only scale`: every size, both tools, 1 and 2 processes, each in a fresh process and datasets cache."""
    size = dict(SCALE_SIZES[size_name])
    size["rows"] = tuple(sorted(rows or size["rows"]))
    size["tokenizer"] = tokenizer or size["tokenizer"]
    started = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work, size["tokenizer"])
    data = write_data(work, size["rows"])
    measured: dict[int, dict[str, dict]] = {}
    skipped: dict[int, dict[str, str]] = {}
    for n in size["rows"]:
        print(f"{n:,} rows ({size['tokenizer']} tokenizer):", flush=True)
        size_dir = work / f"rows{n}"
        shutil.rmtree(size_dir, ignore_errors=True)
        measured[n], skipped[n] = {}, {}
        for tool, procs in VARIANTS.items():
            for num_proc in procs:
                name = worker_name(tool, num_proc)
                estimate = _estimate(measured, n, name)
                if tool == "trl" and estimate is not None and estimate > TRL_SKIP_SECONDS:
                    skipped[n][name] = f"skipped: {estimate:.0f} s expected (> {TRL_SKIP_SECONDS} s)"
                    print(f"  {name:<24} {skipped[n][name]}", flush=True)
                    continue
                cache = size_dir / f"hf-datasets-cache-{name}"  # fresh and its own: nothing read from a cache
                try:
                    flags = ["--size", size_name, "--case", "scale", "--model", str(model), "--data", str(data[n])]
                    measured[n][name] = run_worker(BENCH, name, size_dir, flags, env={"HF_DATASETS_CACHE": str(cache)})
                finally:  # trl's copies of a million rows take GBs
                    shutil.rmtree(cache, ignore_errors=True)
        check_tokens(measured[n], n)
        shutil.rmtree(size_dir, ignore_errors=True)
    section = render_scale(measured, skipped, size, size_name, time.perf_counter() - started)
    print("\n" + section)
    if results:
        write_section(results, SCALE_HEADING, section)


def _estimate(measured: dict[int, dict[str, dict]], n: int, name: str) -> float | None:
    """Seconds `name` would take at `n` rows at its rate at the largest size below `n` (None: none measured)."""
    below = [m for m in measured if m < n and name in measured[m]]
    if not below:
        return None
    m = max(below)
    return measured[m][name]["seconds"] * n / m


def _speedup(runs: dict[str, dict], tool: str, num_proc: int | None) -> str:
    """The speed-up cell of a 2-process run: against the 1-process run(s) of the same tool."""
    if num_proc != 2 or worker_name(tool, 2) not in runs:
        return "-"
    two = runs[worker_name(tool, 2)]["seconds"]
    ones = sorted((p for p in VARIANTS[tool] if p != 2 and worker_name(tool, p) in runs), key=lambda p: p is None)
    cells = [f"{runs[worker_name(tool, p)]['seconds'] / two:.2f}x vs {_proc_label(p)}" for p in ones]
    return (cells[0].split(" vs ")[0] if len(cells) == 1 else ", ".join(cells)) if cells else "-"


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def _scale_tables(measured: dict, skipped: dict, size: dict) -> tuple[list[str], list[str]]:
    """(the main table: seconds, rows/s, peaks, speed-up; the details: load, trl's constructor, RSS growth)."""
    table = [
        "| rows | tool | num_proc | seconds | rows/s | peak RSS MiB (parent) | peak RSS MiB (children) | "
        "speed-up 2 vs 1 proc |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    details = [
        "| rows | tool | num_proc | load s (JSON -> Arrow) | trl: constructor s (its _prepare_dataset included) | "
        "trl: policy model load s | post-import RSS MiB | parent RSS growth MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in size["rows"]:
        runs = measured[n]
        for tool, procs in VARIANTS.items():
            for num_proc in procs:
                name = worker_name(tool, num_proc)
                head = f"| {n:,} | {LABELS[tool]} | {_proc_label(num_proc)} |"
                if name not in runs:
                    table.append(f"{head} {skipped[n].get(name, 'not run')} | - | - | - | - |")
                    continue
                r = runs[name]
                table.append(
                    f"{head} {r['seconds']:.2f} | {r['source_rows'] / r['seconds']:,.0f} | {r['peak_rss_mib']:.0f} | "
                    f"{r['children_peak_rss_mib']:.0f} | {_speedup(runs, tool, num_proc)} |"
                )
                trl_cells = f"{r['init_seconds']:.2f} | {r['model_seconds']:.2f}" if tool == "trl" else "- | -"
                details.append(
                    f"{head} {r['load_seconds']:.2f} | {trl_cells} | {r['baseline_rss_mib']:.0f} | "
                    f"{r['peak_rss_mib'] - r['baseline_rss_mib']:.0f} |"
                )
    return table, details


def _scale_goals(measured: dict, size: dict) -> tuple[list[str], list[str]]:
    """(the goals table, the growth note: peak RSS from the smaller size to the larger, "" where one size ran)."""
    goals = ["| goal | measured | met |", "| --- | --- | --- |"]
    for n in size["rows"]:
        one, two = (measured[n].get(worker_name("ours", p)) for p in (1, 2))
        if one and two:
            ratio = one["tokenize_seconds"] / two["tokenize_seconds"]
            goals.append(
                f"| kto-pipeline: --num-proc 2 tokenizes at least {SPEEDUP_GOAL}x faster than 1 ({n:,} rows; the "
                f"datasets.map: {one['tokenize_seconds']:.1f} s vs {two['tokenize_seconds']:.1f} s; all of the "
                f"preprocessing: {one['seconds'] / two['seconds']:.2f}x) | {ratio:.2f}x | "
                f"{_met(ratio >= SPEEDUP_GOAL)} |"
            )
    growth_notes = []
    small, big = (20_000, 200_000) if {20_000, 200_000} <= set(size["rows"]) else (size["rows"][0], size["rows"][-1])
    if small != big:
        for tool, procs in VARIANTS.items():
            for num_proc in procs:
                name = worker_name(tool, num_proc)
                a, b = measured[small].get(name), measured[big].get(name)
                if not (a and b):
                    continue
                parent = b["peak_rss_mib"] - a["peak_rss_mib"]
                children = b["children_peak_rss_mib"] - a["children_peak_rss_mib"]
                pooled = a["children_peak_rss_mib"] > 0
                text = f"{parent:+.0f} MiB parent" + (f", {children:+.0f} MiB children" if pooled else "")
                growth_notes.append(f"{LABELS[tool]} num_proc {_proc_label(num_proc)}: {text}")
                if tool == "ours" and num_proc == 1:
                    goals.append(
                        f"| preprocessing's peak RSS at {big:,} rows at most {GROWTH_GOAL_MB} MB above at {small:,} "
                        f"(kto-pipeline, 1 process; the issue's goal is for the whole precompute, tested in "
                        f"tests/test_memory.py) | {parent:+.0f} MiB | {_met(parent * MIB <= GROWTH_GOAL_MB * 1e6)} |"
                    )
    notes = []
    if growth_notes:
        notes = [f"- preprocessing peak RSS growth {small:,} -> {big:,} rows: " + "; ".join(growth_notes) + ".", ""]
    return goals, notes


def render_scale(measured: dict, skipped: dict, size: dict, size_name: str, seconds: float) -> str:
    import datasets
    import tokenizers
    import torch
    import transformers
    import trl

    import kto_pipeline

    table, details = _scale_tables(measured, skipped, size)
    goals, notes = _scale_goals(measured, size)
    tokenizer_text = (
        "SmolLM2-135M-Instruct's (BPE, vocab 49152)"
        if size["tokenizer"] == "smollm2"
        else "the character-level one of `kto_pipeline.demo.tiny`"
    )
    model_rss = max((r.get("model_rss_mib", 0.0) for m in measured.values() for r in m.values()), default=0.0)
    lines = [
        SCALE_HEADING,
        "",
        f"- command: `python benchmarks/bench.py --size {size_name} --only scale` (in `make bench`)",
        f"- date: {utc_stamp()}; total time {seconds:.0f} s",
        f"- machine: {machine()}",
        f"- versions: kto-pipeline {kto_pipeline.__version__}, trl {trl.__version__}, datasets {datasets.__version__}, "
        f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}",
        "- data: short unpaired rows (prompts of 10-30 words, completions of 5-20, questions and instructions with "
        "punctuation, numbers, line breaks and about 1.5% non-ASCII words; `bench_scale.row_stream`), the first N "
        f"rows of one stream as a .jsonl; tokenizer: {tokenizer_text}, the same for both tools; max_length "
        f"{size['max_length']} (no row dropped)",
        "- each measurement in a fresh process with its own empty HF_DATASETS_CACHE. Timed as preprocessing: "
        "**kto-pipeline** = what `precompute` runs before it loads the model (`prepare_rows`: load_source "
        "of the Arrow file already built, check_source, content_hash of the file, preprocess = datasets.map batched "
        "into the tokenized Arrow file; then opening that file, select_rows, assign_kl_partners); `--num-proc 1` maps "
        "in-process. **trl** = `KTOTrainer._prepare_dataset` as `KTOTrainer.__init__` calls it (EOS map, tokenize "
        "map, max_length filter, KL map with batch_size=per_device_train_batch_size "
        f"({size['batch']}), label count), every step with `num_proc=args.dataset_num_proc`: its default None maps "
        "in-process; 1 runs each step in a pool of one worker process (datasets 5 pools any num_proc >= 1). Timed "
        "apart: the JSON -> Arrow load (`datasets.load_dataset('json')`, the same call for both), the rest of trl's "
        "constructor, and the tiny Llama policy over the same tokenizer that it needs (loaded before it, so in its "
        f"parent RSS: {model_rss:.0f} MiB at most).",
        "- rows/s = source rows / preprocessing seconds. peak RSS (parent) = ru_maxrss of the worker process (for trl "
        "read as `_prepare_dataset` returns); (children) = RUSAGE_CHILDREN's ru_maxrss, the largest of its "
        "terminated child processes (the datasets.map pool and its manager; forked from the worker, so the pages "
        "they share with it count in both); 0 where nothing ran in a child.",
        f"- correctness: at every size all the measurements kept the same rows and produced identical prompt_ids and "
        f"completion_ids for the first {CHECK_ROWS} rows (checked before this section was written).",
        f"- trl is not run at a size where its rate at the size below predicts more than {TRL_SKIP_SECONDS} s.",
        "",
        *table,
        "",
        *details,
        "",
        *goals,
        "",
        *notes,
    ]
    return "\n".join(lines)
