"""Stage 1: run the frozen reference model once over a dataset and write the cache.

`precompute()` is the outline, one phase a function around one `Pass`:

    prepare rows -> load the reference -> plan the output -> score shards -> finish

The data is checked and tokenized before the model loads (`data.py`, datasets.map, cached on disk), so a bad row
is reported in seconds. Rows are scored a shard at a time, so that a crash loses at most one shard of work and a
rerun resumes after the intact ones. Within a shard each row is one tree, its prompt followed by its completion
and its KL completion, which both attend to the prompt (`scoring/packing.py`): the prompt runs once. Trees are
packed side by side into rows of token-budgeted forward passes, so almost no compute goes to padding. Models whose
attention takes no packed layout run every sequence on its own, length-sorted and padded; the manifest records
which (`cache.py` writes the manifest and the shards). How the reference is spread over the processes is asked of
the engine (`runtime/engines`: `prepare_scorer`), which this stage never names; a cache that grows is `segments.py`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from kto_pipeline import __version__
from kto_pipeline.cache import (
    MANIFEST,
    NO_PAIR,
    SCHEMA,
    SHARD_DIR,
    Manifest,
    completion_room,
    read_manifest,
    sha256_file,
    token_sum,
    tokenizer_hash,
    write_manifest,
    write_shard,
)
from kto_pipeline.config import PrecomputeConfig
from kto_pipeline.errors import KTOPipelineError, Preempted
from kto_pipeline.lock import holds_files, main_process_lock
from kto_pipeline.manifest import fingerprint_diff, new_manifest
from kto_pipeline.models import load_model, load_tokenizer
from kto_pipeline.runtime.engines import Engine, engine_for
from kto_pipeline.runtime.launch import main_decides, print0, process_state, shows_progress
from kto_pipeline.runtime.peak_memory import PeakMemory, describe
from kto_pipeline.runtime.precision import Regime, reference_regime
from kto_pipeline.runtime.preemption import StopRequests, continue_command
from kto_pipeline.scoring.attention import packing_unsupported, request_attention_kernel
from kto_pipeline.scoring.logprobs import ReferenceScorer, score_shard
from kto_pipeline.scoring.packing import Tree
from kto_pipeline.stages.precompute.data import (
    TokenizedRows,
    assign_kl_partners,
    check_source,
    content_hash,
    load_source,
    open_arrow_files,
    preprocess,
    preprocess_cache_dir,
    preprocess_fingerprint,
    select_rows,
)
from kto_pipeline.stages.precompute.segments import (
    KEY_DIR,
    content_keys,
    held_keys,
    key_array,
    match_keys,
    new_segment,
    open_keys,
    require_keys,
    write_keys,
)


@dataclass
class PreparedRows:
    """The kept rows of the dataset (of an append: its new rows), tokenized and memory-mapped, with their KL
    partners and their place in the cache."""

    rows: TokenizedRows  # numpy indices into the memory-mapped tokenized table
    example_ids: np.ndarray  # (n,) each kept row's example id in the cache
    partners: np.ndarray  # (n,) each kept row's KL partner, as a position among the kept rows
    pair_ids: np.ndarray  # (n,) the example id of each kept row's pair partner (NO_PAIR: none in these rows)
    segment: dict[str, Any]  # what the cache records of these rows: segments.new_segment's keywords
    key_files: list[str]  # the content keys of every normalized row of the dataset (segments.content_keys)
    key_rows: np.ndarray | None  # which of them these rows are (None: all)
    source_rows: int
    data_hash: str
    tokenizer_hash: str
    cached: bool  # the tokenized rows were read from the datasets cache
    tokenize_seconds: float  # the datasets.map part of `seconds`
    seconds: float  # load, check, key, tokenize and select
    outside_partner: tuple[int, list[int]] | None = None  # a one-row append's KL partner: (example id, completion)


@dataclass
class Pass:
    """Everything the phases of one precompute share."""

    config: PrecomputeConfig
    out: Path
    state: Any  # accelerate's PartialState: one process, or one per device under accelerate launch / torchrun
    engine: Engine  # how the reference is spread over the processes (runtime/engines)
    started: float
    tokenizer: Any
    peaks: PeakMemory  # each process's peak memory, sampled from the start
    prepared: PreparedRows | None = None
    model: Any = None
    model_hash: str | None = None  # of the weights as loaded (main process)
    scorer: Any = None  # the scoring forward: a ReferenceScorer (the FSDP2 root when sharded), or ZeRO-3's engine
    regime: Regime | None = None  # weights dtype and autocast
    padded_because: str | None = None  # why every sequence runs on its own, padded; None: packed
    attention_kernel: str | None = None  # how packed rows attend (`attention.attention_kernel`)
    manifest: Manifest | None = None
    base: Manifest | None = None  # with --append: the cache's manifest as this run found it
    segment: dict[str, Any] | None = None  # the manifest entry of the segment this run writes
    written: list[dict[str, Any]] | None = None  # its finished shards (manifest entries)
    first_shard: int = 0  # its first shard's file number
    progress: ShardProgress | None = None


def precompute(config: PrecomputeConfig) -> Path:
    """Score every row and its KL partner with the reference model and write the cache at `config.output`.

    An advisory lock on `config.output` is held from the first check to the last write: a second precompute
    into the same directory is refused while this one lives."""
    process_state(config.ddp_timeout)  # the process group first: the lock's broadcast runs in it
    with main_process_lock(config.output, "precompute", label="--output"), PeakMemory() as peaks:
        run = setup(config, peaks)
        if config.append:
            run.base = open_base(run)
        run.prepared = prepare_rows(config, run.tokenizer, run.state, run.base)
        if run.prepared is None:
            return run.out  # an append that found no new rows
        load_reference(run)
        if plan_output(run):
            score_shards(run)
            finish(run)
        return run.out


def setup(config: PrecomputeConfig, peaks: PeakMemory) -> Pass:
    started = time.perf_counter()
    out = Path(config.output)
    _check_output(out)
    # One process, or one per device under `accelerate launch` / torchrun (without a GPU: CPU + gloo).
    state = process_state(config.ddp_timeout)
    engine = engine_for(state.num_processes)
    print0(state, f"kto-pipeline precompute {__version__}\n{config.describe()}")
    tokenizer = load_tokenizer(config.model, config.revision, config.trust_remote_code)
    return Pass(config, out, state, engine, started, tokenizer, peaks)


def open_base(run: Pass) -> Manifest:
    """--append: the complete cache at --output, checked against this run before any work: the tokenizer, the
    model's name and revision, max_length, the precision regime and the KL seed must be the cache's (the weights'
    hash is compared once the model is loaded). Anything else is refused, naming each difference."""
    config, out = run.config, run.out

    def check() -> dict[str, Any]:
        if not (out / MANIFEST).exists():
            raise KTOPipelineError(
                f"--append: {out} holds no cache to append to. Run `kto-pipeline precompute` without --append first."
            )
        base = read_manifest(out)
        if not base.complete:
            raise KTOPipelineError(
                f"--append: the cache at {out} is incomplete; finish it first by re-running the precompute that "
                "wrote it (without --append)."
            )
        require_keys(out, base)
        regime = reference_regime(config.dtype, config.bf16, run.state.device)
        diff = fingerprint_diff(
            {k: base.fingerprint.get(k) for k in APPEND_MUST_MATCH},
            {
                "model": _absolute_if_local(config.model),
                "model_revision": config.revision,
                "tokenizer_hash": tokenizer_hash(run.tokenizer),
                "max_length": config.max_length,
                **regime.record(),
                "kl_seed": config.kl_seed,
                "kl_completions": False if config.pairs_only else None,
            },
        )
        if diff:
            raise KTOPipelineError(_append_refused(out, diff))
        return {"manifest": dict(base)}

    return Manifest(main_decides(run.state, check)["manifest"])


# What must be the same for rows appended to a cache to have the values a full precompute would give them:
# the reference (name, revision; its weights' hash is checked after loading), the tokenizer (vocabulary, special
# tokens, chat template), max_length, the precision regime, and the KL seed.
DATASET_FIELDS = ("dataset", "dataset_config", "split", "dataset_hash")
APPEND_MUST_MATCH = (
    "model",
    "model_revision",
    "tokenizer_hash",
    "max_length",
    "dtype",
    "autocast",
    "kl_seed",
    "kl_completions",  # (recorded as False by --pairs-only only: absent, None, means with KL completions)
)


def _append_refused(out: Path, diff: list[str]) -> str:
    return (
        f"--append: the cache at {out} was made with another reference or settings:\n  - "
        + "\n  - ".join(diff)
        + "\nRows appended with these would not have the values the cache's rows have. Use the cache's model and "
        "settings (`kto-pipeline inspect` shows them), or write a new cache. The cache is unchanged."
    )


# ------------------------------------------------------------------------------------------- rows


def prepare_rows(config: PrecomputeConfig, tokenizer, state=None, base: Manifest | None = None) -> PreparedRows | None:
    """Load, check, key, tokenize and select the rows, and draw their KL partners, before any model loads.

    The main process does the work (datasets.map, --num-proc workers, into the datasets cache); the others read its
    files. `state`: accelerate's PartialState (None: this process alone). `base`: with --append, the cache's manifest:
    only the rows it does not hold are tokenized; None when there are none."""
    started = time.perf_counter()
    out = Path(config.output)
    if state is None:
        prepared = _preprocess(config, tokenizer, out, base)
    else:
        prepared = main_decides(state, lambda: _preprocess(config, tokenizer, out, base))
    if prepared.get("nothing_new"):
        if state is None or state.is_main_process:
            print(
                f"{config.dataset}: all {prepared['matched_rows']} of its rows are in the cache already: "
                "nothing to append.",
                flush=True,
            )
        return None
    table = open_arrow_files(prepared["files"])
    among = None if prepared["positions"] is None else np.asarray(prepared["positions"], dtype=np.int64)
    rows = select_rows(table, config.max_length, among)
    seconds = time.perf_counter() - started
    which = "new row" if base is not None else "row"
    if len(rows) == 0:
        reasons = ", ".join(f"{c} {r}" for r, c in rows.dropped.items())
        raise KTOPipelineError(f"every {which} was dropped ({reasons}). Raise --max-length or check the data.")
    first = prepared["first_example_id"]
    # a row's example id: its place among the normalized rows of the cache, kept or dropped
    example_ids = first + (rows.example_ids if among is None else np.searchsorted(among, rows.example_ids))
    if prepared["paired"]:
        pair_ids = pair_partners(rows.example_ids, example_ids, rows.table)
    else:
        pair_ids = np.full(len(rows), NO_PAIR)
    if config.pairs_only:  # only whole pairs: the rows without their partner are dropped
        keep = pair_ids != NO_PAIR
        dropped = rows.dropped + Counter({"no pair partner": int((~keep).sum())} if not keep.all() else {})
        rows = TokenizedRows(rows.table, rows.example_ids[keep], rows.labels[keep], dropped, rows.prefix_mismatches)
        example_ids, pair_ids = example_ids[keep], pair_ids[keep]
        if len(rows) == 0:
            raise KTOPipelineError(f"--pairs-only: no {which} has its pair partner: nothing to score.")
    complete = int((pair_ids != NO_PAIR).sum())
    segment = {
        "source": prepared["source"],
        "first_example_id": first,
        "normalized_rows": table.num_rows if among is None else len(among),
        "rows": len(rows),
        "desirable": int(rows.labels.sum()),
        "dropped": dict(rows.dropped),
        "conversational": prepared["conversational"],
        "matched_rows": prepared["matched_rows"],
        "pairs": {"complete": complete // 2, "rows_without_partner": len(rows) - complete if prepared["paired"] else 0},
    }
    partners, outside = _kl_partners(config, out, base, len(rows), prepared["conversational"])
    if state is None or state.is_main_process:
        cached = " (read from the datasets cache)" if prepared["cached"] else ""
        held = f", {prepared['matched_rows']} already in the cache" if base is not None else ""
        print(
            f"tokenized {segment['normalized_rows']} {which}s of {prepared['source_rows']} in {seconds:.1f} s"
            f"{cached}: {len(rows)} kept{held}",
            flush=True,
        )
    return PreparedRows(
        rows=rows,
        example_ids=example_ids.astype(np.int64),
        partners=partners,
        pair_ids=pair_ids.astype(np.int64),
        segment=segment,
        key_files=prepared["key_files"],
        key_rows=None if prepared["key_rows"] is None else np.asarray(prepared["key_rows"], dtype=np.int64),
        source_rows=prepared["source_rows"],
        data_hash=prepared["data_hash"],
        tokenizer_hash=prepared["tokenizer_hash"],
        cached=prepared["cached"],
        tokenize_seconds=prepared["tokenize_seconds"],
        seconds=seconds,
        outside_partner=outside,
    )


def pair_partners(positions: np.ndarray, example_ids: np.ndarray, table: pa.Table) -> np.ndarray:
    """Each kept row's pair partner, as an example id (NO_PAIR where the partner is not among the kept rows).

    `positions`: the kept rows' places in the tokenized table (ascending), where a paired source row's two rows
    are 2i and 2i+1 (an append tokenizes whole source rows, so this holds there too); `example_ids`: theirs.
    Two rows pair only if their prompts in the tokenized `table` are alike (a tokenizer may merge the prompt's last
    tokens with one answer's first ones and not the other's): a pair is one prompt and two answers.
    """
    partner = positions ^ 1
    at = np.minimum(np.searchsorted(positions, partner), max(len(positions) - 1, 0))
    found = positions[at] == partner if len(positions) else np.zeros(0, dtype=bool)
    if found.any():
        where = np.flatnonzero(found)
        found[where] = same_prompts(table, positions[where], partner[where])
    return np.where(found, example_ids[at], NO_PAIR)


def same_prompts(table: pa.Table, a: np.ndarray, b: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """Whether the tokenized rows at positions a[i] and b[i] have the same prompt_ids, chunk by chunk (token ids
    compared in numpy, never as Python lists)."""
    column, out = table.column("prompt_ids"), np.zeros(len(a), dtype=bool)
    for start in range(0, len(a), chunk):
        ia, ib = (pa.array(x[start : start + chunk]) for x in (a, b))
        la, lb = (column.take(i).combine_chunks() for i in (ia, ib))
        lengths = pc.list_value_length(la).to_numpy()
        same = lengths == pc.list_value_length(lb).to_numpy()
        if same.any():
            keep = pa.array(same)
            fa, fb = (x.filter(keep).flatten().to_numpy() for x in (la, lb))
            row = np.repeat(np.arange(int(same.sum())), lengths[same])
            same[np.flatnonzero(same)[np.unique(row[fa != fb])]] = False
        out[start : start + chunk] = same
    return out


def _preprocess(config: PrecomputeConfig, tokenizer, out: Path, base: Manifest | None) -> dict[str, Any]:
    """Load, check, key and tokenize the data (main process); returns what every process needs to read the result.
    With `base` (--append), the rows the cache holds are found by their content keys and only the others are
    tokenized."""
    source = load_source(config.dataset, config.split, config.dataset_config)
    layout = check_source(source)  # seconds, even for millions of rows: columns, types, nulls, labels
    if config.pairs_only and layout == "unpaired":
        raise KTOPipelineError(
            f"--pairs-only needs paired data (prompt/chosen/rejected, or chosen/rejected): {config.dataset} holds "
            "unpaired rows (prompt/completion/label), which only KTO trains on. Drop --pairs-only."
        )
    data_hash = content_hash(config.dataset, source)
    key_files = content_keys(source, layout, data_hash, config.num_proc)
    keys = open_keys(key_files)
    answer = {
        "source": {
            "name_or_path": _absolute_if_local(config.dataset),
            "config": config.dataset_config,
            "split": config.split,
            "content_hash": data_hash,
            "source_rows": len(source),
        },
        "source_rows": len(source),
        "data_hash": data_hash,
        "key_files": key_files,
        "key_rows": None,
        "positions": None,
        "matched_rows": 0,
        "first_example_id": 0,
        "conversational": bool(len(keys) and keys.column("conversational")[0].as_py()),
        "paired": layout != "unpaired",  # normalized rows 2i and 2i+1 are source row i's (chosen, rejected)
    }
    selection = ""
    if base is not None:
        new_rows = _new_rows(config, out, base, keys)
        answer["matched_rows"] = len(keys) - len(new_rows)
        if not len(new_rows):
            return {**answer, "nothing_new": True}
        # only the source rows that hold a new normalized row are tokenized (a pair may be half new)
        source_row = keys.column("source_row").to_numpy()
        selected = np.unique(source_row[new_rows])
        in_selected = np.isin(source_row, selected)
        answer["key_rows"] = new_rows.tolist()
        answer["positions"] = (np.cumsum(in_selected) - 1)[new_rows].tolist()
        answer["first_example_id"] = base.next_example_id
        answer["conversational"] = bool(keys.column("conversational")[int(new_rows[0])].as_py())
        if len(selected) < len(source):
            source = source.select(selected)
            selection = hashlib.sha256(selected.tobytes()).hexdigest()
    key = json.dumps([data_hash, config.split, config.dataset_config, *([selection] if selection else [])])
    tokenizer_fingerprint = tokenizer_hash(tokenizer)
    fingerprint = preprocess_fingerprint(key, tokenizer_fingerprint)
    cached = any(preprocess_cache_dir().glob(f"tokenized-{fingerprint}*.arrow"))
    started = time.perf_counter()
    tokenized = preprocess(source, tokenizer, fingerprint, layout, config.num_proc)
    return {
        **answer,
        "files": [f["filename"] for f in tokenized.cache_files],
        "tokenizer_hash": tokenizer_fingerprint,
        "cached": cached,
        "tokenize_seconds": time.perf_counter() - started,
    }


def _new_rows(config: PrecomputeConfig, out: Path, base: Manifest, keys: pa.Table) -> np.ndarray:
    """The normalized rows of the dataset (positions) that the cache does not hold, matched by content key with
    multiplicity. A dataset that shares rows with the cache but lacks some of the rows it holds is refused, naming
    them, unless --allow-missing; a dataset that shares none is taken as new rows only."""
    held, held_ids, held_kept = held_keys(out, base)
    match = match_keys(held, key_array(keys.column("key")))
    new_rows = np.flatnonzero(match.new)
    missing = held_ids[match.missing & held_kept]
    if len(missing) and len(new_rows) < len(keys) and not config.allow_missing:
        shown = ", ".join(str(i) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise KTOPipelineError(
            f"--dataset {config.dataset} holds {len(keys) - len(new_rows)} of the cache's rows but not "
            f"{len(missing)} others (example ids {shown}): a grown log should keep every row it had, with its "
            "label. If rows were removed or relabelled on purpose, or --dataset holds only new rows of which some "
            "repeat rows of the cache, pass --allow-missing: the cache keeps its rows and only the rows it does not "
            "hold are appended. The cache is unchanged."
        )
    return new_rows


def _kl_partners(
    config: PrecomputeConfig, out: Path, base: Manifest | None, n: int, conversational: bool
) -> tuple[np.ndarray, tuple[int, list[int]] | None]:
    """Each kept row's KL partner: a seeded random cycle through the rows of this segment (a full precompute: the
    whole dataset, seed --seed; an append: its new rows, seed (--seed, segment number)), so that each completion
    is another row's KL completion exactly once. A one-row append draws its partner from the cache's rows with
    the same kind of prompt (standard or conversational), with the same seed."""
    if config.pairs_only:  # no KL completions
        return np.full(n, -1, dtype=np.int64), None
    if base is None:
        return assign_kl_partners(n, config.kl_seed), None
    seed = [config.kl_seed, len(base.all_segments)]
    if n > 1:
        return assign_kl_partners(n, seed), None
    return np.array([-1], dtype=np.int64), _partner_from_cache(out, base, conversational, seed)


def _partner_from_cache(out: Path, base: Manifest, conversational: bool, seed: list[int]) -> tuple[int, list[int]]:
    kind = "conversational" if conversational else "standard"
    rows = {s["file"]: s["rows"] for s in base.shards}
    files = [f for seg in base.all_segments if seg.get("prompt_kind") == kind for f in seg["shards"]]
    total = sum(rows[f] for f in files)
    if not total:
        raise KTOPipelineError(
            f"the one new row has a {kind} prompt and the cache holds no row of that kind to draw its KL completion "
            "from. Append it together with at least one other row."
        )
    pick = int(np.random.default_rng(seed).integers(total))
    for file in files:
        if pick < rows[file]:
            with pa.memory_map(str(out / file)) as source:
                table = pa.ipc.open_stream(source).read_all()
            return table.column("example_id")[pick].as_py(), table.column("completion_ids")[pick].as_py()
        pick -= rows[file]
    raise AssertionError("unreachable")


# -------------------------------------------------------------------------------------- reference


def load_reference(run: Pass) -> None:
    config = run.config
    run.regime = reference_regime(config.dtype, config.bf16, run.state.device)
    run.model = run.engine.load(
        lambda: load_model(config.model, run.regime.dtype, config.revision, config.trust_remote_code),
        config.trust_remote_code,
        run.regime,
    ).eval()
    run.model_hash = run.engine.weights_hash(run.model, run.state.is_main_process)  # the whole weights, as loaded
    # Each prompt runs once for both continuations, where the model's attention takes a packed layout.
    run.padded_because = packing_unsupported(run.model)
    run.attention_kernel, kernel_note = request_attention_kernel(run.model, config.attention_kernel, run.state.device)
    run.scorer = run.engine.prepare_scorer(ReferenceScorer(run.model), run.model, run.regime, run.state.device)
    run.peaks.loaded()  # the model read, then sharded or partitioned: loading's peak
    print0(run.state, f"reference: {run.regime}, {run.engine}")
    if run.padded_because is None:
        print0(run.state, f"attention: {run.attention_kernel}" + (f" ({kernel_note})" if kernel_note else ""))
    else:
        print0(
            run.state,
            f"note: {type(run.model).__name__}: {run.padded_because}; each sequence runs on its own, padded",
        )


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
        **run.regime.record(),
        "kl_seed": config.kl_seed,
        "shard_size": config.shard_size,
        **({"kl_completions": False} if config.pairs_only else {}),
    }
    if run.base is not None:
        return _plan_append(run, fingerprint)
    plan = main_decides(state, lambda: _decide_output(run.out, fingerprint, config.overwrite))
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
        normalized_rows=prepared.segment["normalized_rows"],
        desirable=int(rows.labels.sum()),
        rows=len(rows),
        dropped=dict(rows.dropped),
        pairs=prepared.segment["pairs"],
        padded_because=run.padded_because,
        attention_kernel=run.attention_kernel,
        distributed=run.engine.record(),
        shards=plan["done_shards"],
    )
    run.written, run.first_shard = run.manifest.shards, 0
    if state.is_main_process:
        run.out.mkdir(parents=True, exist_ok=True)
        run.segment = _new_segment(run, 0)
        run.manifest.start_segments(run.segment)
        write_manifest(run.out, run.manifest)
    state.wait_for_everyone()
    return True


def _plan_append(run: Pass, fingerprint: dict[str, Any]) -> bool:
    """--append: check the loaded weights against the cache's, write the new segment's keys file and record the
    segment as being appended (`appending` in the manifest: the cache, as every reader sees it, is unchanged until
    `finish`). An interrupted append of the same rows resumes after its intact shards; one of other rows is
    discarded (its shards were never part of the cache)."""
    out, base = run.out, run.base

    def plan() -> dict[str, Any]:
        if base.fingerprint.get("model_hash") != run.model_hash:
            raise KTOPipelineError(
                _append_refused(
                    out,
                    fingerprint_diff(
                        {"model_hash": base.fingerprint.get("model_hash")}, {"model_hash": run.model_hash}
                    ),
                )
            )
        manifest = Manifest(dict(base))
        pending = manifest.take_appending()
        done: list[dict[str, Any]] = []
        if pending is not None:
            was = pending["segment"]
            same = was["source"] == run.prepared.segment["source"] and was["rows"] == run.prepared.segment["rows"]
            if same:
                done = _finished_shards(out, pending["shards"])
                print(f"resuming the append: {len(done)} finished shards of its {was['rows']} rows found in {out}")
            else:
                print(f"an interrupted append of other rows ({was['source']['name_or_path']}) is discarded")
        keep = {s["file"] for s in manifest.shards + done}
        keep |= {seg["keys"]["file"] for seg in manifest.all_segments}
        _remove_leftovers(out, keep)
        manifest.start_append(_new_segment(run, len(manifest.all_segments)), done)
        write_manifest(out, manifest)
        return {"manifest": dict(manifest)}

    run.manifest = Manifest(main_decides(run.state, plan)["manifest"])
    run.segment = run.manifest.appending["segment"]
    run.written = run.manifest.appending["shards"]
    run.first_shard = len(run.manifest.shards)
    return True


def _new_segment(run: Pass, index: int) -> dict[str, Any]:
    """Write the keys file of the segment this run writes (main process) and return its manifest entry."""
    prepared = run.prepared
    keys = key_array(open_keys(prepared.key_files).column("key"))
    if prepared.key_rows is not None:
        keys = keys[prepared.key_rows]
    first = prepared.segment["first_example_id"]
    kept = np.zeros(len(keys), dtype=bool)
    kept[prepared.example_ids - first] = True
    keys_entry = write_keys(run.out, index, first + np.arange(len(keys)), keys, kept)
    info = dict(prepared.segment)
    if (run.base or run.manifest).format_version == 1:  # an append to a version-1 cache keeps its format: no pairs
        info["pairs"] = None
    if index == 0:
        kl = {"rule": "seeded cycle through the segment's rows", "seed": [run.config.kl_seed]}
    elif prepared.outside_partner is None:
        kl = {"rule": "seeded cycle through the segment's rows", "seed": [run.config.kl_seed, index]}
    else:
        kl = {"rule": "drawn from the cache's rows of the same prompt kind", "seed": [run.config.kl_seed, index]}
    return new_segment(index, **info, kl=kl, keys=keys_entry)


def _remove_leftovers(out: Path, keep: set[str]) -> None:
    """Delete the files under shards/ and keys/ that are not part of the cache: half-written files of a killed
    run, and finished files that no manifest entry lists."""
    for folder in (SHARD_DIR, KEY_DIR):
        for leftover in out.glob(f"{folder}/*"):
            if f"{folder}/{leftover.name}" not in keep:
                leftover.unlink()


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
            grown = all(line.split(":")[0] in DATASET_FIELDS for line in diff) and old.complete
            raise KTOPipelineError(
                f"--output {out} holds a cache made with other inputs or settings:\n  - "
                + "\n  - ".join(diff)
                + "\nPass --overwrite to replace it"
                + (", --append to add the rows of --dataset that it does not hold" if grown else "")
                + ", or choose another --output."
            )
        if diff:
            shutil.rmtree(out / SHARD_DIR, ignore_errors=True)
            shutil.rmtree(out / KEY_DIR, ignore_errors=True)
            (out / MANIFEST).unlink()
        else:
            done_shards = _finished_shards(out, old.shards)
            print(f"resuming: {len(done_shards)} finished shards found in {out}")
    # Half-written shards of a killed run, and shards past the intact ones, are not part of the cache.
    _remove_leftovers(out, {s["file"] for s in done_shards})
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
    shard layout (which rows go where) does not depend on the number of processes. An append's shards are
    numbered after the cache's and recorded under `appending` until `finish`."""

    config, state = run.config, run.state
    n = len(run.prepared.rows)
    pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    num_shards = (n + config.shard_size - 1) // config.shard_size
    run.progress = progress = ShardProgress(n, sum(s["rows"] for s in run.written), state)
    try:
        with StopRequests() as stop:
            for first in range(len(run.written), num_shards, state.num_processes):
                _score_round(run, first, num_shards, pad_id)
                signal_name = stop.agreed(state.device)  # one small collective per round
                if signal_name and len(run.written) < num_shards:
                    progress.bar.close()
                    run.engine.close(run.scorer)
                    raise Preempted(
                        f"{signal_name} received: stopped after the shards in flight, {len(run.written)}/{num_shards} "
                        f"shards written in {run.out}. Continue with {continue_command()}: it resumes after them."
                    )
    except KeyboardInterrupt:
        progress.bar.close()
        raise KTOPipelineError(
            f"interrupted: {len(run.written)}/{num_shards} shards are safely written in {run.out}. "
            "Run the same command again to resume from there."
        ) from None
    progress.bar.close()


