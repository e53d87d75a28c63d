"""Stage 1: run the frozen reference model once over a dataset and write the cache.

`precompute()` is the outline, one phase a function around one `Pass`:

    prepare rows -> load the reference -> plan the output -> score shards -> finish

The data is checked and tokenized before the model loads (`data.py`, datasets.map, cached on disk), so a bad row
is reported in seconds. Rows are scored a shard at a time, so that a crash loses at most one shard of work and a
rerun resumes after the intact ones. Within a shard each row is one tree, its prompt followed by its completion
and its KL completion, which both attend to the prompt (`scoring/packing.py`): the prompt runs once. Trees are
packed side by side into rows of token-budgeted forward passes, so almost no compute goes to padding. Models whose
attention takes no packed layout run every sequence on its own, length-sorted and padded; the manifest records
which (`cache.py` owns the manifest and the shards).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from kto_pipeline import __version__
from kto_pipeline.cache import (
    MANIFEST,
    SCHEMA,
    SHARD_DIR,
    Manifest,
    fingerprint_diff,
    model_weights_hash,
    new_manifest,
    read_manifest,
    sha256_file,
    token_sum,
    tokenizer_hash,
    write_manifest,
    write_shard,
)
from kto_pipeline.config import PrecomputeConfig
from kto_pipeline.data import (
    TokenizedRows,
    assign_kl_partners,
    check_source,
    content_hash,
    load_source,
    preprocess,
    preprocess_cache_dir,
    preprocess_fingerprint,
    select_rows,
)
from kto_pipeline.distributed import decided_by_main_process, print0
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.lock import holds_files, main_process_lock
from kto_pipeline.models import load_model, load_tokenizer, resolve_dtype
from kto_pipeline.precision import Regime, default_bf16
from kto_pipeline.scoring.attention import packing_unsupported
from kto_pipeline.scoring.logprobs import ReferenceScorer, score_shard
from kto_pipeline.scoring.packing import Tree
from kto_pipeline.sharding import (
    Engine,
    agree_on_forwards,
    autocast_forward,
    check_process_group,
    engine_from_env,
    process_state,
    release_deepspeed,
    shard_model,
)


@dataclass
class PreparedRows:
    """The kept rows of the dataset, tokenized and memory-mapped, with their KL partners."""

    rows: TokenizedRows  # numpy indices into the memory-mapped tokenized table
    partners: np.ndarray  # (n,) each kept row's KL partner, as a position among the kept rows
    source_rows: int
    data_hash: str
    tokenizer_hash: str
    cached: bool  # the tokenized rows were read from the datasets cache
    tokenize_seconds: float  # the datasets.map part of `seconds`
    seconds: float  # load, check, tokenize and select


@dataclass
class Pass:
    """Everything the phases of one precompute share."""

    config: PrecomputeConfig
    out: Path
    state: Any  # accelerate's PartialState: one process, or one per device under accelerate launch / torchrun
    engine: Engine  # the reference replicated on every process, or sharded over them (FSDP2)
    started: float
    tokenizer: Any
    prepared: PreparedRows | None = None
    model: Any = None
    model_hash: str | None = None  # of the weights as loaded (main process)
    scorer: Any = None  # the scoring forward: a ReferenceScorer (the FSDP2 root when sharded), or ZeRO-3's engine
    dtype: Any = None  # of the reference's weights
    regime: Regime | None = None  # weights dtype and autocast
    padded_because: str | None = None  # why every sequence runs on its own, padded; None: packed
    manifest: Manifest | None = None
    progress: ShardProgress | None = None


def precompute(config: PrecomputeConfig) -> Path:
    """Score every row and its KL partner with the reference model and write the cache at `config.output`.

    An advisory lock on `config.output` is held from the first check to the last write: a second precompute
    into the same directory is refused while this one lives."""
    process_state(config.ddp_timeout)  # the process group first: the lock's broadcast runs in it
    with main_process_lock(config.output, "precompute", label="--output"):
        run = setup(config)
        run.prepared = prepare_rows(config, run.tokenizer, run.state)
        load_reference(run)
        if plan_output(run):
            score_shards(run)
            finish(run)
        return run.out


def setup(config: PrecomputeConfig) -> Pass:
    started = time.perf_counter()
    out = Path(config.output)
    _check_output(out)
    # One process, or one per device under `accelerate launch` / torchrun (without a GPU: CPU + gloo).
    state = process_state(config.ddp_timeout)
    check_process_group(state)
    engine = engine_from_env(state.num_processes)
    print0(state, f"kto-pipeline precompute {__version__}\n{config.describe()}")
    tokenizer = load_tokenizer(config.model, config.revision, config.trust_remote_code)
    return Pass(config, out, state, engine, started, tokenizer)


# ------------------------------------------------------------------------------------------- rows


def prepare_rows(config: PrecomputeConfig, tokenizer, state=None) -> PreparedRows:
    """Load, check, tokenize and select the rows, and draw their KL partners, before any model loads.

    The main process checks and tokenizes (datasets.map, --num-proc workers) into the datasets cache; the others
    read its files. `state`: accelerate's PartialState (None: this process alone)."""
    started = time.perf_counter()
    if state is None:
        prepared = _preprocess(config, tokenizer)
    else:
        prepared = decided_by_main_process(state, lambda: _preprocess(config, tokenizer))
    rows = select_rows(_open_tokenized(prepared["files"]), config.max_length)
    seconds = time.perf_counter() - started
    if len(rows) == 0:
        reasons = ", ".join(f"{c} {r}" for r, c in rows.dropped.items())
        raise KTOPipelineError(f"every row was dropped ({reasons}). Raise --max-length or check the data.")
    if state is None or state.is_main_process:
        cached = " (read from the datasets cache)" if prepared["cached"] else ""
        print(f"tokenized {prepared['source_rows']} rows in {seconds:.1f} s{cached}: {len(rows)} kept", flush=True)
    return PreparedRows(
        rows=rows,
        partners=assign_kl_partners(len(rows), config.seed),  # positions into the kept rows
        source_rows=prepared["source_rows"],
        data_hash=prepared["data_hash"],
        tokenizer_hash=prepared["tokenizer_hash"],
        cached=prepared["cached"],
        tokenize_seconds=prepared["tokenize_seconds"],
        seconds=seconds,
    )


