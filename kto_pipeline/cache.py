"""The reference cache: the contract between the two stages (docs/cache-format.md).

    CACHE_DIR/manifest.json
    CACHE_DIR/shards/shard-00000.arrow ...   Arrow IPC *stream* files, one row per example

Writing is crash-safe: a shard is written under a temporary name, flushed, fsynced and renamed,
and the manifest (also replaced atomically) lists only finished shards, so a killed precompute
leaves a cache that says exactly what it holds. Reading is memory-mapped: training touches only
the rows of the current batch, so a cache larger than RAM trains.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kto_pipeline.errors import KTOPipelineError

FORMAT_VERSION = 2  # what this version writes
READABLE_VERSIONS = (1, 2)  # what it reads: version 1 is version 2 without the pairs
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
NO_PAIR = -1


def shard_schema(version: int | None) -> pa.Schema:
    """The schema of a cache's shards: a cache keeps the format version it was written in, appends included."""
    return SCHEMA_V1 if version == 1 else SCHEMA


def completion_room(prompt_ids, max_length: int) -> int:
    """How many completion tokens a sequence keeps after `prompt_ids`: sequences are truncated on the right at
    `max_length` (trl's rule), the prompt whole (a row whose prompt alone reaches max_length is dropped)."""
    return max_length - len(prompt_ids)


def token_sum(values) -> float:
    """A sequence log-prob from its per-token float32 values: summed one token after the other, in float32.

    This is the order in which training sums the policy's token log-probs (`index_add` on the CPU), so that a
    policy equal to the reference gives a reward of exactly 0 (numpy's pairwise `sum` rounds differently: 1.6e-3
    apart over 1000 tokens)."""
    values = np.asarray(values, dtype=np.float32)
    return float(np.cumsum(values, dtype=np.float32)[-1]) if len(values) else 0.0


# ------------------------------------------------------------------------------------------ hashing


def sha256_file(path: str | Path, into=None) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks; with `into` (a hashlib object), feed it the bytes too."""
    h = hashlib.sha256() if into is None else into
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """Hash of what decides token ids: the vocabulary, the special tokens and the chat template."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "added_tokens": sorted((str(t), i) for i, t in tokenizer.added_tokens_decoder.items()),
        "chat_template": tokenizer.chat_template,
    }
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class WeightsHash:
    """sha256 over each tensor's name, dtype, shape and bytes, in the order they are added (`model_weights_hash`).
    A tensor's bytes may come in pieces (`add_bytes` again), as a partitioned parameter's partitions do."""

    def __init__(self):
        self._sha = hashlib.sha256()

    def add_header(self, name: str, dtype, shape) -> None:
        self._sha.update(f"{name}|{dtype}|{tuple(shape)}".encode())

    def add_bytes(self, tensor) -> None:
        import torch

        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            self._sha.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # no copy of the bytes

    def add(self, name: str, tensor) -> None:
        """A whole tensor: its header, then its bytes."""
        self.add_header(name, tensor.dtype, tensor.shape)
        self.add_bytes(tensor)

    def hexdigest(self) -> str:
        return "sha256:" + self._sha.hexdigest()


def model_weights_hash(tensors) -> str:
    """Hash of the weights as loaded (names, dtypes, shapes and bytes), streamed tensor by tensor: `tensors`, the
    (name, tensor) pairs of the model's state dict in name order (`Engine.weights_hash` gives them)."""
    h = WeightsHash()
    for name, tensor in tensors:
        h.add(name, tensor)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ manifest


