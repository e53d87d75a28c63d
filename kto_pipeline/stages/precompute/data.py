"""Source data -> tokenized, KL-paired rows: the first three arrows of the data flow (docs/design.md).

    load_source     a hub id, a data file or a save_to_disk directory -> datasets.Dataset
    check_source    columns, types, nulls and labels checked from Arrow before any heavy work
    preprocess      datasets.map (batched, --num-proc): normalize (unpaired / paired / implicit-prompt rows ->
                    prompt, completion, label) and tokenize with trl.KTOTrainer's semantics, into an Arrow
                    file in the datasets cache, reused by the next run on the same data and tokenizer
    select_rows     trl's drops, from the list lengths alone -> TokenizedRows (numpy indices into the table)
    assign_kl_partners   a fixed partner per row (never itself), from a seed

Nothing here holds the dataset as Python objects: a million rows cost a few numpy arrays, and the token
ids are read from the memory-mapped table a shard at a time.

Tokenization matches trl 1.16 exactly (tested against it): standard rows get EOS appended to the
completion; `prompt_ids = tok(prompt)` and `full = tok(prompt + completion)`, the completion
starting where the two diverge; conversational rows go through the chat template, the prompt with
`add_generation_prompt=True`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.files import sha256_file
from kto_pipeline.images import open_images, pixel_hash, tokenize_image_row
from kto_pipeline.sources import load_source  # noqa: F401  (the first step of the data flow, re-exported)

logger = logging.getLogger(__name__)

EXPECTED_COLUMNS = (
    "expected one of: prompt/completion/label (unpaired), prompt/chosen/rejected (paired), "
    "chosen/rejected (paired, implicit prompt)"
)


# ---------------------------------------------------------------------------------------------- load


def content_hash(name: str, dataset) -> str:
    """sha256 of a local file or directory's bytes; for hub datasets, the `datasets` fingerprint."""
    path = Path(name).expanduser()
    h = hashlib.sha256()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        return "fingerprint:" + str(getattr(dataset, "_fingerprint", ""))
    for file in files:
        h.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        sha256_file(file, into=h)
    return "sha256:" + h.hexdigest()


# ------------------------------------------------------------------------------------------ validate


def check_source(dataset) -> str:
    """Check a source's columns and their values before any heavy work; return its layout:
    "unpaired" (prompt/completion/label), "paired" (prompt/chosen/rejected) or "implicit" (chosen/rejected).

    Reads only the label column and the Arrow types, null masks and list lengths of the text columns, so a bad
    row deep in a million-row file is reported in seconds, naming its row number in the source, the column and
    what was expected."""
    columns = set(dataset.column_names)
    if len(dataset) == 0:
        raise KTOPipelineError("the dataset is empty: there are no rows to train on. Check --dataset and --split.")
    if {"completion", "label"} <= columns:
        if "prompt" not in columns:
            raise KTOPipelineError(
                f"the dataset has columns {sorted(columns)} but no 'prompt' column; {EXPECTED_COLUMNS}."
            )
        layout, texts = "unpaired", ("prompt", "completion")
    elif {"chosen", "rejected"} <= columns:
        layout = "paired" if "prompt" in columns else "implicit"
        texts = ("prompt", "chosen", "rejected") if "prompt" in columns else ("chosen", "rejected")
    else:
        hint = ""
        if "completion" in columns and "label" not in columns:
            hint = f" It has 'completion' but no 'label' column (true = desirable): {LABEL_FIRST}"
        elif "label" in columns:
            hint = " It has 'label' but no 'completion' column (rename your response column to 'completion')."
        raise KTOPipelineError(f"the dataset has columns {sorted(columns)}; {EXPECTED_COLUMNS}.{hint}")

    data = dataset.data
    kinds = {name: _column_kind(name, data.column(name)) for name in texts}
    first, *rest = texts
    for name in rest:
        if kinds[name] != kinds[first]:
            raise KTOPipelineError(
                f"row 0: the {_key(first)} is a {kinds[first]} but the {_key(name)} is a {kinds[name]}; use strings "
                "for both (standard) or message lists for both (conversational)."
            )
    if layout == "unpaired":
        column = data.column("label")
        if _is_json(column.type):
            for row, value in _json_values(column):
                _as_label(value, row)
            return layout
        if pa.types.is_boolean(column.type):
            bad = _first(pc.is_null(column))
        elif pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
            # is_in is false for nulls too: the first row that is null or not 0/1
            bad = _first(pc.invert(pc.is_in(column, value_set=pa.array([0, 1], type=column.type))))
        else:
            bad = 0
        if bad is not None:
            _as_label(column[bad].as_py(), bad)
    return layout