def _preprocess(config: PrecomputeConfig, tokenizer) -> dict[str, Any]:
    """Load, check and tokenize the data (main process); returns what every process needs to read the result."""
    source = load_source(config.dataset, config.split, config.dataset_config)
    layout = check_source(source)  # seconds, even for millions of rows: columns, types, nulls, labels
    data_hash = content_hash(config.dataset, source)
    key = json.dumps([data_hash, config.split, config.dataset_config])
    tokenizer_fingerprint = tokenizer_hash(tokenizer)
    fingerprint = preprocess_fingerprint(key, tokenizer_fingerprint)
    cached = any(preprocess_cache_dir().glob(f"tokenized-{fingerprint}*.arrow"))
    started = time.perf_counter()
    tokenized = preprocess(source, tokenizer, fingerprint, layout, config.num_proc)
    return {
        "files": [f["filename"] for f in tokenized.cache_files],
        "source_rows": len(source),
        "data_hash": data_hash,
        "tokenizer_hash": tokenizer_fingerprint,
        "cached": cached,
        "tokenize_seconds": time.perf_counter() - started,
    }


def _open_tokenized(files: list[str]) -> pa.Table:
    """The tokenized rows from their Arrow files in the datasets cache, memory-mapped."""
    import datasets

    return pa.concat_tables([datasets.Dataset.from_file(f).data.table for f in files])


# -------------------------------------------------------------------------------------- reference


