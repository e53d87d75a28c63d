"""manifest.json's contents (docs/cache-format.md): the dict that is written, with typed accessors for what the
other modules read, built by `new_manifest` and compared by `fingerprint_diff`.

No file is read or written here: the package's `__init__.py` reads and writes manifest.json, atomically with the
shards it lists. Kept apart from it so that what the manifest says (counts, segments, an append in progress) reads
in one place, and the files (schema, hashing, atomic writes, verification, memory-mapping) in the other.
"""

from __future__ import annotations

import hashlib
from typing import Any

FORMAT_VERSION = 2  # what this version writes for text data
IMAGE_FORMAT_VERSION = 3  # for data with images: version 2 plus each row's image row and pixel hashes
READABLE_VERSIONS = (1, 2, 3)  # what it reads: version 1 is version 2 without the pairs


class Manifest(dict):
    """manifest.json (docs/cache-format.md): the dict that is written, plus typed accessors for what the other
    modules read. Built by `new_manifest` (precompute), read by `cache.read_manifest`; nothing else spells its
    keys."""

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
    def content_id(self) -> str:
        """What the cache's rows are, whatever its path: a hash of its shards' sha256s (a cache made again, or
        appended to, has another; the same cache moved or copied, the same)."""
        listed = sorted(f"{s['file']}:{s['sha256']}" for s in self.shards)
        return "sha256:" + hashlib.sha256("\n".join(listed).encode()).hexdigest()

    @property
    def images(self) -> dict[str, Any] | None:
        """A cache of rows with images (format version 3): column, root, processor_hash, images; else None."""
        return self.get("images")

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
    images: dict[str, Any] | None = None,
    quantization: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest of a cache being written (`complete` False until its last shard is recorded).

    `fingerprint`: what shapes the values (model, revision, weights hash, tokenizer hash, dataset, config, split,
    content hash, max_length, dtype and autocast, kl_seed, shard_size); a cache is reused only when it matches.
    `padded_because`: why the reference pass ran every sequence on its own, padded; None when it ran packed.
    `pairs`: {complete, rows_without_partner} (`Manifest.pairs`).
    `attention_kernel`: how its packed rows attended (`attention.choose_kernel`).
    `distributed`: how the reference ran, e.g. {"engine": "fsdp2", "world_size": 2} (not in the fingerprint: the
    values do not depend on it).
    `images` (rows with images): {column, root, processor_hash, images}; the cache is then format version 3.
    `quantization`: how the reference's linear layers were quantized (`quantization.Quantization.record`), None:
    not quantized."""
    return Manifest(
        {
            "format_version": FORMAT_VERSION if images is None else IMAGE_FORMAT_VERSION,
            "tool": {"name": "kto-pipeline", "version": tool_version},
            "complete": False,
            "reference_model": {
                "name_or_path": fingerprint["model"],
                "revision": fingerprint["model_revision"],
                "weights_hash": fingerprint["model_hash"],
                "architecture": architecture,
                **({"quantization": quantization} if quantization else {}),
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
            **({"images": images} if images is not None else {}),
            "shards": shards,
        }
    )


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between a cache's fingerprint and this run's, one line each."""
    return [f"{k}: cache has {old.get(k)!r}, this run has {v!r}" for k, v in new.items() if old.get(k) != v]