def _column_kind(name: str, column) -> str:
    """ "string" or "messages", the same for every row of the column, or an error naming the first bad row."""
    if _is_json(column.type):  # datasets' Json feature: a column mixing types, stored as JSON text
        kind = None
        for row, value in _json_values(column):
            value_kind = _value_kind(value, name)
            if value_kind is None:
                _bad_text(name, row, value)
            if kind is not None and value_kind != kind:
                raise KTOPipelineError(
                    f"row {row}: '{_key(name)}' is a {value_kind} but in the rows before it a {kind}; use strings "
                    "in every row (standard) or message lists in every row (conversational)."
                )
            kind = value_kind
        return kind or "string"
    kind = _text_kind(column.type)
    bad = _first(pc.is_null(column))
    if kind is None or bad is not None:
        row = bad if bad is not None else 0
        _bad_text(name, row, column[row].as_py())
    if kind == "messages" and name != "prompt":
        empty = _first(pc.equal(pc.list_value_length(column), 0))
        if empty is not None:
            _bad_text(name, empty, [])
    return kind


def _bad_text(name: str, row: int, value: Any) -> None:
    got = "an empty list" if value == [] else "None" if value is None else type(value).__name__
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        keys = sorted({k for m in value for k, v in m.items() if v is not None})
        got = f"messages with the keys {keys}"
    raise KTOPipelineError(
        f"row {row}: '{_key(name)}' must be a string or a non-empty list of {{role, content}} messages, got {got}."
    )


def _value_kind(value: Any, name: str) -> str | None:
    if isinstance(value, str):
        return "string"
    if is_conversational(value) or (value == [] and name == "prompt"):
        return "messages"
    return None


def _is_json(arrow_type) -> bool:
    return getattr(arrow_type, "extension_name", None) == "arrow.json"  # pa.JsonType (canonical extension)


def _json_values(column):
    """(row, decoded value) of a Json column, a chunk at a time."""
    row = 0
    for chunk in column.chunks:
        for text in chunk.storage.to_pylist():
            yield row, None if text is None else json.loads(text)
            row += 1


def _key(name: str) -> str:
    """Paired rows' answers are the completions of the unpaired rows they become."""
    return {"chosen": "completion", "rejected": "completion"}.get(name, name)


def _text_kind(arrow_type) -> str | None:
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        item = arrow_type.value_type
        if pa.types.is_null(item) or (
            pa.types.is_struct(item) and item.get_field_index("role") >= 0 and item.get_field_index("content") >= 0
        ):
            return "messages"  # list<null>: every list empty (allowed for prompts; completions are checked)
    return None


def _first(mask) -> int | None:
    """Index of the first true value of a boolean ChunkedArray, or None."""
    index = pc.index(mask, True).as_py()
    return None if index < 0 else index


# ----------------------------------------------------------------------------------------- normalize


def is_conversational(value: Any) -> bool:
    """A non-empty list of {role, content} messages (a message may have no content, an assistant's tool calls;
    not every one)."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m for m in value)
        and any(m.get("content") is not None for m in value)
    )


def extract_prompt(chosen, rejected):
    """Split the shared prefix off a chosen/rejected pair (strings or message lists), as trl does."""
    n = min(len(chosen), len(rejected))
    if n == 0:
        return chosen[:0], chosen, rejected
    idx = 0
    for idx in range(n):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # keep the space with the completion
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


LABEL_FIRST = (
    "the rows have no label; label them first: `kto-pipeline label FILE --label-with MODULE:FUNCTION --output "
    'OUT.jsonl` (your Python function), or set each row\'s "label" to true/false by hand.'
)


def _as_label(value: Any, row: int) -> bool:
    if value is None:  # generate --num-return-sequences writes rows unlabeled (label null)
        raise KTOPipelineError(f"row {row}: label is null: {LABEL_FIRST}")
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer) and value in (0, 1):
        return bool(value)
    if isinstance(value, float) and value in (0.0, 1.0):
        return bool(value)
    raise KTOPipelineError(
        f"row {row}: label {value!r} is not a boolean. Labels must be true/false (or 1/0): "
        "true = desirable, false = undesirable."
    )


def normalize_batch(batch: dict[str, list], indices: list[int], layout: str) -> list[tuple[int, dict[str, Any]]]:
    """A batch of source rows (columns -> values) -> (source row, unpaired row) pairs, with prompt, completion,
    label (+ tools, chat kwargs). A paired row becomes two rows, the desirable one first, so example ids 2i and
    2i+1 come from pair i."""
    extras = [c for c in ("tools", "chat_template_kwargs") if c in batch]
    out: list[tuple[int, dict[str, Any]]] = []
    for j, source_row in enumerate(indices):
        extra = {k: batch[k][j] for k in extras}
        if layout == "unpaired":
            label = _as_label(batch["label"][j], source_row)
            rows = [{"prompt": batch["prompt"][j], "completion": batch["completion"][j], "label": label, **extra}]
        else:
            if layout == "paired":
                prompt, chosen, rejected = batch["prompt"][j], batch["chosen"][j], batch["rejected"][j]
            else:
                prompt, chosen, rejected = extract_prompt(batch["chosen"][j], batch["rejected"][j])
            rows = [
                {"prompt": prompt, "completion": chosen, "label": True, **extra},
                {"prompt": prompt, "completion": rejected, "label": False, **extra},
            ]
        for row in rows:
            _check_row(row, source_row)
            out.append((source_row, row))
    return out


def _check_row(row: dict[str, Any], source_row: int) -> None:
    """The per-row form of `check_source`'s type checks (values that Arrow types cannot rule out)."""
    kinds = []
    for key in ("prompt", "completion"):
        kind = _value_kind(row[key], key)
        if kind is None:
            _bad_text(key, source_row, row[key])
        kinds.append(kind)
    if kinds[0] != kinds[1]:
        raise KTOPipelineError(
            f"row {source_row}: the prompt is a {kinds[0]} but the completion is a {kinds[1]}; use strings for "
            "both (standard) or message lists for both (conversational)."
        )