def load_reference(run: Pass) -> None:
    config = run.config
    run.dtype = resolve_dtype("float32" if config.dtype == "auto" else config.dtype, run.state.device)
    bf16 = default_bf16(run.state.device) if config.bf16 is None else config.bf16
    run.regime = Regime(str(run.dtype).removeprefix("torch."), "bfloat16" if bf16 else None)
    run.model = load_model(config.model, run.dtype, config.revision, config.trust_remote_code)
    run.model.eval().to(run.state.device)
    run.model_hash = model_weights_hash(run.model) if run.state.is_main_process else None  # before any sharding
    # Each prompt runs once for both continuations, where the model's attention takes a packed layout.
    run.padded_because = packing_unsupported(run.model)
    run.scorer = ReferenceScorer(run.model)
    autocast_forward(run.scorer, "bf16" if bf16 else "no", cache=not run.engine.collective_forwards)
    if run.engine.shards:  # each process keeps 1/N of the weights; each layer's are gathered for its forward
        shard_model(run.scorer, run.model, run.engine, run.state.device)
    elif run.engine.collective_forwards:  # the same with DeepSpeed ZeRO-3
        run.scorer = _zero3_inference(run.scorer, run.dtype)
    print0(run.state, f"reference: {run.regime}, {run.engine}")
    if run.padded_because:
        print0(
            run.state,
            f"note: {type(run.model).__name__}: {run.padded_because}; each sequence runs on its own, padded",
        )


def _zero3_inference(scorer: ReferenceScorer, dtype):
    """`scorer` partitioned over the processes by DeepSpeed ZeRO-3 for inference, without an optimizer (what trl and
    transformers do for a frozen model under ZeRO-3). The engine's forward gathers each module's parameters. Weights
    stay in `dtype`; bf16 compute comes from the scorer's autocast, as on one process."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }
    engine, *_ = deepspeed.initialize(model=scorer, config=config)
    engine.eval()  # (returns None)
    return engine


# ------------------------------------------------------------------------------------------ output


def plan_output(run: Pass) -> bool:
    """Decide (main process) what to do with what --output holds, and write the new cache's manifest. False when
    the cache is already complete: nothing to do."""
    config, prepared, state = run.config, run.prepared, run.state
    # Local paths are recorded absolute, so `train` finds the model from any working directory.
    fingerprint = {
        "model": _absolute_if_local(config.model),
        "model_revision": config.revision,
        "model_hash": run.model_hash,
        "tokenizer_hash": prepared.tokenizer_hash,
        "dataset": _absolute_if_local(config.dataset),
        "dataset_config": config.dataset_config,
        "split": config.split,
        "dataset_hash": prepared.data_hash,
        "max_length": config.max_length,
        "dtype": run.regime.weights,
        "autocast": run.regime.autocast,
        "kl_seed": config.seed,
        "shard_size": config.shard_size,
    }
    plan = decided_by_main_process(state, lambda: _decide_output(run.out, fingerprint, config.overwrite))
    if plan["nothing_to_do"]:
        return False
    rows = prepared.rows
    run.manifest = new_manifest(
        fingerprint,
        tool_version=__version__,
        architecture=type(run.model).__name__,
        eos_token=run.tokenizer.eos_token,
        pad_token_id=run.tokenizer.pad_token_id,
        source_rows=prepared.source_rows,
        normalized_rows=rows.table.num_rows,
        desirable=int(rows.labels.sum()),
        rows=len(rows),
        dropped=dict(rows.dropped),
        padded_because=run.padded_because,
        distributed=run.engine.record(),
        shards=plan["done_shards"],
    )
    if state.is_main_process:
        run.out.mkdir(parents=True, exist_ok=True)
        write_manifest(run.out, run.manifest)
    state.wait_for_everyone()
    return True


def _check_output(out: Path) -> None:
    # (a file at --output is refused by the lock, taken before this check)
    if out.is_dir() and holds_files(out) and not (out / MANIFEST).exists():
        raise KTOPipelineError(
            f"--output {out} already holds files that are not a kto-pipeline cache. Choose an empty or new directory."
        )


def _absolute_if_local(name: str) -> str:
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def _decide_output(out: Path, fingerprint: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    """Compare what --output holds with this run: nothing to do, resume after intact shards, or start over."""
    done_shards: list[dict[str, Any]] = []
    if (out / MANIFEST).exists():
        try:
            old = read_manifest(out)
        except KTOPipelineError:
            if not overwrite:
                raise
            old = Manifest()  # unreadable or of another format version: --overwrite replaces it
        diff = fingerprint_diff(old.fingerprint, fingerprint)
        if not diff and old.complete:
            print(f"{out} already holds a complete cache of this model, tokenizer, data and settings: nothing to do.")
            return {"nothing_to_do": True}
        if diff and not overwrite:
            raise KTOPipelineError(
                f"--output {out} holds a cache made with other inputs or settings:\n  - "
                + "\n  - ".join(diff)
                + "\nPass --overwrite to replace it, or choose another --output."
            )
        if diff:
            shutil.rmtree(out / SHARD_DIR, ignore_errors=True)
            (out / MANIFEST).unlink()
        else:
            done_shards = _finished_shards(out, old.shards)
            print(f"resuming: {len(done_shards)} finished shards found in {out}")
    # Half-written shards of a killed run, and shards past the intact ones, are not part of the cache.
    keep = {s["file"] for s in done_shards}
    for leftover in out.glob(f"{SHARD_DIR}/*"):
        if f"{SHARD_DIR}/{leftover.name}" not in keep:
            leftover.unlink()
    return {"nothing_to_do": False, "done_shards": done_shards}


def _finished_shards(out: Path, shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading shards of an interrupted run that are intact (present, same sha256): resume after them."""
    good = []
    for shard in shards:
        path = out / shard["file"]
        if not path.exists() or sha256_file(path) != shard["sha256"]:
            print(f"{shard['file']} is missing or altered: it and the shards after it are computed again")
            break
        good.append(shard)
    return good


