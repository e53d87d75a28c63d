"""Stage 1: run the frozen reference model once over a dataset and write the cache.

Read `precompute()` top to bottom: load -> normalize -> tokenize -> pair -> score shard by shard ->
write. Rows are scored a shard at a time so that a crash loses at most one shard of work. Within a
shard each row is one tree, its prompt followed by its completion and its KL completion, which both
attend to the prompt (`packing.py`): the prompt runs once. Trees are packed side by side into rows
of token-budgeted forward passes, so almost no compute goes to padding. Models whose attention takes
no packed layout run every sequence on its own, length-sorted and padded; the manifest records which.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from kto_pipeline import __version__
from kto_pipeline.cache import (
    FORMAT_VERSION,
    MANIFEST,
    SCHEMA,
    SHARD_DIR,
    model_weights_hash,
    read_manifest,
    sha256_file,
    tokenizer_hash,
    write_manifest,
    write_shard,
)
from kto_pipeline.config import PrecomputeConfig
from kto_pipeline.data import (
    assign_kl_partners,
    check_source,
    content_hash,
    load_source,
    preprocess,
    preprocess_cache_dir,
    preprocess_fingerprint,
    select_rows,
)
from kto_pipeline.errors import KTOPipelineError, decided_by_main_process
from kto_pipeline.lock import holds_files, main_process_lock
from kto_pipeline.logprobs import pad_sequences, score_layout, score_sequences
from kto_pipeline.models import load_model, load_tokenizer, resolve_dtype
from kto_pipeline.packing import AttentionCosts, attention_costs, layout_trees, pack_rows, packing_unsupported

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- batching


@dataclass
class Sequence:
    row: int  # tree (row) in the shard
    kind: int  # 0: completion, 1: KL completion
    prompt_len: int
    ids: list[int]  # prompt + (KL) completion, already truncated


def pack_batches(seqs: list[Sequence], batch_size: int, max_tokens: int) -> list[list[Sequence]]:
    """Longest first, then fill each batch while rows <= batch_size and padded tokens <= max_tokens."""
    batches: list[list[Sequence]] = []
    current: list[Sequence] = []
    for seq in sorted(seqs, key=lambda s: len(s.ids), reverse=True):
        width = len(current[0].ids) if current else len(seq.ids)
        if current and (len(current) >= batch_size or width * (len(current) + 1) > max_tokens):
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    return batches


def pack_trees(
    sizes: list[int], batch_size: int, max_tokens: int, costs: AttentionCosts | None = None
) -> list[list[list[int]]]:
    """Group trees (prompt + completion + KL completion, `sizes[i]` tokens) into forward passes of rows.

    Rows by `packing.pack_rows` (several trees a row; `costs`: what attention costs); then rows
    into passes while rows x width <= max_tokens and trees <= batch_size / 2 (batch_size counts sequences,
    two per tree; a tree always fits alone). Returns passes -> rows -> trees."""
    passes: list[list[list[int]]] = []
    current: list[list[int]] = []
    width = trees = 0
    for row in pack_rows(sizes, max(batch_size // 2, 1), costs):
        row_width = sum(sizes[i] for i in row)
        new_width = max(width, row_width)
        if current and (new_width * (len(current) + 1) > max_tokens or 2 * (trees + len(row)) > max(batch_size, 2)):
            passes.append(current)
            current, width, trees = [], 0, 0
            new_width = row_width
        current.append(row)
        width, trees = new_width, trees + len(row)
    if current:
        passes.append(current)
    return passes


Tree = tuple[list[int], list[list[int]]]  # (prompt, [completion, KL completion]), already truncated


@torch.inference_mode()
def score_shard(
    model, trees: list[Tree], pad_id: int, batch_size: int, max_tokens: int, device, on_batch=None, shared=True
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-token reference log-probs of each tree's completion and KL completion.

    `shared=True`: each prompt runs once, its completion and KL completion both attending to it
    (`packing.layout_trees`), several trees side by side in each tensor row. `shared=False`: every sequence
    on its own, padded (the path for models that cannot take a packed layout).

    `on_batch(sequences, tokens, executed)`, if given, is called after each forward pass with the number of
    sequences, the tokens they need, and the tokens the pass ran (padding included): progress and counters."""
    out: list[list[np.ndarray]] = [[np.empty(0, np.float32)] * 2 for _ in trees]
    if shared:
        sizes = [len(p) + sum(map(len, conts)) for p, conts in trees]
        for rows in pack_trees(sizes, batch_size, max_tokens, attention_costs(model, device)):
            members = [t for row in rows for t in row]
            local = {t: i for i, t in enumerate(members)}
            layout = layout_trees([trees[t] for t in members], [[local[t] for t in row] for row in rows], pad_id)
            per_sequence = score_layout(model, layout.to(device), with_stats=False).per_sequence()
            for i, t in enumerate(members):
                out[t] = [v.float().cpu().numpy() for v in per_sequence[2 * i : 2 * i + 2]]
            if on_batch is not None:
                on_batch(2 * len(members), sum(sizes[t] for t in members), layout.input_ids.numel())
        return [tuple(o) for o in out]
    seqs = [
        Sequence(t, kind, len(prompt), prompt + continuation)
        for t, (prompt, continuations) in enumerate(trees)
        for kind, continuation in enumerate(continuations)
    ]
    for batch in pack_batches(seqs, batch_size, max_tokens):
        ids, attn, comp = (
            t.to(device) for t in pad_sequences([s.ids for s in batch], [s.prompt_len for s in batch], pad_id)
        )
        per_sequence = score_sequences(model, ids, attn, comp, with_stats=False).per_sequence()
        for s, values in zip(batch, per_sequence, strict=True):
            out[s.row][s.kind] = values.float().cpu().numpy()
        if on_batch is not None:
            on_batch(len(batch), sum(len(s.ids) for s in batch), ids.numel())
    return [tuple(o) for o in out]