def normalize(dataset) -> list[dict[str, Any]]:
    """All rows of a (small) dataset as unpaired dicts: `check_source`, then `normalize_batch` in memory."""
    layout = check_source(dataset)
    return [row for _, row in normalize_batch(dataset[:], list(range(len(dataset))), layout)]


# ------------------------------------------------------------------------------------------ tokenize


def chat_ids(tokenizer, messages, row, **kwargs) -> list[int]:
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    ctk = row.get("chat_template_kwargs") or {}
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, tools=tools, **ctk, **kwargs)
    return list(out["input_ids"])


def tokenize_row(tokenizer, row: dict[str, Any], source_row: int = 0) -> tuple[list[int], list[int], bool]:
    """(prompt_ids, completion_ids, prompt_is_prefix) of one normalized row, with trl's semantics."""
    prompt, completion = row["prompt"], row["completion"]
    if is_conversational(prompt) or is_conversational(completion):
        if tokenizer.chat_template is None:
            raise KTOPipelineError(
                "the dataset is conversational (lists of {role, content} messages) but the tokenizer has no "
                "chat template. Use a chat/instruct model's tokenizer, or convert the rows to plain strings."
            )
        try:
            prompt_ids = chat_ids(tokenizer, prompt, row, add_generation_prompt=True)
            full_ids = chat_ids(tokenizer, prompt + completion, row)
        except Exception as exc:  # jinja raises for messages the template refuses (roles out of order, ...)
            raise KTOPipelineError(
                f"row {source_row}: the chat template refused its messages ({type(exc).__name__}: {exc})."
            ) from None
    else:
        eos = tokenizer.eos_token
        if eos is not None and not completion.endswith(eos):
            completion = completion + eos
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        full_ids = list(tokenizer(prompt + completion)["input_ids"])
    k = 0
    for a, b in zip(prompt_ids, full_ids, strict=False):
        if a != b:
            break
        k += 1
    return prompt_ids[:k], full_ids[k:], k == len(prompt_ids)


