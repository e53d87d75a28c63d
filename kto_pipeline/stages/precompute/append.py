"""`precompute --append`: add the rows of a dataset that a cache does not hold, as a new segment.

An append runs the phases of a full precompute (`stage.py`) and differs in three places, each a function here:
the cache is checked against this run before any work (`open_base`); only the dataset's rows that the cache does
not hold are tokenized and scored, found by content key with multiplicity (`segments.py`, `find_new_rows`); and
the output is the cache itself, its new segment recorded under `appending` in the manifest until `finish`, so that
every reader sees the cache unchanged until then (`plan_append`). A one-row append cannot draw its KL partner from
its own rows: it draws one from the cache's (`partner_from_cache`). No file of the cache is rewritten: its new
shards are numbered after the cache's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kto_pipeline.cache import MANIFEST, read_manifest, write_manifest
from kto_pipeline.cache.manifest import Manifest, fingerprint_diff
from kto_pipeline.config import PrecomputeConfig
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.files import tokenizer_hash
from kto_pipeline.quantization import fingerprint_of
from kto_pipeline.runtime.precision import reference_regime
from kto_pipeline.stages.precompute.phases import Output, Pass, absolute_if_local, on_main
from kto_pipeline.stages.precompute.segments import Match, require_keys
from kto_pipeline.stages.precompute.shards import finished_shards, remove_leftovers, segment_entry

# What must be the same for rows appended to a cache to have the values a full precompute would give them:
# the reference (name, revision; its weights' hash is checked after loading), the tokenizer (vocabulary, special
# tokens, chat template), max_length, the precision regime, and the KL seed.
APPEND_MUST_MATCH = (
    "model",
    "model_revision",
    "tokenizer_hash",
    "max_length",
    "dtype",
    "autocast",
    "kl_seed",
    "kl_completions",  # (recorded as False by --pairs-only only: absent, None, means with KL completions)
    "quantization",  # (recorded only where the reference was quantized)
)


def open_base(run: Pass) -> Manifest:
    """--append: the complete cache at --output, checked against this run before any work: the tokenizer, the
    model's name and revision, max_length, the precision regime and the KL seed must be the cache's (the weights'
    hash is compared once the model is loaded). Anything else is refused, naming each difference."""
    config, out = run.config, run.out

    def check() -> Manifest:
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
                "model": absolute_if_local(config.model),
                "model_revision": config.revision,
                "tokenizer_hash": tokenizer_hash(run.tokenizer),
                "max_length": config.max_length,
                **regime.record(),
                "quantization": fingerprint_of(run.quantization) if run.quantization else None,
                "kl_seed": config.kl_seed,
                "kl_completions": False if config.pairs_only else None,
            },
        )
        if diff:
            raise KTOPipelineError(_refused(out, diff))
        return base

    return on_main(run.state, check)


def _refused(out: Path, diff: list[str]) -> str:
    return (
        f"--append: the cache at {out} was made with another reference or settings:\n  - "
        + "\n  - ".join(diff)
        + "\nRows appended with these would not have the values the cache's rows have. Use the cache's model and "
        "settings (`kto-pipeline inspect` shows them), or write a new cache. The cache is unchanged."
    )


# ------------------------------------------------------------------------------------------- rows


@dataclass
class NewRows:
    """The normalized rows of a dataset that the cache does not hold, and the source rows that hold them."""

    key_rows: np.ndarray  # (m,) int64: their positions among the dataset's normalized rows (its content keys)
    matched_rows: int  # the dataset's normalized rows that the cache holds already
    first_example_id: int  # the first new row's: after every normalized row the cache has seen, kept or dropped
    conversational: bool  # the first new row's prompt kind
    source_rows: np.ndarray  # the source rows to tokenize: those that hold a new row (a pair may be half new)
    positions: np.ndarray  # (m,) int64: the new rows' positions among the normalized rows of `source_rows`


def find_new_rows(
    config: PrecomputeConfig, base: Manifest, keys: pa.Table, match: Match, missing: np.ndarray
) -> NewRows | None:
    """The rows of the dataset that the cache does not hold; None when it holds them all (said on the way).

    `keys`: the dataset's content keys; `match`: them matched against the cache's with multiplicity
    (`segments.match_keys`); `missing`: the example ids of the cache's kept rows that the dataset lacks. A dataset
    that shares rows with the cache but lacks some of the rows it holds is refused, naming them, unless
    --allow-missing; a dataset that shares none is taken as new rows only."""
    new_rows = np.flatnonzero(match.new)
    if len(missing) and len(new_rows) < len(keys) and not config.allow_missing:
        shown = ", ".join(str(i) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise KTOPipelineError(
            f"--dataset {config.dataset} holds {len(keys) - len(new_rows)} of the cache's rows but not "
            f"{len(missing)} others (example ids {shown}): a grown log should keep every row it had, with its "
            "label. If rows were removed or relabelled on purpose, or --dataset holds only new rows of which some "
            "repeat rows of the cache, pass --allow-missing: the cache keeps its rows and only the rows it does not "
            "hold are appended. The cache is unchanged."
        )
    if not len(new_rows):
        print(f"{config.dataset}: all {len(keys)} of its rows are in the cache already: nothing to append.", flush=True)
        return None
    source_row = keys.column("source_row").to_numpy()
    selected = np.unique(source_row[new_rows])
    in_selected = np.isin(source_row, selected)
    return NewRows(
        key_rows=new_rows.astype(np.int64),
        matched_rows=len(keys) - len(new_rows),
        first_example_id=base.next_example_id,
        conversational=bool(keys.column("conversational")[int(new_rows[0])].as_py()),
        source_rows=selected,
        positions=((np.cumsum(in_selected) - 1)[new_rows]).astype(np.int64),
    )


def partner_from_cache(out: Path, base: Manifest, conversational: bool, seed: list[int]) -> tuple[int, list[int]]:
    """A one-row append's KL partner, (example id, completion): a row of the cache with the same kind of prompt
    (standard or conversational), drawn with `seed`."""
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


# ------------------------------------------------------------------------------------------ output


def plan_append(run: Pass) -> Output:
    """Check the loaded weights against the cache's, write the new segment's keys file and record the segment as
    being appended (`appending` in the manifest: the cache, as every reader sees it, is unchanged until `finish`).
    An interrupted append of the same rows resumes after its intact shards; one of other rows is discarded (its
    shards were never part of the cache)."""
    out, base, segment = run.out, run.base, run.prepared.segment
    weights_hash = run.reference.weights_hash

    def plan() -> Manifest:
        if base.fingerprint.get("model_hash") != weights_hash:
            cached = {"model_hash": base.fingerprint.get("model_hash")}
            raise KTOPipelineError(_refused(out, fingerprint_diff(cached, {"model_hash": weights_hash})))
        manifest = Manifest(dict(base))
        pending = manifest.take_appending()
        done: list[dict[str, Any]] = []
        if pending is not None:
            was = pending["segment"]
            if was["source"] == segment.source and was["rows"] == segment.rows:
                done = finished_shards(out, pending["shards"])
                print(f"resuming the append: {len(done)} finished shards of its {was['rows']} rows found in {out}")
            else:
                print(f"an interrupted append of other rows ({was['source']['name_or_path']}) is discarded")
        keep = {s["file"] for s in manifest.shards + done}
        keep |= {seg["keys"]["file"] for seg in manifest.all_segments}
        remove_leftovers(out, keep)
        manifest.start_append(segment_entry(run, len(manifest.all_segments), base.format_version), done)
        write_manifest(out, manifest)
        return manifest

    manifest = on_main(run.state, plan)
    appending = manifest.appending
    return Output(manifest, appending["segment"], appending["shards"], first_shard=len(manifest.shards))