# ------------------------------------------------------------------------------------------ scoring


def score_shards(run: Pass) -> None:
    """Score the shards not yet written, in rounds: in round r, process k scores shard r * N + k. After each round
    the main process records the finished shards, so the manifest always lists a complete prefix of them and the
    shard layout (which rows go where) does not depend on the number of processes."""

    config, state, manifest = run.config, run.state, run.manifest
    n = len(run.prepared.rows)
    pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    num_shards = (n + config.shard_size - 1) // config.shard_size
    run.progress = progress = ShardProgress(n, sum(s["rows"] for s in manifest.shards), state)
    try:
        for first in range(len(manifest.shards), num_shards, state.num_processes):
            shard_index = first + state.process_index
            entry, stats = None, dict.fromkeys(("rows", "scored", "executed", "needed"), 0)
            progress.executed_here = 0
            if shard_index < num_shards:
                positions = np.arange(shard_index * config.shard_size, min(n, (shard_index + 1) * config.shard_size))
                shard = _score_rows(run, positions, pad_id)
                entry = write_shard(run.out, shard_index, shard)
                needed = _needed_tokens(shard)
                scored = needed + sum(len(p) for p in shard["prompt_ids"])  # as separate sequences: prompts twice
                stats = {"rows": len(positions), "scored": scored, "executed": progress.executed_here, "needed": needed}
            elif run.engine.collective_forwards:  # no shard left for this process: it still runs the others' forwards
                _score_trees(run, [], pad_id)
            entries = gather_object([(entry, stats)]) if state.num_processes > 1 else [(entry, stats)]
            if state.is_main_process:
                manifest.add_shards([e for e, _ in entries if e is not None])
                write_manifest(run.out, manifest)
            progress.end_round([s for _, s in entries])
    except KeyboardInterrupt:
        progress.bar.close()
        raise KTOPipelineError(
            f"interrupted: {len(manifest.shards)}/{num_shards} shards are safely written in {run.out}. "
            "Run the same command again to resume from there."
        ) from None
    progress.bar.close()