# The tokenized dataset: one row per normalized row (example id = row number), every row kept, untruncated, so
# that --max-length changes which rows are kept, never the cached tokens.
TOKENIZED_SCHEMA = pa.schema(
    [
        ("label", pa.bool_()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("prompt_is_prefix", pa.bool_()),
    ]
)
# Rows with images (vision-language data) also record which source row holds their images, the images' pixel
# hashes, and where the prompt's image tokens end (a max length before that would cut through them).
IMAGE_TOKENIZED_SCHEMA = (
    TOKENIZED_SCHEMA.append(pa.field("source_row", pa.int64()))
    .append(pa.field("image_hashes", pa.list_(pa.string())))
    .append(pa.field("image_end", pa.int32()))
)
PREPROCESS_VERSION = 1  # bump when normalize_batch or tokenize_row change what they produce


def _tokenized_columns(tokenizer, rows) -> dict[str, list]:
    """(source row, normalized row) pairs -> the columns of TOKENIZED_SCHEMA."""
    out: dict[str, list] = {name: [] for name in TOKENIZED_SCHEMA.names}
    for source_row, row in rows:
        prompt_ids, completion_ids, is_prefix = tokenize_row(tokenizer, row, source_row)
        out["label"].append(row["label"])
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(completion_ids)
        out["prompt_is_prefix"].append(is_prefix)
    return out


def _tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer, layout: str, images=None) -> dict[str, list]:
    """datasets.map function: source rows -> normalized, tokenized rows. `images`: (column, root) of a vision
    dataset, whose rows `tokenizer` (then the model's processor) tokenizes with their images."""
    if images is None:
        return _tokenized_columns(tokenizer, normalize_batch(batch, indices, layout))
    column, root = images
    out: dict[str, list] = {name: [] for name in IMAGE_TOKENIZED_SCHEMA.names}
    opened: dict[int, list] = {}
    for j, source_row in enumerate(indices):
        opened[source_row] = open_images(batch[column][j], column, root, source_row)
        if not opened[source_row]:
            raise KTOPipelineError(
                f"row {source_row}: no image in '{column}'. Every row of a dataset with images needs at least one "
                "(text-only rows mixed into image data are not supported); move text-only rows to a dataset of their "
                "own."
            )
    for source_row, row in normalize_batch(batch, indices, layout):
        pictures = opened[source_row]
        prompt_ids, completion_ids, image_end = tokenize_image_row(tokenizer, row, pictures, source_row)
        out["label"].append(row["label"])
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(completion_ids)
        out["prompt_is_prefix"].append(True)
        out["source_row"].append(source_row)
        out["image_hashes"].append([pixel_hash(picture) for picture in pictures])
        out["image_end"].append(image_end)
    return out


def preprocess_fingerprint(data_hash: str, tokenizer_hash: str) -> str:
    """The tokenized dataset's name in the datasets cache: data, tokenizer and this code's version."""
    from kto_pipeline import __version__

    key = json.dumps([data_hash, tokenizer_hash, PREPROCESS_VERSION, __version__])
    return "kto-" + hashlib.sha256(key.encode()).hexdigest()[:40]


def preprocess(source, tokenizer, fingerprint: str, layout: str, num_proc: int = 1, images=None):
    """Normalize and tokenize `source` with `datasets.map` (batched, `num_proc` processes) into an Arrow file in
    the datasets cache named by `fingerprint`: a second call with the same fingerprint reads that file instead.
    `layout` is `check_source(source)`'s answer. Returns the tokenized, memory-mapped `datasets.Dataset`; nothing
    of it is held as Python objects. `images`: (column, root) of a vision dataset; `tokenizer` is then the model's
    processor, and the table has IMAGE_TOKENIZED_SCHEMA."""
    kwargs = {"tokenizer": tokenizer, "layout": layout, "images": images}
    schema = TOKENIZED_SCHEMA if images is None else IMAGE_TOKENIZED_SCHEMA
    batch = 256 if images is None else 32  # a vision batch holds its decoded images
    return cached_map(source, _tokenize_batch, kwargs, schema, "tokenized", fingerprint, batch, num_proc, "tokenizing")


def cached_map(
    source,
    function,
    fn_kwargs: dict,
    schema: pa.Schema,
    kind: str,
    fingerprint: str,
    batch_size: int,
    num_proc: int,
    desc: str,
):
    """`source.map(function)` (batched, with indices, `num_proc` processes) into `kind-fingerprint.arrow` in the
    datasets cache, read back instead of computed when it exists; the result has `schema` and none of the source's
    columns. A failed map leaves no part of its file behind."""
    import datasets

    cache_file = preprocess_cache_dir() / f"{kind}-{fingerprint}.arrow"
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        return source.map(
            function,
            batched=True,
            batch_size=batch_size,
            with_indices=True,
            fn_kwargs=fn_kwargs,
            remove_columns=source.column_names,
            features=datasets.Features.from_arrow_schema(schema),
            num_proc=num_proc if num_proc > 1 and len(source) > 1 else None,
            cache_file_name=str(cache_file),
            new_fingerprint=fingerprint,
            load_from_cache_file=True,
            desc=desc,
        )
    except BaseException:
        # A worker that failed (a bad row, Ctrl-C) leaves the other workers' finished parts: useless without it
        for part in cache_file.parent.glob(f"{cache_file.stem}*"):
            part.unlink(missing_ok=True)
        raise


def open_arrow_files(files: list[str]) -> pa.Table:
    """The Arrow files a `cached_map` wrote, as one memory-mapped table."""
    import datasets

    return pa.concat_tables([datasets.Dataset.from_file(f).data.table for f in files])