# ------------------------------------------------------------------------------------------ stage 1


def _check_output(out: Path) -> None:
    # (a file at --output is refused by the lock, taken before this check)
    if out.is_dir() and holds_files(out) and not (out / MANIFEST).exists():
        raise KTOPipelineError(
            f"--output {out} already holds files that are not a kto-pipeline cache. Choose an empty or new directory."
        )


def _fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{k}: cache has {old.get(k)!r}, this run has {v!r}" for k, v in new.items() if old.get(k) != v]


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


def precompute(config: PrecomputeConfig) -> Path:
    """Score every row and its KL partner with the reference model and write the cache at `config.output`.

    An advisory lock on `config.output` is held from the first check to the last write: a second precompute
    into the same directory is refused while this one lives."""
    with main_process_lock(config.output, "precompute", label="--output"):
        return _precompute(config)


def _precompute(config: PrecomputeConfig) -> Path:
    from accelerate import PartialState
    from accelerate.utils import gather_object, parse_flag_from_env
    from tqdm.auto import tqdm

    started = time.perf_counter()
    out = Path(config.output)
    # Local paths are recorded absolute, so `train` finds the model from any working directory.
    model_id, dataset_id = _absolute_if_local(config.model), _absolute_if_local(config.dataset)
    _check_output(out)
    # One process, or one per device under `accelerate launch` / torchrun (ACCELERATE_USE_CPU=1: CPU + gloo).
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    device = state.device

    if state.is_main_process:
        print(f"kto-pipeline precompute {__version__}\n{config.describe()}", flush=True)
    tokenizer = load_tokenizer(config.model, config.revision, config.trust_remote_code)

    # The data before the model, so that a bad row is reported before minutes of model loading. The main process
    # checks and tokenizes (datasets.map, --num-proc workers) into the datasets cache; the others read its files.
    preprocess_started = time.perf_counter()
    prepared = decided_by_main_process(state, lambda: _preprocess(config, tokenizer))
    tokenized = _open_tokenized(prepared["files"])
    tok = select_rows(tokenized, config.max_length)  # numpy indices into the memory-mapped table
    preprocess_seconds = time.perf_counter() - preprocess_started
    n = len(tok)
    if n == 0:
        reasons = ", ".join(f"{c} {r}" for r, c in tok.dropped.items())
        raise KTOPipelineError(f"every row was dropped ({reasons}). Raise --max-length or check the data.")
    partner_pos = assign_kl_partners(n, config.seed)  # positions into the kept rows
    if state.is_main_process:
        cached = " (read from the datasets cache)" if prepared["cached"] else ""
        print(
            f"tokenized {prepared['source_rows']} rows in {preprocess_seconds:.1f} s{cached}: {n} kept",
            flush=True,
        )

    dtype = resolve_dtype(config.dtype, device)
    model = load_model(config.model, dtype, config.revision, config.trust_remote_code)
    model.eval().to(device)
    # Each prompt runs once for both continuations, where the model's attention takes a packed layout.
    unshared_because = packing_unsupported(model)
    if unshared_because and state.is_main_process:
        print(f"note: {type(model).__name__}: {unshared_because}; each sequence runs on its own, padded", flush=True)

    fingerprint = {
        "model": model_id,
        "model_revision": config.revision,
        "model_hash": model_weights_hash(model) if state.is_main_process else None,
        "tokenizer_hash": prepared["tokenizer_hash"],
        "dataset": dataset_id,
        "dataset_config": config.dataset_config,
        "split": config.split,
        "dataset_hash": prepared["data_hash"],
        "max_length": config.max_length,
        "dtype": str(dtype).removeprefix("torch."),
        "kl_seed": config.seed,
        "shard_size": config.shard_size,
    }
    # The main process decides what to do with what is already in --output; the others follow.
    plan = decided_by_main_process(state, lambda: _plan_output(out, fingerprint, config.overwrite))
    if plan["nothing_to_do"]:
        return out
    done_shards = plan["done_shards"]

    labels = tok.labels
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "tool": {"name": "kto-pipeline", "version": __version__},
        "complete": False,
        "reference_model": {
            "name_or_path": model_id,
            "revision": config.revision,
            "weights_hash": fingerprint["model_hash"],
            "architecture": type(model).__name__,
        },
        "tokenizer": {
            "name_or_path": model_id,
            "hash": fingerprint["tokenizer_hash"],
            "eos_token": tokenizer.eos_token,
            "pad_token_id": tokenizer.pad_token_id,
        },
        "dataset": {
            "name_or_path": dataset_id,
            "config": config.dataset_config,
            "split": config.split,
            "content_hash": fingerprint["dataset_hash"],
            "source_rows": prepared["source_rows"],
            "normalized_rows": tokenized.num_rows,
        },
        "settings": {"max_length": config.max_length, "dtype": fingerprint["dtype"], "kl_seed": config.seed},
        "counts": {
            "rows": n,
            "desirable": int(labels.sum()),
            "undesirable": int(n - labels.sum()),
            "dropped": dict(tok.dropped),
        },
        "fingerprint": fingerprint,
        "reference_pass": {
            "prefix_shared": unshared_because is None,
            **({"unshared_because": unshared_because} if unshared_because else {}),
        },
        "shards": done_shards,
    }
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out, manifest)
    state.wait_for_everyone()

    # Shards are handed out in rounds: in round r, process k scores shard r * N + k. After each round the
    # main process records the finished shards, so the manifest always lists a complete prefix of them
    # and the shard layout (which rows go where) does not depend on the number of processes.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    num_shards = (n + config.shard_size - 1) // config.shard_size
    tokens_scored = rows_scored = 0
    t0 = time.perf_counter()
    bar = tqdm(
        total=n,
        initial=sum(s["rows"] for s in done_shards),
        unit="row",
        desc="reference pass",
        disable=not state.is_main_process,
    )

    def on_batch(sequences: int, tokens: int, executed: int) -> None:
        # Between rounds the bar moves per forward pass: this process's batches, times the process count (an
        # estimate; each round's end sets the exact count). Two sequences (completion, KL completion) per row.
        nonlocal estimate_rows, estimate_tokens, executed_here
        executed_here += executed
        estimate_rows += sequences / 2 * state.num_processes
        estimate_tokens += tokens * state.num_processes
        elapsed = max(time.perf_counter() - t0, 1e-9)
        bar.n = int(min(done_rows + estimate_rows, n))
        bar.set_postfix_str(
            f"{(rows_scored + estimate_rows) / elapsed:.1f} rows/s, {estimate_tokens / elapsed:.0f} tokens/s"
        )

    done_rows = sum(s["rows"] for s in done_shards)
    estimate_rows = estimate_tokens = 0.0
    executed_here = 0  # tokens this process ran in this round (padding included)
    tokens_executed = tokens_needed = 0
    try:
        for first in range(len(done_shards), num_shards, state.num_processes):
            shard_index = first + state.process_index
            entry, executed_here = None, 0
            stats = dict.fromkeys(("rows", "scored", "executed", "needed"), 0)
            if shard_index < num_shards:
                positions = np.arange(shard_index * config.shard_size, min(n, (shard_index + 1) * config.shard_size))
                shard = _score_rows(
                    model, tok, partner_pos, positions, config, pad_id, device, on_batch, unshared_because is None
                )
                entry = write_shard(out, shard_index, shard)
                needed = _needed_tokens(shard)
                scored = needed + sum(len(p) for p in shard["prompt_ids"])  # as separate sequences: prompts twice
                stats = {"rows": len(positions), "scored": scored, "executed": executed_here, "needed": needed}
            entries = gather_object([(entry, stats)]) if state.num_processes > 1 else [(entry, stats)]
            finished = sorted((e for e, _ in entries if e is not None), key=lambda e: e["file"])
            rows_scored += sum(stat["rows"] for _, stat in entries)
            tokens_scored += sum(stat["scored"] for _, stat in entries)
            tokens_executed += sum(stat["executed"] for _, stat in entries)
            tokens_needed += sum(stat["needed"] for _, stat in entries)
            if state.is_main_process:
                manifest["shards"].extend(finished)
                write_manifest(out, manifest)
            elapsed = max(time.perf_counter() - t0, 1e-9)
            done_rows += sum(stat["rows"] for _, stat in entries)
            estimate_rows, estimate_tokens = 0.0, float(tokens_scored)
            bar.n = done_rows
            bar.set_postfix_str(f"{rows_scored / elapsed:.1f} rows/s, {tokens_scored / elapsed:.0f} tokens/s")
    except KeyboardInterrupt:
        bar.close()
        raise KTOPipelineError(
            f"interrupted: {len(manifest['shards'])}/{num_shards} shards are safely written in {out}. "
            "Run the same command again to resume from there."
        ) from None
    bar.close()

    if state.is_main_process:
        manifest["complete"] = True
        manifest["timing"] = {
            "preprocess_seconds": round(preprocess_seconds, 3),
            "preprocess_cached": prepared["cached"],
            "preprocess_rows_per_second": round(prepared["source_rows"] / max(preprocess_seconds, 1e-9), 1),
            "tokenize_seconds": round(prepared["tokenize_seconds"], 3),
            "num_proc": config.num_proc,
            "reference_pass_seconds": round(time.perf_counter() - t0, 3),
            "rows_scored": rows_scored,
            "tokens_scored": tokens_scored,
            "tokens_executed": tokens_executed,
            "tokens_needed": tokens_needed,
            "token_efficiency": round(tokens_needed / max(tokens_executed, 1), 4),
            "wall_seconds": round(time.perf_counter() - started, 3),
            "processes": state.num_processes,
        }
        write_manifest(out, manifest)
        _print_summary(manifest, out, time.perf_counter() - started)
    state.wait_for_everyone()
    return out


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