class ShardProgress:
    """The reference pass's progress bar and counters. Between rounds the bar moves per forward pass: this
    process's batches, times the process count (an estimate; each round's end sets the exact count)."""

    def __init__(self, total_rows: int, done_rows: int, state):
        self.started = time.perf_counter()
        self.bar = tqdm(
            total=total_rows, initial=done_rows, unit="row", desc="reference pass", disable=not state.is_main_process
        )
        self.total_rows, self.done_rows, self.processes = total_rows, done_rows, state.num_processes
        self.estimate_rows = self.estimate_tokens = 0.0
        self.executed_here = 0  # tokens this process ran in this round (padding included)
        # of this run, all processes: rows and tokens scored (prompts counted per sequence), executed and needed
        self.rows_scored = self.tokens_scored = self.tokens_executed = self.tokens_needed = 0

    def on_batch(self, sequences: int, tokens: int, executed: int) -> None:
        """After each forward pass: sequences (two a row), the tokens they need, the tokens the pass ran."""
        self.executed_here += executed
        self.estimate_rows += sequences / 2 * self.processes
        self.estimate_tokens += tokens * self.processes
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.n = int(min(self.done_rows + self.estimate_rows, self.total_rows))
        rows, tokens = self.rows_scored + self.estimate_rows, self.estimate_tokens
        self.bar.set_postfix_str(f"{rows / elapsed:.1f} rows/s, {tokens / elapsed:.0f} tokens/s")

    def end_round(self, stats: list[dict[str, int]]) -> None:
        """After each round, with every process's shard stats (rows, scored, executed, needed)."""
        self.rows_scored += sum(s["rows"] for s in stats)
        self.tokens_scored += sum(s["scored"] for s in stats)
        self.tokens_executed += sum(s["executed"] for s in stats)
        self.tokens_needed += sum(s["needed"] for s in stats)
        self.done_rows += sum(s["rows"] for s in stats)
        self.estimate_rows, self.estimate_tokens = 0.0, float(self.tokens_scored)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.n = self.done_rows
        rows, tokens = self.rows_scored, self.tokens_scored
        self.bar.set_postfix_str(f"{rows / elapsed:.1f} rows/s, {tokens / elapsed:.0f} tokens/s")


def _score_rows(run: Pass, positions: np.ndarray, pad_id: int) -> dict:
    """Build, score and assemble the Arrow columns of the kept rows at `positions`."""
    config, tok, partner_pos = run.config, run.prepared.rows, run.prepared.partners
    prompts, completions = tok.take(positions, "prompt_ids"), tok.take(positions, "completion_ids")
    kl_completions = tok.take(partner_pos[positions], "completion_ids")
    trees: list[Tree] = []
    for prompt, completion, kl_completion in zip(prompts, completions, kl_completions, strict=True):
        room = config.max_length - len(prompt)
        trees.append((prompt, [completion[:room], kl_completion[:room]]))
    scores = _score_trees(run, trees, pad_id)
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for row, pos in enumerate(positions):
        main, kl = scores[row]
        example_id = int(tok.example_ids[pos])
        for what, values in (("completion", main), ("KL completion", kl)):
            if not np.isfinite(values).all():
                raise KTOPipelineError(
                    f"example {example_id}: the reference model gave a non-finite log-prob for its {what} "
                    f"(values {values[~np.isfinite(values)][:3]}). The model or its dtype is broken "
                    "(try --dtype float32); nothing of this row was written."
                )
        cols["example_id"].append(example_id)
        cols["label"].append(bool(tok.labels[pos]))
        cols["prompt_ids"].append(trees[row][0])
        cols["completion_ids"].append(trees[row][1][0])
        cols["kl_example_id"].append(int(tok.example_ids[partner_pos[pos]]))
        cols["kl_completion_ids"].append(trees[row][1][1])
        cols["ref_logp"].append(token_sum(main))
        cols["ref_kl_logp"].append(token_sum(kl))
        cols["ref_token_logps"].append(main)
        cols["ref_kl_token_logps"].append(kl)
    return cols