def _score_round(run: Pass, first: int, num_shards: int, pad_id: int) -> None:
    """One round: process k scores shard `first + k` and writes it; the main process records the finished ones."""
    state, progress = run.state, run.progress
    shard_index = first + state.process_index
    entry, stats = None, dict.fromkeys(("rows", "scored", "executed", "needed"), 0)
    progress.executed_here = 0
    if shard_index < num_shards:
        size, n = run.config.shard_size, len(run.prepared.rows)
        positions = np.arange(shard_index * size, min(n, (shard_index + 1) * size))
        shard = _score_rows(run, positions, pad_id)
        entry = write_shard(run.out, run.first_shard + shard_index, shard, run.manifest.format_version)
        needed, scored = _needed_tokens(shard, run.config.pairs_only)
        stats = {"rows": len(positions), "scored": scored, "executed": progress.executed_here, "needed": needed}
    elif run.engine.collective_forwards:  # no shard left for this process: it still runs the others' forwards
        _score_trees(run, [], pad_id)
    entries = gather_object([(entry, stats)]) if state.num_processes > 1 else [(entry, stats)]
    if state.is_main_process:
        run.written.extend(sorted((e for e, _ in entries if e is not None), key=lambda e: e["file"]))
        write_manifest(run.out, run.manifest)
    progress.end_round([s for _, s in entries])


