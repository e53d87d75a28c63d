"""The reference cache: the contract between the two stages (docs/cache-format.md).

    CACHE_DIR/manifest.json
    CACHE_DIR/shards/shard-00000.arrow ...   Arrow IPC *stream* files, one row per example

Writing is crash-safe: a shard is written under a temporary name, flushed, fsynced and renamed,
and the manifest (also replaced atomically) lists only finished shards, so a killed precompute
leaves a cache that says exactly what it holds. Reading is memory-mapped: training touches only
the rows of the current batch, so a cache larger than RAM trains. This folder holds the contract: this module reads
and writes the files; what the manifest says (its typed accessors, building it, comparing fingerprints) is
`manifest.py`; `inspect.py` is `kto-pipeline inspect`, what a cache holds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kto_pipeline.cache.manifest import FORMAT_VERSION, READABLE_VERSIONS, Manifest
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.files import atomic_write_text, fsync_dir, remember_verified, sha256_file, sha256_matches

MANIFEST = "manifest.json"
SHARD_DIR = "shards"

SCHEMA_V1 = pa.schema(
    [
        ("example_id", pa.int64()),
        ("label", pa.bool_()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("kl_example_id", pa.int64()),
        ("kl_completion_ids", pa.list_(pa.int32())),
        ("ref_logp", pa.float32()),
        ("ref_kl_logp", pa.float32()),
        ("ref_token_logps", pa.list_(pa.float32())),
        ("ref_kl_token_logps", pa.list_(pa.float32())),
    ]
)
# pair_example_id: the example id of the other row of the (chosen, rejected) pair this row came from; -1 when the row
# came from unpaired data or its partner is not in the cache (dropped by the max_length rules, or in the cache
# before the append that added this row)
SCHEMA = SCHEMA_V1.append(pa.field("pair_example_id", pa.int64()))
# version 3, rows with images: image_row, the row of the dataset whose images the prompt holds (the KL completion is
# scored under the same images); image_hashes, the sha256 of each image's decoded pixels, in prompt order
IMAGE_SCHEMA = SCHEMA.append(pa.field("image_row", pa.int64())).append(pa.field("image_hashes", pa.list_(pa.string())))
NO_PAIR = -1


def shard_schema(version: int | None) -> pa.Schema:
    """The schema of a cache's shards: a cache keeps the format version it was written in, appends included."""
    return {1: SCHEMA_V1, 3: IMAGE_SCHEMA}.get(version, SCHEMA)


def completion_room(prompt_ids, max_length: int) -> int:
    """How many completion tokens a sequence keeps after `prompt_ids`: sequences are truncated on the right at
    `max_length` (trl's rule), the prompt whole (a row whose prompt alone reaches max_length is dropped)."""
    return max_length - len(prompt_ids)


def token_sum(values) -> float:
    """A sequence log-prob from its per-token float32 values: summed in float64, one token after the other, and
    rounded to float32 once.

    Training sums the policy's token log-probs so too (`scoring.logprobs.sequence_sums`), so that a policy equal to the
    reference gives a reward of exactly 0: the same additions in the same order on the CPU; on a GPU (whose
    index_add adds in any order) float64 sums about 1e-16 apart, a difference the rounding to float32 drops unless
    the sum lies that close to a float32 rounding boundary (an estimate: about one sequence in 10^7). Summed in
    float32, one order against another differs in the last bits (numpy's pairwise `sum` against a running sum:
    1.6e-3 apart over 1000 tokens). Caches written before this summed in float32; training sums every row's cached
    values again (`objectives.items.with_sums`), whichever version wrote them."""
    values = np.asarray(values, dtype=np.float32)
    return float(np.float32(np.cumsum(values, dtype=np.float64)[-1])) if len(values) else 0.0


# ------------------------------------------------------------------------------------------ writing


def shard_name(index: int) -> str:
    return f"{SHARD_DIR}/shard-{index:05d}.arrow"


def write_shard(cache_dir: Path, index: int, rows: dict[str, list], version: int = FORMAT_VERSION) -> dict[str, Any]:
    """Write one shard atomically in the cache's format `version` (its columns, of `rows`); returns its manifest
    entry (file, rows, bytes, sha256)."""
    schema = shard_schema(version)
    table = pa.Table.from_pydict({name: rows[name] for name in schema.names}, schema=schema)
    return write_table(cache_dir, shard_name(index), table)


def write_table(cache_dir: Path, name: str, table: pa.Table) -> dict[str, Any]:
    """Write `table` as the Arrow IPC stream file `cache_dir/name`, atomically: under a temporary name, fsynced,
    then renamed. Returns its manifest entry: file, rows, bytes, sha256."""
    final = cache_dir / name
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)
    digest = sha256_file(final)
    remember_verified(final, digest)  # read back from the disk: training need not read it again
    return {"file": name, "rows": table.num_rows, "bytes": final.stat().st_size, "sha256": digest}


