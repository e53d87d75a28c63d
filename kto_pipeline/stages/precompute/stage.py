"""Stage 1: run the frozen reference model once over a dataset and write the cache.

`precompute()` is the outline, one phase a function around one `Pass` (`phases.py`: the run state and what each
phase hands the next):

    setup -> [open the cache to append to] -> prepare rows -> load the reference -> plan the output
          -> score shards -> finish

The data is checked and tokenized before the model loads (`data.py`, datasets.map, cached on disk), so a bad row
is reported in seconds. The rows are scored a shard at a time into Arrow files (`shards.py`): a crash loses at
most one shard of work and a rerun resumes after the intact ones. Each prompt runs once for its completion and its
KL completion, several trees packed side by side in token-budgeted forward passes; models whose attention takes
no packed layout run every sequence on its own, padded, and the manifest records which (`cache/` writes the
manifest and the shards, `cache/manifest.py` says what the manifest holds). How the reference is spread over the
processes is asked of the engine (`runtime/engines`: `prepare_scorer`), which this stage never names. A cache
that grows: `--append` (`append.py`) adds the rows of a dataset that the cache does not hold as a new segment
(`segments.py`).
"""

from __future__ import annotations

import functools
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

from kto_pipeline import __version__
from kto_pipeline.cache import MANIFEST, NO_PAIR, SHARD_DIR, read_manifest, write_manifest
from kto_pipeline.cache.manifest import Manifest, fingerprint_diff, new_manifest
from kto_pipeline.config import PrecomputeConfig
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.files import tokenizer_hash
from kto_pipeline.images import (
    ImageRows,
    base_dir,
    image_column,
    images_hash,
    load_processor,
    processor_hash,
    vision_unsupported,
)
from kto_pipeline.lock import holds_files, main_process_lock
from kto_pipeline.models import check_quantizable, load_model, load_tokenizer
from kto_pipeline.quantization import fingerprint_of, quantization_of
from kto_pipeline.runtime.engines import engine_for
from kto_pipeline.runtime.launch import print0, process_state
from kto_pipeline.runtime.peak_memory import PeakMemory
from kto_pipeline.runtime.precision import reference_regime
from kto_pipeline.scoring.attention import forward_tokens
from kto_pipeline.scoring.logprobs import ReferenceScorer
from kto_pipeline.scoring.plan import plan_scoring
from kto_pipeline.stages.precompute.append import NewRows, find_new_rows, open_base, partner_from_cache, plan_append
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
from kto_pipeline.stages.precompute.finish import finish
from kto_pipeline.stages.precompute.phases import (
    Output,
    Pass,
    PreparedRows,
    Reference,
    SegmentRows,
    absolute_if_local,
    on_main,
)
from kto_pipeline.stages.precompute.segments import KEY_DIR, content_keys, held_keys, key_array, match_keys, open_keys
from kto_pipeline.stages.precompute.shards import (
    check_packing,
    finished_shards,
    remove_leftovers,
    score_shards,
    segment_entry,
)


def precompute(config: PrecomputeConfig) -> Path:
    """Score every row and its KL partner with the reference model and write the cache at `config.output`.

    An advisory lock on `config.output` is held from the first check to the last write: a second precompute
    into the same directory is refused while this one lives."""
    process_state(config.ddp_timeout)  # the process group first: the lock's broadcast runs in it
    with main_process_lock(config.output, "precompute", label="--output"), PeakMemory() as peaks:
        run = setup(config, peaks)
        if config.append:
            run.base = open_base(run)  # append.py
        run.prepared = prepare_rows(config, run.tokenizer, run.state, run.base)
        if run.prepared is None:
            return run.out  # an append that found no new rows
        load_reference(run)
        check_packing(run)  # shards.py: packed as each sequence alone, or the pass runs padded
        if plan_output(run):
            score_shards(run)  # shards.py
            finish(run)  # finish.py
        return run.out


def setup(config: PrecomputeConfig, peaks: PeakMemory) -> Pass:
    started = time.perf_counter()
    out = Path(config.output)
    _check_output(out)
    # One process, or one per device under `accelerate launch` / torchrun (without a GPU: CPU + gloo).
    state = process_state(config.ddp_timeout)
    engine = engine_for(state.num_processes)
    print0(state, f"kto-pipeline precompute {__version__}\n{config.describe()}")
    # a quantization's options, bitsandbytes and the checkpoint checked before any work
    quantization = quantization_of(config, reference_regime(config.dtype, config.bf16, state.device).weights)
    if quantization is not None and config.torch_compile:
        raise KTOPipelineError(f"--torch-compile: not with --load-in-{quantization.bits}bit (bitsandbytes' layers)")
    check_quantizable(config.model, "--model", quantization)
    tokenizer = load_tokenizer(config.model, config.revision, config.trust_remote_code)
    return Pass(config, out, state, engine, started, tokenizer, peaks, quantization)