def preprocess_cache_dir() -> Path:
    """Where tokenized datasets go: a folder of the datasets cache (HF_DATASETS_CACHE), never the user's data."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "kto_pipeline"


@dataclass
class TokenizedRows:
    """The rows of a tokenized dataset that survive filtering, in example-id order, read from Arrow on demand.

    `example_ids` are the kept rows' positions in `table` (one row per normalized row); only these numpy
    arrays (a few bytes per row) live in memory, the token ids stay in the memory-mapped table."""

    table: pa.Table  # TOKENIZED_SCHEMA, every normalized row
    example_ids: np.ndarray  # (n,) int64
    labels: np.ndarray  # (n,) bool
    dropped: Counter = field(default_factory=Counter)
    prefix_mismatches: int = 0

    def __len__(self) -> int:
        return len(self.example_ids)

    def take(self, positions: np.ndarray, column: str) -> list[list[int]]:
        """`column` (prompt_ids or completion_ids) of the kept rows at `positions`."""
        return self.table.column(column).take(pa.array(self.example_ids[positions])).to_pylist()


def select_rows(table: pa.Table, max_length: int, among: np.ndarray | None = None) -> TokenizedRows:
    """Keep the rows trl keeps: drop (and count) rows with an empty prompt, a prompt of `max_length` tokens or
    more, or an empty completion (an empty completion has no log-prob). Reads only labels and list lengths.
    `among`: the table's rows to consider (positions; an append's new rows), all when None."""
    prompt_len = pc.list_value_length(table.column("prompt_ids")).to_numpy()
    completion_len = pc.list_value_length(table.column("completion_ids")).to_numpy()
    considered = np.ones(len(prompt_len), dtype=bool)
    if among is not None:
        considered[:] = False
        considered[among] = True
    if "image_end" in table.column_names:  # a vision row: trl raises where max_length cuts through image tokens
        image_end = table.column("image_end").to_numpy()
        cut = np.flatnonzero(considered & (image_end > max_length))
        if len(cut):
            row, end = int(table.column("source_row")[int(cut[0])].as_py()), int(image_end[cut[0]])
            raise KTOPipelineError(
                f"row {row}: --max-length {max_length} would cut through its image tokens, which end at token {end} "
                f"({len(cut)} row(s) in all). Raise --max-length above {end}, or shorten the prompts."
            )
    empty_prompt = considered & (prompt_len == 0)
    too_long = considered & ~empty_prompt & (prompt_len >= max_length)
    empty_completion = considered & ~empty_prompt & ~too_long & (completion_len == 0)
    keep = considered & ~(empty_prompt | too_long | empty_completion)
    reasons = {
        "empty prompt": empty_prompt,
        f"prompt >= max_length ({max_length})": too_long,
        "empty completion": empty_completion,
    }
    dropped = Counter({reason: int(mask.sum()) for reason, mask in reasons.items() if mask.any()})
    prefix_mismatches = int((considered & ~table.column("prompt_is_prefix").to_numpy()).sum())
    if prefix_mismatches:
        logger.warning(
            "%d rows: the tokenized prompt is not a prefix of the tokenized prompt+completion (chat template "
            "or tokens merging across the boundary); their completion starts where the two diverge, as in trl.",
            prefix_mismatches,
        )
    example_ids = np.flatnonzero(keep).astype(np.int64)
    labels = table.column("label").to_numpy()[example_ids]
    return TokenizedRows(table, example_ids, labels, dropped, prefix_mismatches)


def tokenize(tokenizer, rows: list[dict[str, Any]], max_length: int) -> TokenizedRows:
    """In-memory form of `preprocess` + `select_rows` for a few normalized rows (tests, tools)."""
    columns = _tokenized_columns(tokenizer, enumerate(rows))
    return select_rows(pa.table(columns, schema=TOKENIZED_SCHEMA), max_length)


# -------------------------------------------------------------------------------------------- pair


def assign_kl_partners(num_rows: int, seed: int | list[int]) -> np.ndarray:
    """partner[i] = the row whose completion forms row i's KL sequence; never i itself.

    A seeded random cycle through all rows: every completion is used exactly once as a KL
    completion (as in trl's in-batch rotation), and the assignment depends only on the rows and
    the seed, not on the batch size or the number of processes.
    """
    if num_rows < 2:
        raise KTOPipelineError(
            f"KTO needs at least 2 rows to pair each prompt with another row's completion; got {num_rows}."
        )
    order = np.random.default_rng(seed).permutation(num_rows)
    partner = np.empty(num_rows, dtype=np.int64)
    partner[order] = np.roll(order, -1)
    return partner