class Manifest(dict):
    """manifest.json (docs/cache-format.md): the dict that is written, plus typed accessors for what the other
    modules read. Built by `new_manifest` (precompute), read by `read_manifest`; nothing else spells its keys."""

    @property
    def complete(self) -> bool:
        return bool(self.get("complete"))

    @property
    def format_version(self) -> int | None:
        return self.get("format_version")

    @property
    def tool_version(self) -> str:
        return self.get("tool", {}).get("version", "?")

    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.get("shards", [])

    @property
    def reference(self) -> dict[str, Any]:
        """name_or_path, revision, weights_hash, architecture."""
        return self["reference_model"]

    @property
    def reference_model(self) -> str:
        return self["reference_model"]["name_or_path"]

    @property
    def reference_revision(self) -> str | None:
        return self["reference_model"].get("revision")

    @property
    def tokenizer(self) -> dict[str, Any]:
        """name_or_path, hash, eos_token, pad_token_id."""
        return self["tokenizer"]

    @property
    def tokenizer_name(self) -> str:
        return self["tokenizer"]["name_or_path"]

    @property
    def tokenizer_hash(self) -> str:
        return self["tokenizer"]["hash"]

    @property
    def dataset(self) -> dict[str, Any]:
        """name_or_path, config, split, content_hash, source_rows, normalized_rows."""
        return self["dataset"]

    @property
    def settings(self) -> dict[str, Any]:
        """What shaped the values: max_length, dtype (of the weights), autocast, kl_seed."""
        return self["settings"]

    @property
    def max_length(self) -> int:
        return self["settings"]["max_length"]

    @property
    def precision(self) -> tuple[str, str | None]:
        """(weights dtype, autocast dtype or None) of the reference pass."""
        return self["settings"]["dtype"], self["settings"].get("autocast")

    @property
    def counts(self) -> dict[str, Any]:
        """rows, desirable, undesirable, dropped ({reason: rows})."""
        return self["counts"]

    @property
    def has_kl(self) -> bool:
        """Whether the rows hold KL completions and their reference log-probs (False: `precompute --pairs-only`)."""
        return self["settings"].get("kl_completions", True)

    @property
    def pairs(self) -> dict[str, int]:
        """complete: pairs with both rows in the cache; rows_without_partner: rows of paired data whose other row
        is not (dropped, or held before an append). Zeros for unpaired data and for format version 1, which did
        not record pairs."""
        return self["counts"].get("pairs") or {"complete": 0, "rows_without_partner": 0}

    @property
    def paired(self) -> bool:
        """Whether the cache holds at least one whole (chosen, rejected) pair, what a pair loss trains on."""
        return self.pairs["complete"] > 0

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.get("fingerprint", {})

    @property
    def timing(self) -> dict[str, Any]:
        """Of the precompute run that completed the cache (empty until then)."""
        return self.get("timing", {})

    def add_shards(self, entries: list[dict[str, Any]]) -> None:
        """Record finished shards (`write_shard`'s entries), in file order."""
        self["shards"].extend(sorted(entries, key=lambda e: e["file"]))

    @property
    def segments(self) -> list[dict[str, Any]]:
        """The segments the cache was written in (`stages/precompute/segments.py`); empty for a cache written
        before them."""
        return self.get("segments", [])

    @property
    def all_segments(self) -> list[dict[str, Any]]:
        """The recorded segments; a cache written before segments existed is one segment without keys."""
        if self.segments:
            return self.segments
        dataset, counts = self.dataset, self.counts
        source = ("name_or_path", "config", "split", "content_hash", "source_rows")
        return [
            {
                "index": 0,
                "source": {k: dataset.get(k) for k in source},
                "written_at": None,
                "first_example_id": 0,
                "normalized_rows": dataset.get("normalized_rows"),
                "rows": counts["rows"],
                "desirable": counts["desirable"],
                "dropped": counts["dropped"],
                "prompt_kind": None,
                "matched_rows": 0,
                "kl": {"rule": "cycle over the segment's rows", "seed": self.settings.get("kl_seed")},
                "keys": None,
                "shards": [s["file"] for s in self.shards],
            }
        ]

    @property
    def next_example_id(self) -> int:
        """The example id the next appended row gets: after every normalized row of the cache, kept or dropped."""
        last = self.all_segments[-1]
        return last["first_example_id"] + last["normalized_rows"]

    def start_segments(self, first: dict[str, Any]) -> None:
        """A new cache: `first` is its one segment."""
        self["segments"] = [first]

    @property
    def appending(self) -> dict[str, Any] | None:
        """An append in progress: {"segment": its manifest entry, "shards": its finished shards}; None otherwise.
        Readers never see it: the cache's shards, segments and counts stay the old cache's until it finishes."""
        return self.get("appending")

    def take_appending(self) -> dict[str, Any] | None:
        """Remove and return the record of an interrupted append (None if there is none)."""
        return self.pop("appending", None)

    def start_append(self, segment: dict[str, Any], done_shards: list[dict[str, Any]]) -> None:
        """Record `segment` as being appended (`done_shards`: its shards already written)."""
        self["segments"] = self.all_segments  # (a cache of one segment may predate the list)
        self["appending"] = {"segment": segment, "shards": done_shards}

    def finish_append(self) -> None:
        """The append's shards are all written: its segment, shards and rows join the cache."""
        pending = self.pop("appending")
        self.add_segment(pending["segment"], pending["shards"])

    def add_segment(self, segment: dict[str, Any], shards: list[dict[str, Any]]) -> None:
        """Add an appended segment and its shards, and its rows to the counts."""
        self["segments"].append(segment)
        self.add_shards(shards)
        counts = self["counts"]
        counts["rows"] += segment["rows"]
        counts["desirable"] += segment["desirable"]
        counts["undesirable"] = counts["rows"] - counts["desirable"]
        for reason, rows in segment["dropped"].items():
            counts["dropped"][reason] = counts["dropped"].get(reason, 0) + rows
        if "pairs" in counts and segment.get("pairs"):
            counts["pairs"] = {k: counts["pairs"][k] + segment["pairs"][k] for k in counts["pairs"]}

    def mark_complete(self, timing: dict[str, Any]) -> None:
        """Every shard is written: the cache may be trained on. `timing`: of the run that completed it."""
        self["complete"] = True
        self["timing"] = timing


