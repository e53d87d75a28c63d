"""A cache that grows: content keys, segments, and which rows of a dataset a cache already holds.

A cache is written in segments: segment 0 by a full `precompute`, each later one by `precompute --append` with only
the rows the cache did not hold. A segment is recorded in the manifest (`manifest["segments"]`: source, rows,
content hash, time, its shards and its keys file) and its rows' content keys are kept beside the shards:

    CACHE_DIR/keys/segment-00000.arrow    example_id, key (16 bytes), kept (false: dropped by the max_length rules)

A row's content key is a hash of the normalized row (prompt, completion, label, tools, chat kwargs), computed without
tokenizing, so that finding the new rows of a grown log costs a hash per row. Rows are matched with their
multiplicity, as a full precompute keeps duplicates: a log that holds a row twice where the cache holds it once has
one new row (the later occurrence).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kto_pipeline.cache import Manifest, read_keys, write_table
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.stages.precompute.data import cached_map, is_conversational, normalize_batch, open_arrow_files

KEY_DIR = "keys"
KEY_BYTES = 16
KEYS_SCHEMA = pa.schema([("example_id", pa.int64()), ("key", pa.binary(KEY_BYTES)), ("kept", pa.bool_())])
# The rows a map over the source yields: one per normalized row (a paired source row gives two). Its keys are plain
# binary: datasets before 5.1 has no fixed-size binary type (`key_array` reads either)
ROW_KEYS_SCHEMA = pa.schema([("key", pa.binary()), ("source_row", pa.int64()), ("conversational", pa.bool_())])


# ------------------------------------------------------------------------------------------- keys


def _plain(value: Any) -> Any:
    """A row's value with the None entries of its dicts left out: Arrow gives every message dict the union of the
    fields of all rows (`tool_calls: None` ...), so the same message must hash alike in any file."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def row_key(row: dict[str, Any]) -> bytes:
    """The content key of one normalized row: 16 bytes of sha256 over prompt, completion, label, tools and chat
    kwargs. The same row gives the same key in any file format or layout (paired or unpaired)."""
    payload = [
        _plain(row["prompt"]),
        _plain(row["completion"]),
        bool(row["label"]),
        _plain(row.get("tools")),
        _plain(row.get("chat_template_kwargs")),
    ]
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()[:KEY_BYTES]


def _key_batch(batch: dict[str, list], indices: list[int], layout: str) -> dict[str, list]:
    """datasets.map function: source rows -> one key per normalized row."""
    out: dict[str, list] = {name: [] for name in ROW_KEYS_SCHEMA.names}
    for source_row, row in normalize_batch(batch, indices, layout):
        out["key"].append(row_key(row))
        out["source_row"].append(source_row)
        out["conversational"].append(is_conversational(row["prompt"]) or is_conversational(row["completion"]))
    return out


def content_keys(source, layout: str, data_hash: str, num_proc: int = 1) -> list[str]:
    """The content key of every normalized row of `source`, computed with datasets.map into the datasets cache
    (named by the data's hash: a second run reads it). Returns its Arrow files (`open_keys` maps them): columns
    key, source_row, conversational. `layout`: `check_source(source)`."""
    name = "kto-keys-" + hashlib.sha256(json.dumps([data_hash, layout, KEY_BYTES, "binary"]).encode()).hexdigest()[:40]
    keyed = cached_map(
        source, _key_batch, {"layout": layout}, ROW_KEYS_SCHEMA, "keys", name, 1024, num_proc, "content keys"
    )
    return [f["filename"] for f in keyed.cache_files]


def open_keys(files: list[str]) -> pa.Table:
    """`content_keys`' files as one memory-mapped table."""
    return open_arrow_files(files)