class ShardProgress:
    """The reference pass's progress bar and counters. Between rounds the bar moves per forward pass: this
    process's batches, times the process count (an estimate; each round's end sets the exact count)."""

    def __init__(self, total_rows: int, done_rows: int, state):
        self.started = time.perf_counter()
        self.bar = tqdm(
            total=total_rows, initial=done_rows, unit="row", desc="reference pass", disable=not shows_progress(state)
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
    config, prepared = run.config, run.prepared
    tok, partner_pos, ids = prepared.rows, prepared.partners, prepared.example_ids
    prompts, completions = tok.take(positions, "prompt_ids"), tok.take(positions, "completion_ids")
    if run.config.pairs_only:
        return _score_pairs(run, positions, prompts, completions, pad_id)
    if prepared.outside_partner is None:
        kl_ids, kl_completions = ids[partner_pos[positions]], tok.take(partner_pos[positions], "completion_ids")
    else:  # a one-row append: its partner is a row of the cache
        kl_ids, kl_completions = [prepared.outside_partner[0]], [prepared.outside_partner[1]]
    trees: list[Tree] = []
    for prompt, completion, kl_completion in zip(prompts, completions, kl_completions, strict=True):
        room = completion_room(prompt, config.max_length)
        trees.append((prompt, [completion[:room], kl_completion[:room]]))
    scores = _score_trees(run, trees, pad_id)
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for row, pos in enumerate(positions):
        prompt, (completion, kl_completion) = trees[row]
        main, kl = scores[row]
        pair = int(prepared.pair_ids[pos])
        _add_row(
            cols, int(ids[pos]), bool(tok.labels[pos]), prompt, completion, main, pair, kl_ids[row], kl_completion, kl
        )
    return cols


def _add_row(
    cols: dict[str, list],
    example_id: int,
    label: bool,
    prompt,
    completion,
    values,
    pair_id: int,
    kl_id: int = -1,
    kl_completion=(),
    kl_values=(),
) -> None:
    """Append one row to a shard's columns, after checking its reference values are finite. Without a KL
    completion (--pairs-only) its KL partner is -1 and its KL columns are empty (their sum 0)."""
    for what, got in (("completion", values), ("KL completion", kl_values)):
        got = np.asarray(got, dtype=np.float32)
        if not np.isfinite(got).all():
            raise KTOPipelineError(
                f"example {example_id}: the reference model gave a non-finite log-prob for its {what} "
                f"(values {got[~np.isfinite(got)][:3]}). The model or its dtype is broken "
                "(try --dtype float32); nothing of this row was written."
            )
    cols["example_id"].append(example_id)
    cols["label"].append(label)
    cols["prompt_ids"].append(prompt)
    cols["completion_ids"].append(completion)
    cols["kl_example_id"].append(int(kl_id))
    cols["kl_completion_ids"].append(list(kl_completion))
    cols["ref_logp"].append(token_sum(values))
    cols["ref_kl_logp"].append(token_sum(kl_values))
    cols["ref_token_logps"].append(values)
    cols["ref_kl_token_logps"].append(kl_values if len(kl_values) else [])
    cols["pair_example_id"].append(pair_id)


def _score_pairs(run: Pass, positions: np.ndarray, prompts: list, completions: list, pad_id: int) -> dict:
    """--pairs-only: the rows at `positions` are whole pairs, each (chosen, rejected) next to each other; each pair
    is one tree, its prompt run once for both answers, and the rows get no KL completion."""
    config, prepared = run.config, run.prepared
    ids = prepared.example_ids[positions]
    trees: list[Tree] = []
    for j in range(0, len(positions), 2):
        if prepared.pair_ids[positions[j]] != ids[j + 1] or prompts[j] != prompts[j + 1]:
            raise AssertionError(f"rows {ids[j]} and {ids[j + 1]} are not one pair")  # (shards hold whole pairs)
        room = completion_room(prompts[j], config.max_length)
        trees.append((prompts[j], [completions[j][:room], completions[j + 1][:room]]))
    scores = _score_trees(run, trees, pad_id)
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for row, pos in enumerate(positions):  # no KL completion (manifest settings.kl_completions: false)
        prompt, answers = trees[row // 2]
        label, pair = bool(prepared.rows.labels[pos]), int(prepared.pair_ids[pos])
        _add_row(cols, int(ids[row]), label, prompt, answers[row % 2], scores[row // 2][row % 2], pair)
    return cols


def _score_trees(run: Pass, trees: list[Tree], pad_id: int) -> list[tuple[np.ndarray, ...]]:
    """score_shard with this pass's settings. Sharded, every process runs as many forwards as the busiest."""
    return score_shard(
        run.scorer,
        trees,
        pad_id,
        run.config.batch_size,
        run.config.max_tokens_per_batch,
        run.state.device,
        run.progress.on_batch,
        packed=run.padded_because is None,
        agree_on_forwards=run.engine.agree_on_forwards if run.engine.collective_forwards else None,
    )


def _needed_tokens(shard: dict, pairs_only: bool = False) -> tuple[int, int]:
    """(needed, scored) tokens of a shard. Needed, the minimal work: each prompt once, then its completion and its
    KL completion, no padding (--pairs-only: each pair's prompt once, then its two answers). Scored: as separate
    sequences, each prompt with each of its continuations."""
    prompts = sum(len(p) for p in shard["prompt_ids"])
    answers = sum(len(c) for key in ("completion_ids", "kl_completion_ids") for c in shard[key])
    if pairs_only:
        return prompts // 2 + answers, prompts + answers
    return prompts + answers, 2 * prompts + answers


# ------------------------------------------------------------------------------------------- finish


def finish(run: Pass) -> None:
    """Record the segment's shards and this run's timing; a full precompute marks the cache complete, an append adds
    its segment to the cache (one atomic manifest write). Print the summary."""
    config, prepared, progress, manifest = run.config, run.prepared, run.progress, run.manifest
    peak_memory = run.peaks.per_process(run.state)
    if run.state.is_main_process:
        timing = {
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
            "peak_memory": peak_memory,
        }
        segment = run.segment
        segment["shards"] = [s["file"] for s in run.written]
        segment["timing"] = timing
        if run.base is None:
            manifest.mark_complete(timing)
        else:
            manifest.finish_append()
        write_manifest(run.out, manifest)
        _print_summary(manifest, segment, run.out, time.perf_counter() - run.started)
    run.engine.close(run.scorer)
    run.state.wait_for_everyone()


def _print_summary(manifest: Manifest, segment: dict[str, Any], out: Path, seconds: float) -> None:
    timing, dropped = segment["timing"], segment["dropped"]
    dropped_text = ", ".join(f"{c} ({r})" for r, c in dropped.items()) if dropped else "none"
    cached = " (read from the datasets cache)" if timing["preprocess_cached"] else ""
    counts = manifest.counts
    appended = segment["index"] > 0
    rows = (
        f"{segment['rows']} appended as segment {segment['index']} ({segment['desirable']} desirable, "
        f"{segment['rows'] - segment['desirable']} undesirable); {segment['matched_rows']} of the dataset's rows "
        f"were in the cache already; the cache now holds {counts['rows']} rows in {len(manifest.segments)} segments"
        if appended
        else f"{counts['rows']} ({counts['desirable']} desirable, {counts['undesirable']} undesirable)"
    )
    scored_what = "completions + KL completions" if manifest.has_kl else "chosen + rejected completions, no KL"
    pairs = segment.get("pairs") or {}
    pairs_line = (
        f"  pairs        {pairs['complete']} (chosen, rejected) pairs, {pairs['rows_without_partner']} rows without "
        "their partner\n"
        if pairs.get("complete") or pairs.get("rows_without_partner")
        else ""
    )
    print(
        f"\n{'append' if appended else 'precompute'} finished\n"
        f"  rows         {rows}\n"
        f"{pairs_line}"
        f"  dropped      {sum(dropped.values())}: {dropped_text}\n"
        f"  tokens       {timing['tokens_scored']} scored ({scored_what}, with their prompts)\n"
        f"  efficiency   {timing['token_efficiency']:.1%}: {timing['tokens_needed']} tokens needed (each prompt once, "
        f"no padding) / {timing['tokens_executed']} executed\n"
        f"  tokenizing   {segment['normalized_rows']} rows of {segment['source']['source_rows']} source rows in "
        f"{timing['preprocess_seconds']:.1f} s: {timing['preprocess_rows_per_second']:.0f} source rows/s (load, "
        f"check, key, tokenize; datasets.map {timing['tokenize_seconds']:.1f} s with --num-proc "
        f"{timing['num_proc']}){cached}\n"
        f"  reference    {timing['rows_scored']} rows in {timing['reference_pass_seconds']:.1f} s: "
        f"{timing['rows_scored'] / max(timing['reference_pass_seconds'], 1e-9):.1f} rows/s, "
        f"{timing['tokens_scored'] / max(timing['reference_pass_seconds'], 1e-9):.0f} tokens/s\n"
        f"  wall time    {seconds:.1f} s\n"
        f"  memory       peak private host memory: {describe(timing['peak_memory'])}\n"
        f"  shards       {len(manifest.shards)}\n"
        f"  cache        {out.resolve()}",
        flush=True,
    )