def _check_output(out: Path) -> None:
    # (a file at --output is refused by the lock, taken before this check)
    if out.is_dir() and holds_files(out) and not (out / MANIFEST).exists():
        raise KTOPipelineError(
            f"--output {out} already holds files that are not a kto-pipeline cache. Choose an empty or new directory."
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
        tokenized = _preprocess(config, tokenizer, out, base)
    else:
        tokenized = on_main(state, lambda: _preprocess(config, tokenizer, out, base))
    if tokenized is None:
        return None  # an append whose rows the cache holds already
    table = open_arrow_files(tokenized.files)
    new = tokenized.new
    among = None if new is None else new.positions
    rows = select_rows(table, config.max_length, among)
    seconds = time.perf_counter() - started
    which = "new row" if base is not None else "row"
    if len(rows) == 0:
        reasons = ", ".join(f"{c} {r}" for r, c in rows.dropped.items())
        raise KTOPipelineError(f"every {which} was dropped ({reasons}). Raise --max-length or check the data.")
    first = 0 if new is None else new.first_example_id
    # a row's example id: its place among the normalized rows of the cache, kept or dropped
    example_ids = first + (rows.example_ids if among is None else np.searchsorted(among, rows.example_ids))
    if tokenized.paired:
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
    segment = SegmentRows(
        source=tokenized.source,
        first_example_id=first,
        normalized_rows=table.num_rows if among is None else len(among),
        rows=len(rows),
        desirable=int(rows.labels.sum()),
        dropped=dict(rows.dropped),
        conversational=tokenized.conversational,
        matched_rows=0 if new is None else new.matched_rows,
        pairs={"complete": complete // 2, "rows_without_partner": len(rows) - complete if tokenized.paired else 0},
    )
    partners, outside = _kl_partners(config, out, base, len(rows), tokenized.conversational)
    if state is None or state.is_main_process:
        cached = " (read from the datasets cache)" if tokenized.cached else ""
        held = f", {segment.matched_rows} already in the cache" if base is not None else ""
        print(
            f"tokenized {segment.normalized_rows} {which}s of {tokenized.source_rows} in {seconds:.1f} s"
            f"{cached}: {len(rows)} kept{held}",
            flush=True,
        )
    return PreparedRows(
        rows=rows,
        example_ids=example_ids.astype(np.int64),
        partners=partners,
        pair_ids=pair_ids.astype(np.int64),
        segment=segment,
        key_files=tokenized.key_files,
        key_rows=None if new is None else new.key_rows,
        source_rows=tokenized.source_rows,
        data_hash=tokenized.data_hash,
        images=tokenized.images,
        image_rows=None if tokenized.images is None else _image_rows(config, tokenized.images),
        tokenizer_hash=tokenized.tokenizer_hash,
        cached=tokenized.cached,
        tokenize_seconds=tokenized.tokenize_seconds,
        seconds=seconds,
        outside_partner=outside,
    )


def _image_rows(config: PrecomputeConfig, images: dict[str, Any]) -> ImageRows:
    """The dataset's images as the reference takes them (every process opens its own)."""
    source = load_source(config.dataset, config.split, config.dataset_config)
    processor = load_processor(config.model, config.revision, config.trust_remote_code)
    root = None if images["root"] is None else Path(images["root"])
    return ImageRows(source, images["column"], root, processor)


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


@dataclass
class _Tokenized:
    """What the main process's `_preprocess` hands every process: the tokenized rows' files and what the cache
    records of their dataset."""

    source: dict[str, Any]  # the dataset as its segment records it: name_or_path, config, split, content_hash, ...
    source_rows: int
    data_hash: str
    images: dict[str, Any] | None  # rows with images: {column, root, processor_hash} (manifest JSON); else None
    key_files: list[str]  # the content keys of every normalized row of the dataset
    paired: bool  # normalized rows 2i and 2i+1 are source row i's (chosen, rejected)
    conversational: bool  # the prompt kind of the first row (of an append: of its first new row)
    new: NewRows | None  # --append: the rows the cache does not hold (None: a full precompute, every row)
    files: list[str]  # the tokenized table's Arrow files
    tokenizer_hash: str
    cached: bool  # the tokenized table was read from the datasets cache
    tokenize_seconds: float


def _preprocess(config: PrecomputeConfig, tokenizer, out: Path, base: Manifest | None) -> _Tokenized | None:
    """Load, check, key and tokenize the data (main process); returns what every process needs to read the result.
    With `base` (--append), the rows the cache holds are found by their content keys and only the others are
    tokenized; None when the cache holds them all."""
    source = load_source(config.dataset, config.split, config.dataset_config)
    layout = check_source(source)  # seconds, even for millions of rows: columns, types, nulls, labels
    if layout == "unpaired" and {"chosen", "rejected"} <= set(source.column_names):
        print(
            "note: the dataset has unpaired (completion, label) and paired (chosen, rejected) columns: its rows are "
            "read as unpaired, and chosen and rejected are not used. For the pairs, drop completion and label."
        )
    if config.pairs_only and layout == "unpaired":
        raise KTOPipelineError(
            f"--pairs-only needs paired data (prompt/chosen/rejected, or chosen/rejected): {config.dataset} holds "
            "unpaired rows (prompt/completion/label), which only KTO trains on. Drop --pairs-only."
        )
    data_hash = content_hash(config.dataset, source)
    images, processing = None, tokenizer
    column = image_column(source)
    if column is not None:  # vision-language rows: the model's processor tokenizes them with their images
        if base is not None:
            raise KTOPipelineError(
                f"--append: {config.dataset} has images ('{column}'), and a cache of rows with images cannot grow yet. "
                "Precompute a new cache of the whole dataset."
            )
        processing = load_processor(config.model, config.revision, config.trust_remote_code)
        root = base_dir(config.dataset)
        data_hash = "sha256:" + hashlib.sha256(f"{data_hash}:{images_hash(source, column, root)}".encode()).hexdigest()
        images = {
            "column": column,
            "root": None if root is None else str(root),
            "processor_hash": processor_hash(processing),
        }
    key_files = content_keys(source, layout, data_hash, config.num_proc)
    keys = open_keys(key_files)
    source_rows = len(source)
    conversational = bool(len(keys) and keys.column("conversational")[0].as_py())
    new, selection = None, ""
    if base is not None:
        # the rows the cache has seen, by content key, matched with the dataset's with multiplicity (segments.py)
        held, held_ids, held_kept = held_keys(out, base)
        match = match_keys(held, key_array(keys.column("key")))
        new = find_new_rows(config, base, keys, match, missing=held_ids[match.missing & held_kept])
        if new is None:
            return None
        conversational = new.conversational
        if len(new.source_rows) < len(source):
            source = source.select(new.source_rows)
            selection = hashlib.sha256(new.source_rows.tobytes()).hexdigest()
    key = json.dumps([data_hash, config.split, config.dataset_config, *([selection] if selection else [])])
    tokenizer_fingerprint = tokenizer_hash(tokenizer)
    processing_hash = tokenizer_fingerprint if images is None else f"{tokenizer_fingerprint}+{images['processor_hash']}"
    fingerprint = preprocess_fingerprint(key, processing_hash)
    cached = any(preprocess_cache_dir().glob(f"tokenized-{fingerprint}*.arrow"))
    started = time.perf_counter()
    pictures = None if images is None else (column, root)
    tokenized = preprocess(source, processing, fingerprint, layout, config.num_proc, images=pictures)
    return _Tokenized(
        source={
            "name_or_path": absolute_if_local(config.dataset),
            "config": config.dataset_config,
            "split": config.split,
            "content_hash": data_hash,
            "source_rows": source_rows,
        },
        source_rows=source_rows,
        data_hash=data_hash,
        images=images,
        key_files=key_files,
        paired=layout != "unpaired",
        conversational=conversational,
        new=new,
        files=[f["filename"] for f in tokenized.cache_files],
        tokenizer_hash=tokenizer_fingerprint,
        cached=cached,
        tokenize_seconds=time.perf_counter() - started,
    )


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
    return np.array([-1], dtype=np.int64), partner_from_cache(out, base, conversational, seed)


# -------------------------------------------------------------------------------------- reference


def load_reference(run: Pass) -> None:
    config, state = run.config, run.state
    regime = reference_regime(config.dtype, config.bf16, state.device)
    quantization = run.quantization
    model = run.engine.load(
        lambda: load_model(
            config.model, regime.dtype, config.revision, config.trust_remote_code, "--model", quantization
        ),
        config.trust_remote_code,
        regime,
    ).eval()
    if run.prepared.images is not None:
        why = vision_unsupported(model)
        if why is not None:
            raise KTOPipelineError(
                f"--model {config.model}: {type(model).__name__} cannot score rows with images here: {why}. Supported: "
                "LLaVA-style and Idefics3/SmolVLM-style models."
            )
    weights_hash = run.engine.weights_hash(model, state.is_main_process)  # the whole weights, as loaded
    # Each prompt runs once for both continuations, where the model's attention takes a packed layout.
    plan = plan_scoring(model, config, state.device, run.engine, regime, functools.partial(print0, state))
    scorer = run.engine.prepare_scorer(ReferenceScorer(model, plan.attention), model, regime, state.device)
    budget, chosen = config.max_tokens_per_batch, "--max-tokens-per-batch"
    if budget is None:  # once loaded: what memory is left decides on an accelerator
        budget, chosen = forward_tokens(model, state.device, plan.attention.kernel, config.max_length)
    run.reference = Reference(model, weights_hash, scorer, plan, budget, quantization)
    run.peaks.loaded()  # the model read, then sharded or partitioned: loading's peak
    quantized = f", linear layers {quantization}" if quantization is not None else ""
    print0(state, f"reference: {regime}{quantized}, {run.engine}")
    rows = "" if config.batch_size is None else f", at most {config.batch_size} sequences"
    print0(state, f"forwards: up to {budget:,} tokens each ({chosen}){rows}")
    if plan.padded_because is None:
        print0(state, f"attention: {plan.kernel}" + (f" ({plan.kernel_note})" if plan.kernel_note else ""))
    else:
        print0(state, f"note: {type(model).__name__}: {plan.padded_because}; each sequence runs on its own, padded")


# ------------------------------------------------------------------------------------------ output


def plan_output(run: Pass) -> bool:
    """Decide (main process) what to do with what --output holds, and write the new cache's manifest (an append:
    `append.plan_append`). False when the cache is already complete: nothing to do."""
    if run.base is not None:
        run.output = plan_append(run)
        return True
    config, prepared, reference, state = run.config, run.prepared, run.reference, run.state
    # Local paths are recorded absolute, so `train` finds the model from any working directory.
    fingerprint = {
        "model": absolute_if_local(config.model),
        "model_revision": config.revision,
        "model_hash": reference.weights_hash,
        "tokenizer_hash": prepared.tokenizer_hash,
        **({"processor_hash": prepared.images["processor_hash"]} if prepared.images else {}),
        "dataset": absolute_if_local(config.dataset),
        "dataset_config": config.dataset_config,
        "split": config.split,
        "dataset_hash": prepared.data_hash,
        "max_length": config.max_length,
        **reference.plan.regime.record(),
        **({"quantization": fingerprint_of(reference.quantization)} if reference.quantization else {}),
        "kl_seed": config.kl_seed,
        "shard_size": config.shard_size,
        **({"kl_completions": False} if config.pairs_only else {}),
    }
    done_shards = on_main(state, lambda: _decide_output(run.out, fingerprint, config.overwrite))
    if done_shards is None:
        return False
    rows = prepared.rows
    manifest = new_manifest(
        fingerprint,
        tool_version=__version__,
        architecture=type(reference.model).__name__,
        eos_token=run.tokenizer.eos_token,
        pad_token_id=run.tokenizer.pad_token_id,
        source_rows=prepared.source_rows,
        normalized_rows=prepared.segment.normalized_rows,
        desirable=int(rows.labels.sum()),
        rows=len(rows),
        dropped=dict(rows.dropped),
        pairs=prepared.segment.pairs,
        padded_because=reference.plan.padded_because,
        attention_kernel=reference.plan.kernel,
        distributed=run.engine.record(),
        shards=done_shards,
        images=None if prepared.images is None else {**prepared.images, "rows": len(rows)},
        quantization=reference.quantization.record() if reference.quantization else None,
    )
    segment = None
    if state.is_main_process:
        run.out.mkdir(parents=True, exist_ok=True)
        segment = segment_entry(run, 0, manifest.format_version)
        manifest.start_segments(segment)
        write_manifest(run.out, manifest)
    state.wait_for_everyone()
    run.output = Output(manifest, segment, manifest.shards, first_shard=0)
    return True


# The fingerprint's fields that name the dataset: a complete cache that differs from this run only in these may be
# grown with --append instead.
DATASET_FIELDS = ("dataset", "dataset_config", "split", "dataset_hash")


def _decide_output(out: Path, fingerprint: dict[str, Any], overwrite: bool) -> list[dict[str, Any]] | None:
    """Compare what --output holds with this run: None when it holds this very cache, complete (nothing to do);
    otherwise the finished shards to resume after (none: start over)."""
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
            return None
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
            done_shards = finished_shards(out, old.shards)
            print(f"resuming: {len(done_shards)} finished shards found in {out}")
    # Half-written shards of a killed run, and shards past the intact ones, are not part of the cache.
    remove_leftovers(out, {s["file"] for s in done_shards})
    return done_shards