def key_array(column) -> np.ndarray:
    """A column of 16-byte keys (Arrow binary(16), or binary) as a numpy array of 16-byte void scalars (sortable,
    comparable)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_fixed_size_binary(column.type):
        column = column.cast(pa.binary(KEY_BYTES))  # (fails on a key of another length)
    data = np.frombuffer(column.buffers()[1], dtype=np.uint8)[column.offset * KEY_BYTES :]
    return np.ascontiguousarray(data[: len(column) * KEY_BYTES]).view(f"V{KEY_BYTES}")


# ------------------------------------------------------------------------------------------ match


@dataclass
class Match:
    """How the rows of a dataset meet the rows a cache holds (both as content keys, in order)."""

    new: np.ndarray  # (n,) bool: the dataset's row is not in the cache (with multiplicity)
    missing: np.ndarray  # (m,) bool: the cache's row is not in the dataset


def match_keys(held: np.ndarray, given: np.ndarray) -> Match:
    """Match `given` keys against `held` ones with multiplicity: the k-th occurrence of a key in `given` is held
    when the cache holds it at least k times; the cache's occurrences beyond the dataset's count are missing (the
    later ones). Sorting, no Python objects per row."""
    both = np.concatenate([held, given])
    _, group = np.unique(both, return_inverse=True)
    group = group.ravel()
    held_group, given_group = group[: len(held)], group[len(held) :]
    held_count = np.bincount(held_group, minlength=group.max() + 1 if len(group) else 0)
    given_count = np.bincount(given_group, minlength=len(held_count))
    return Match(
        new=_occurrence(given_group) >= held_count[given_group],
        missing=_occurrence(held_group) >= given_count[held_group],
    )


def _occurrence(group: np.ndarray) -> np.ndarray:
    """For each element, how many elements of the same group come before it (0 for the first)."""
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    starts = np.flatnonzero(np.r_[True, sorted_group[1:] != sorted_group[:-1]]) if len(group) else np.array([], int)
    first = np.repeat(starts, np.diff(np.r_[starts, len(group)]))
    occurrence = np.empty(len(group), dtype=np.int64)
    occurrence[order] = np.arange(len(group)) - first
    return occurrence


# --------------------------------------------------------------------------------------- segments


def keys_name(segment: int) -> str:
    return f"{KEY_DIR}/segment-{segment:05d}.arrow"


def write_keys(cache_dir: Path, segment: int, example_ids: np.ndarray, keys: np.ndarray, kept: np.ndarray) -> dict:
    """Write a segment's keys file atomically (as shards are written); returns its entry: file, rows, bytes, sha256."""
    table = pa.table(
        {
            "example_id": pa.array(example_ids, pa.int64()),
            "key": pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(KEY_BYTES), len(keys), [None, pa.py_buffer(np.ascontiguousarray(keys).tobytes())]
            ),
            "kept": pa.array(kept, pa.bool_()),
        },
        schema=KEYS_SCHEMA,
    )
    return write_table(cache_dir, keys_name(segment), table)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def new_segment(
    index: int,
    *,
    source: dict[str, Any],
    first_example_id: int,
    normalized_rows: int,
    rows: int,
    desirable: int,
    dropped: dict[str, int],
    conversational: bool,
    matched_rows: int,
    pairs: dict[str, int] | None,
    kl: dict[str, Any],
    keys: dict[str, Any],
) -> dict[str, Any]:
    """A segment's manifest entry (its `shards` are filled in as they are written).

    `source`: name_or_path, config, split, content_hash, source_rows of the dataset it came from. Example ids
    `first_example_id` .. + `normalized_rows` - 1 are its normalized rows (kept or dropped). `matched_rows`: rows of
    that dataset the cache already held (not scored again). `pairs`: {complete, rows_without_partner} of its rows
    (`Manifest.pairs`; None in a cache of format version 1, which does not record pairs). `kl`: how its rows' KL
    partners were drawn."""
    return {
        "index": index,
        "source": source,
        "written_at": now(),
        "first_example_id": first_example_id,
        "normalized_rows": normalized_rows,
        "rows": rows,
        "desirable": desirable,
        "dropped": dropped,
        "prompt_kind": "conversational" if conversational else "standard",
        "matched_rows": matched_rows,
        **({"pairs": pairs} if pairs is not None else {}),
        "kl": kl,
        "keys": keys,
        "shards": [],
    }


def held_keys(cache_dir: Path, manifest: Manifest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys, example ids, kept) of every normalized row the cache has seen, segment after segment."""
    require_keys(cache_dir, manifest)
    keys, ids, kept = [], [], []
    for seg in manifest.all_segments:
        table = read_keys(cache_dir, seg["keys"])
        keys.append(key_array(table.column("key")))
        ids.append(table.column("example_id").to_numpy())
        kept.append(table.column("kept").to_numpy(zero_copy_only=False))
    return np.concatenate(keys), np.concatenate(ids), np.concatenate(kept)


def require_keys(cache_dir: Path, manifest: Manifest) -> None:
    """Refuse a cache whose rows cannot be recognised: written before caches kept content keys."""
    if any(seg.get("keys") is None for seg in manifest.all_segments):
        raise KTOPipelineError(
            f"cache {cache_dir} was written before caches kept content keys (kto-pipeline "
            f"{manifest.tool_version}), so its rows cannot be recognised in a new dataset. Run `kto-pipeline "
            "precompute` once more on its data with this version (--overwrite), then append to it."
        )