def new_manifest(
    fingerprint: dict[str, Any],
    *,
    tool_version: str,
    architecture: str,
    eos_token: str | None,
    pad_token_id: int | None,
    source_rows: int,
    normalized_rows: int,
    desirable: int,
    rows: int,
    dropped: dict[str, int],
    pairs: dict[str, int],
    padded_because: str | None,
    distributed: dict[str, Any],
    attention_kernel: str | None = None,
    shards: list[dict[str, Any]],
) -> Manifest:
    """The manifest of a cache being written (`complete` False until its last shard is recorded).

    `fingerprint`: what shapes the values (model, revision, weights hash, tokenizer hash, dataset, config, split,
    content hash, max_length, dtype and autocast, kl_seed, shard_size); a cache is reused only when it matches.
    `padded_because`: why the reference pass ran every sequence on its own, padded; None when it ran packed.
    `pairs`: {complete, rows_without_partner} (`Manifest.pairs`).
    `attention_kernel`: how its packed rows attended (`attention.attention_kernel`).
    `distributed`: how the reference ran, e.g. {"engine": "fsdp2", "world_size": 2} (not in the fingerprint: the
    values do not depend on it)."""
    return Manifest(
        {
            "format_version": FORMAT_VERSION,
            "tool": {"name": "kto-pipeline", "version": tool_version},
            "complete": False,
            "reference_model": {
                "name_or_path": fingerprint["model"],
                "revision": fingerprint["model_revision"],
                "weights_hash": fingerprint["model_hash"],
                "architecture": architecture,
            },
            "tokenizer": {
                "name_or_path": fingerprint["model"],
                "hash": fingerprint["tokenizer_hash"],
                "eos_token": eos_token,
                "pad_token_id": pad_token_id,
            },
            "dataset": {
                "name_or_path": fingerprint["dataset"],
                "config": fingerprint["dataset_config"],
                "split": fingerprint["split"],
                "content_hash": fingerprint["dataset_hash"],
                "source_rows": source_rows,
                "normalized_rows": normalized_rows,
            },
            "settings": {
                "max_length": fingerprint["max_length"],
                "dtype": fingerprint["dtype"],
                "autocast": fingerprint["autocast"],
                "kl_seed": fingerprint["kl_seed"],
                **({"kl_completions": False} if fingerprint.get("kl_completions") is False else {}),
            },
            "counts": {
                "rows": rows,
                "desirable": desirable,
                "undesirable": rows - desirable,
                "dropped": dropped,
                "pairs": pairs,
            },
            "fingerprint": fingerprint,
            # (the cache format's names for packed / padded)
            "reference_pass": {
                "prefix_shared": padded_because is None,
                **({"unshared_because": padded_because} if padded_because else {}),
                **({"attention_kernel": attention_kernel} if attention_kernel and not padded_because else {}),
            },
            "distributed": distributed,
            "shards": shards,
        }
    )


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between a cache's fingerprint and this run's, one line each."""
    return [f"{k}: cache has {old.get(k)!r}, this run has {v!r}" for k, v in new.items() if old.get(k) != v]


# ------------------------------------------------------------------------------------------ writing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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
    _fsync_dir(final.parent)
    return {"file": name, "rows": table.num_rows, "bytes": final.stat().st_size, "sha256": sha256_file(final)}


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
        readable = " and ".join(str(v) for v in READABLE_VERSIONS)
        raise KTOPipelineError(
            f"cache {cache_dir}: format version {version!r}, this kto-pipeline reads versions {readable}. "
            "Re-run `kto-pipeline precompute` with this version, or use the version that wrote it."
        )
    return Manifest(manifest)


def check_cache(cache_dir: str | Path, manifest: Manifest, full: bool = False) -> list[str]:
    """Problems with a cache, cheapest checks first: completeness, files, sizes, schema, row counts;
    with `full`, also every shard's sha256 and the KL partner ids. An empty list means the cache is sound."""
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
        if full and sha256_file(path) != shard["sha256"]:
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