def _score_trees(run: Pass, trees: list[Tree], pad_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """score_shard with this pass's settings. Sharded, every process runs as many forwards as the busiest."""
    device = run.state.device
    return score_shard(
        run.scorer,
        trees,
        pad_id,
        run.config.batch_size,
        run.config.max_tokens_per_batch,
        device,
        run.progress.on_batch,
        packed=run.padded_because is None,
        agree_on_forwards=(lambda count: agree_on_forwards(count, device)) if run.engine.collective_forwards else None,
    )


def _needed_tokens(shard: dict) -> int:
    """The minimal work for a shard: each prompt once, then its completion and its KL completion, no padding."""
    return sum(len(c) for key in ("prompt_ids", "completion_ids", "kl_completion_ids") for c in shard[key])


# ------------------------------------------------------------------------------------------- finish


def finish(run: Pass) -> None:
    """Mark the cache complete, with the timing of this run, and print its summary."""
    config, prepared, progress, manifest = run.config, run.prepared, run.progress, run.manifest
    if run.state.is_main_process:
        manifest.mark_complete(
            {
                "preprocess_seconds": round(prepared.seconds, 3),
                "preprocess_cached": prepared.cached,
                "preprocess_rows_per_second": round(prepared.source_rows / max(prepared.seconds, 1e-9), 1),
                "tokenize_seconds": round(prepared.tokenize_seconds, 3),
                "num_proc": config.num_proc,
                "reference_pass_seconds": round(time.perf_counter() - progress.started, 3),
                "rows_scored": progress.rows_scored,
                "tokens_scored": progress.tokens_scored,
                "tokens_executed": progress.tokens_executed,
                "tokens_needed": progress.tokens_needed,
                "token_efficiency": round(progress.tokens_needed / max(progress.tokens_executed, 1), 4),
                "wall_seconds": round(time.perf_counter() - run.started, 3),
                "processes": run.state.num_processes,
            }
        )
        write_manifest(run.out, manifest)
        _print_summary(manifest, run.out, time.perf_counter() - run.started)
    if run.engine.deepspeed:
        release_deepspeed(run.scorer)
    run.state.wait_for_everyone()


def _print_summary(manifest: Manifest, out: Path, seconds: float) -> None:
    counts, timing = manifest.counts, manifest.timing
    dropped = counts["dropped"]
    dropped_text = ", ".join(f"{c} ({r})" for r, c in dropped.items()) if dropped else "none"
    cached = " (read from the datasets cache)" if timing["preprocess_cached"] else ""
    print(
        "\nprecompute finished\n"
        f"  rows         {counts['rows']} ({counts['desirable']} desirable, {counts['undesirable']} undesirable)\n"
        f"  dropped      {sum(dropped.values())}: {dropped_text}\n"
        f"  tokens       {timing['tokens_scored']} scored (completions + KL completions, with their prompts)\n"
        f"  efficiency   {timing['token_efficiency']:.1%}: {timing['tokens_needed']} tokens needed (each prompt once, "
        f"no padding) / {timing['tokens_executed']} executed\n"
        f"  tokenizing   {manifest.dataset['source_rows']} source rows in {timing['preprocess_seconds']:.1f} s: "
        f"{timing['preprocess_rows_per_second']:.0f} rows/s (load, check, tokenize; datasets.map "
        f"{timing['tokenize_seconds']:.1f} s with --num-proc {timing['num_proc']}){cached}\n"
        f"  reference    {timing['rows_scored']} rows in {timing['reference_pass_seconds']:.1f} s: "
        f"{timing['rows_scored'] / max(timing['reference_pass_seconds'], 1e-9):.1f} rows/s, "
        f"{timing['tokens_scored'] / max(timing['reference_pass_seconds'], 1e-9):.0f} tokens/s\n"
        f"  wall time    {seconds:.1f} s\n"
        f"  shards       {len(manifest.shards)}\n"
        f"  cache        {out.resolve()}",
        flush=True,
    )