def write_manifest(cache_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_text(cache_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")


# ------------------------------------------------------------------------------------------ reading


def read_manifest(cache_dir: str | Path) -> Manifest:
    cache_dir = Path(cache_dir)
    path = cache_dir / MANIFEST
    if not cache_dir.exists():
        raise KTOPipelineError(f"cache {cache_dir}: no such directory. Run `kto-pipeline precompute` first.")
    if not path.exists():
        raise KTOPipelineError(
            f"cache {cache_dir}: no {MANIFEST}; this is not a kto-pipeline cache. "
            "Point --cache at a directory written by `kto-pipeline precompute`."
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise KTOPipelineError(f"cache {cache_dir}: {MANIFEST} is not valid JSON ({exc}).") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        *first, last = (str(v) for v in READABLE_VERSIONS)
        readable = f"{', '.join(first)} and {last}"
        raise KTOPipelineError(
            f"cache {cache_dir}: format version {version!r}, this kto-pipeline reads versions {readable}. "
            "Re-run `kto-pipeline precompute` with this version, or use the version that wrote it."
        )
    return Manifest(manifest)


def check_cache(cache_dir: str | Path, manifest: Manifest, full: bool = False) -> list[str]:
    """Problems with a cache, cheapest checks first: completeness, files, sizes, schema, row counts, the sha256 of
    each shard not verified since it was written or last changed (`sha256_matches`); with `full`, every shard's
    sha256 again, the keys files' and the KL partner and pair ids. An empty list means the cache is sound."""
    cache_dir = Path(cache_dir)
    problems = []
    if not manifest.complete:
        problems.append(
            "the cache is incomplete (precompute did not finish); re-run the same `kto-pipeline precompute` "
            "command to finish it"
        )
    for shard in manifest.shards:
        path = cache_dir / shard["file"]
        if problem := _file_problem(cache_dir, shard):
            problems.append(problem)
            continue
        try:
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_stream(source)
                if not reader.schema.equals(shard_schema(manifest.format_version)):
                    problems.append(f"{shard['file']}: schema differs from the cache format")
                    continue
                rows = sum(batch.num_rows for batch in reader)
        except pa.ArrowInvalid as exc:
            problems.append(f"{shard['file']}: unreadable ({exc})")
            continue
        if rows != shard["rows"]:
            problems.append(f"{shard['file']}: {rows} rows, the manifest says {shard['rows']}")
        if not sha256_matches(path, shard["sha256"], again=full):
            problems.append(f"{shard['file']}: sha256 differs from the manifest (the file was altered or corrupted)")
    if not problems:
        problems += check_segments(cache_dir, manifest, full)
    if full and not problems and manifest.has_kl:
        problems += _check_kl_partners(cache_dir, manifest)
    if full and not problems and manifest.format_version != 1:
        problems += _check_pairs(cache_dir, manifest)
    return problems


def check_segments(cache_dir: Path, manifest: Manifest, full: bool) -> list[str]:
    """Problems with the segments: every shard in exactly one segment, row counts, keys files (size; with `full`
    their sha256 and the example ids of each segment's shards within its range)."""
    if not manifest.get("segments"):
        return []
    problems = []
    segments = manifest["segments"]
    by_file = {s["file"]: s for s in manifest.shards}
    listed = [f for seg in segments for f in seg["shards"]]
    if sorted(listed) != sorted(by_file):
        problems.append(
            f"the segments list {len(listed)} shards, the manifest {len(by_file)}: they must name the same files"
        )
        return problems
    for seg in segments:
        name = f"segment {seg['index']}"
        rows = sum(by_file[f]["rows"] for f in seg["shards"])
        if rows != seg["rows"]:
            problems.append(f"{name}: its shards hold {rows} rows, the manifest says {seg['rows']}")
        keys = seg.get("keys")
        if keys is None:
            continue
        path = cache_dir / keys["file"]
        if problem := _file_problem(cache_dir, keys):
            problems.append(problem)
            continue
        if not full:
            continue
        if sha256_file(path) != keys["sha256"]:
            problems.append(f"{keys['file']}: sha256 differs from the manifest (the file was altered or corrupted)")
            continue
        table = read_keys(cache_dir, keys)
        first, count = seg["first_example_id"], seg["normalized_rows"]
        ids = table.column("example_id").to_numpy()
        if len(ids) != count or (len(ids) and (ids.min() < first or ids.max() >= first + count)):
            problems.append(f"{keys['file']}: example ids are not {first}..{first + count - 1}")
        if int(table.column("kept").to_numpy().sum()) != seg["rows"]:
            problems.append(f"{keys['file']}: its kept rows are not the segment's {seg['rows']} rows")
        for file in seg["shards"]:
            with pa.memory_map(str(cache_dir / file)) as source:
                shard_ids = pa.ipc.open_stream(source).read_all().column("example_id").to_numpy()
            if len(shard_ids) and (shard_ids.min() < first or shard_ids.max() >= first + count):
                problems.append(f"{file}: example ids outside {name}'s range {first}..{first + count - 1}")
    return problems


def read_keys(cache_dir: Path, entry: dict[str, Any]) -> pa.Table:
    with pa.memory_map(str(cache_dir / entry["file"])) as source:
        return pa.ipc.open_stream(source).read_all()


def _file_problem(cache_dir: Path, entry: dict[str, Any]) -> str | None:
    """A listed file (a shard, a keys file) that is missing or not the size its manifest entry says."""
    path = cache_dir / entry["file"]
    if not path.exists():
        return f"{entry['file']}: missing"
    if path.stat().st_size != entry["bytes"]:
        return f"{entry['file']}: {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
    return None


def _shard_columns(cache_dir: Path, manifest: Manifest, columns: list[str]) -> pa.Table | None:
    """`columns` of every shard of the cache, as one table (None: no shard)."""
    tables = []
    for shard in manifest.shards:
        with pa.memory_map(str(cache_dir / shard["file"])) as source:
            tables.append(pa.ipc.open_stream(source).read_all().select(columns))
    return pa.concat_tables(tables) if tables else None


def _check_kl_partners(cache_dir: Path, manifest: Manifest) -> list[str]:
    """Every kl_example_id must name a row of the cache, and never the row itself."""
    table = _shard_columns(cache_dir, manifest, ["example_id", "kl_example_id"])
    if table is None:
        return []
    ids, partners = table.column("example_id").to_numpy(), table.column("kl_example_id").to_numpy()
    problems = []
    unknown = partners[~np.isin(partners, ids)]
    if len(unknown):
        problems.append(f"{len(unknown)} kl_example_id values name no row of the cache (e.g. {unknown[:3].tolist()})")
    own = ids[partners == ids]
    if len(own):
        problems.append(f"{len(own)} rows are their own KL partner (e.g. example_id {own[:3].tolist()})")
    return problems


def _check_pairs(cache_dir: Path, manifest: Manifest) -> list[str]:
    """Every pair_example_id names a row of the cache that names this row back, with the other label and the same
    prompt; the manifest counts as many pairs."""
    table = _shard_columns(cache_dir, manifest, ["example_id", "label", "prompt_ids", "pair_example_id"])
    if table is None:
        return []
    ids, partners = table.column("example_id").to_numpy(), table.column("pair_example_id").to_numpy()
    paired = np.flatnonzero(partners != NO_PAIR)
    where = {int(i): k for k, i in enumerate(ids)}
    unknown = [int(partners[k]) for k in paired if int(partners[k]) not in where]
    if unknown:
        return [f"{len(unknown)} pair_example_id values name no row of the cache (e.g. {unknown[:3]})"]
    other = np.array([where[int(partners[k])] for k in paired], dtype=np.int64)
    labels = table.column("label").to_numpy(zero_copy_only=False)
    problems = []
    bad = paired[(partners[other] != ids[paired]) | (labels[other] == labels[paired])]
    if len(bad):
        example = ids[bad[:3]].tolist()
        problems.append(
            f"{len(bad)} rows are not their partner's partner, or have its label (e.g. example_id {example})"
        )
    prompts = table.column("prompt_ids")
    differ = [int(ids[k]) for k, o in zip(paired, other, strict=True) if prompts[int(k)] != prompts[int(o)]]
    if differ:
        problems.append(f"{len(differ)} rows do not share their pair partner's prompt (e.g. example_id {differ[:3]})")
    if len(paired) != 2 * manifest.pairs["complete"]:
        problems.append(
            f"{len(paired)} rows have a pair partner, the manifest counts {manifest.pairs['complete']} pairs"
        )
    return problems


@dataclass
class CacheTable:
    """All shards of a cache as one memory-mapped Arrow table (no row is copied until it is read)."""

    table: pa.Table
    manifest: Manifest

    def __len__(self) -> int:
        return self.table.num_rows


def open_cache(cache_dir: str | Path, verify: bool = False) -> CacheTable:
    """Validate a cache (see `check_cache`) and map its shards; raises KTOPipelineError naming each problem."""
    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    problems = check_cache(cache_dir, manifest, full=verify)
    if problems:
        listed = "\n  - ".join(problems)
        raise KTOPipelineError(
            f"cache {cache_dir} cannot be used:\n  - {listed}\n"
            "Re-run `kto-pipeline precompute` (with --overwrite to start over)."
        )
    tables = []
    for shard in manifest.shards:
        source = pa.memory_map(str(cache_dir / shard["file"]))
        tables.append(pa.ipc.open_stream(source).read_all())
    table = pa.concat_tables(tables) if tables else shard_schema(manifest.format_version).empty_table()
    return CacheTable(table=table, manifest=manifest)