def _absolute_if_local(name: str) -> str:
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def _needed_tokens(shard: dict) -> int:
    """The minimal work for a shard: each prompt once, then its completion and its KL completion, no padding."""
    return sum(len(c) for key in ("prompt_ids", "completion_ids", "kl_completion_ids") for c in shard[key])


def _plan_output(out: Path, fingerprint: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    """Compare what --output holds with this run: nothing to do, resume after intact shards, or start over."""
    done_shards: list[dict[str, Any]] = []
    if (out / MANIFEST).exists():
        try:
            old = read_manifest(out)
        except KTOPipelineError:
            if not overwrite:
                raise
            old = {}  # unreadable or of another format version: --overwrite replaces it
        diff = _fingerprint_diff(old.get("fingerprint", {}), fingerprint)
        if not diff and old.get("complete"):
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
            done_shards = _finished_shards(out, old["shards"])
            print(f"resuming: {len(done_shards)} finished shards found in {out}")
    # Half-written shards of a killed run, and shards past the intact ones, are not part of the cache.
    keep = {s["file"] for s in done_shards}
    for leftover in out.glob(f"{SHARD_DIR}/*"):
        if f"{SHARD_DIR}/{leftover.name}" not in keep:
            leftover.unlink()
    return {"nothing_to_do": False, "done_shards": done_shards}


def _score_rows(
    model, tok, partner_pos, positions, config: PrecomputeConfig, pad_id: int, device, on_batch=None, shared=True
) -> dict:
    """Build, score and assemble the Arrow columns of the kept rows at `positions`."""
    prompts, completions = tok.take(positions, "prompt_ids"), tok.take(positions, "completion_ids")
    kl_completions = tok.take(partner_pos[positions], "completion_ids")
    trees: list[Tree] = []
    for prompt, completion, kl_completion in zip(prompts, completions, kl_completions, strict=True):
        room = config.max_length - len(prompt)
        trees.append((prompt, [completion[:room], kl_completion[:room]]))
    scores = score_shard(model, trees, pad_id, config.batch_size, config.max_tokens_per_batch, device, on_batch, shared)
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
        cols["ref_logp"].append(float(main.sum(dtype=np.float32)))
        cols["ref_kl_logp"].append(float(kl.sum(dtype=np.float32)))
        cols["ref_token_logps"].append(main)
        cols["ref_kl_token_logps"].append(kl)
    return cols


def _print_summary(manifest: dict[str, Any], out: Path, seconds: float) -> None:
    counts, timing = manifest["counts"], manifest["timing"]
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
        f"  tokenizing   {manifest['dataset']['source_rows']} source rows in {timing['preprocess_seconds']:.1f} s: "
        f"{timing['preprocess_rows_per_second']:.0f} rows/s (load, check, tokenize; datasets.map "
        f"{timing['tokenize_seconds']:.1f} s with --num-proc {timing['num_proc']}){cached}\n"
        f"  reference    {timing['rows_scored']} rows in {timing['reference_pass_seconds']:.1f} s: "
        f"{timing['rows_scored'] / max(timing['reference_pass_seconds'], 1e-9):.1f} rows/s, "
        f"{timing['tokens_scored'] / max(timing['reference_pass_seconds'], 1e-9):.0f} tokens/s\n"
        f"  wall time    {seconds:.1f} s\n"
        f"  shards       {len(manifest['shards'])}\n"
        f"  cache        {out.resolve()}",
        flush=True,
    )
