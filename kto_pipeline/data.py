"""Source data -> tokenized, KL-paired rows: the first three arrows of the data flow (DESIGN.md).

    load_source   a hub id, a data file or a save_to_disk directory -> datasets.Dataset
    normalize     unpaired / paired / implicit-prompt rows -> prompt, completion, label
    tokenize      prompt_ids, completion_ids with trl.KTOTrainer's semantics
    assign_kl_partners   a fixed partner per row (never itself), from a seed

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

from kto_pipeline.errors import KTOPipelineError

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
EXPECTED_COLUMNS = (
    "expected one of: prompt/completion/label (unpaired), prompt/chosen/rejected (paired), "
    "chosen/rejected (paired, implicit prompt)"
)


# ---------------------------------------------------------------------------------------------- load


def _looks_like_path(name: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else that does not exist is a mistyped path."""
    return name.startswith((".", "/", "~")) or Path(name).suffix in FILE_BUILDERS or name.count("/") > 1


def _is_empty_file(path: Path) -> bool:
    """True for a data file without a single row (datasets' own error for these is cryptic)."""
    if path.stat().st_size == 0:
        return True
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows == 0
    if suffix in (".json", ".jsonl"):
        with open(path, "rb") as f:
            head = f.read(64).strip()
        return head in (b"", b"[]")
    if suffix == ".csv":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip()) <= 1
    return False


def load_source(name: str, split: str = "train", config: str | None = None):
    """Load a dataset from a local file, a `save_to_disk` directory or the hub, as a `datasets.Dataset`."""
    import datasets

    path = Path(name).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise KTOPipelineError(
                    f"--dataset {name}: unsupported file type {path.suffix!r}; use "
                    f"{', '.join(sorted(FILE_BUILDERS))}, a save_to_disk directory or a hub id."
                )
            if _is_empty_file(path):
                raise KTOPipelineError(
                    f"--dataset {name}: the file holds no rows, so there is nothing to train on. Check the file."
                )
            if builder == "arrow":
                return datasets.Dataset.from_file(str(path))
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        if path.is_dir():
            if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
                loaded = datasets.load_from_disk(str(path))
                if isinstance(loaded, datasets.DatasetDict):
                    if split not in loaded:
                        raise KTOPipelineError(
                            f"--dataset {name} has splits {sorted(loaded)}, not {split!r}: "
                            "pass --split with one of them."
                        )
                    return loaded[split]
                return loaded
            return datasets.load_dataset(str(path), config, split=split)
        if _looks_like_path(name):
            raise KTOPipelineError(f"--dataset {name}: no such file or directory. Check the path.")
        return datasets.load_dataset(name, config, split=split)
    except KTOPipelineError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the message, not the stack
        raise KTOPipelineError(f"--dataset {name}: could not load it ({type(exc).__name__}: {exc})") from exc


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
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()


# ----------------------------------------------------------------------------------------- normalize


def is_conversational(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


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


def _as_label(value: Any, row: int) -> bool:
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


def normalize(dataset) -> list[dict[str, Any]]:
    """Rows of any supported format -> unpaired dicts with prompt, completion, label (+ tools, chat kwargs).

    Paired rows become two rows, the desirable one first: example ids 2i and 2i+1 come from pair i.
    """
    columns = set(dataset.column_names)
    if len(dataset) == 0:
        raise KTOPipelineError("the dataset is empty: there are no rows to train on. Check --dataset and --split.")
    extras = [c for c in ("tools", "chat_template_kwargs") if c in columns]
    rows: list[dict[str, Any]] = []
    if {"completion", "label"} <= columns:
        if "prompt" not in columns:
            raise KTOPipelineError(
                f"the dataset has columns {sorted(columns)} but no 'prompt' column; {EXPECTED_COLUMNS}."
            )
        for i, r in enumerate(dataset):
            rows.append(
                {
                    "prompt": r["prompt"],
                    "completion": r["completion"],
                    "label": _as_label(r["label"], i),
                    **{k: r[k] for k in extras},
                }
            )
    elif {"chosen", "rejected"} <= columns:
        for r in dataset:
            if "prompt" in columns:
                prompt, chosen, rejected = r["prompt"], r["chosen"], r["rejected"]
            else:
                prompt, chosen, rejected = extract_prompt(r["chosen"], r["rejected"])
            extra = {k: r[k] for k in extras}
            rows.append({"prompt": prompt, "completion": chosen, "label": True, **extra})
            rows.append({"prompt": prompt, "completion": rejected, "label": False, **extra})
    else:
        hint = ""
        if "completion" in columns and "label" not in columns:
            hint = " It has 'completion' but no 'label' column (true = desirable)."
        elif "label" in columns:
            hint = " It has 'label' but no 'completion' column (rename your response column to 'completion')."
        raise KTOPipelineError(f"the dataset has columns {sorted(columns)}; {EXPECTED_COLUMNS}.{hint}")
    for i, r in enumerate(rows):
        kinds = []
        for key in ("prompt", "completion"):
            value = r[key]
            if isinstance(value, str):
                kinds.append("string")
            elif is_conversational(value) or (value == [] and key == "prompt"):
                kinds.append("messages")
            else:
                raise KTOPipelineError(
                    f"row {i}: '{key}' must be a string or a non-empty list of {{role, content}} messages, got "
                    f"{type(value).__name__}."
                )
        if kinds[0] != kinds[1]:
            raise KTOPipelineError(
                f"row {i}: the prompt is a {kinds[0]} but the completion is a {kinds[1]}; use strings for both "
                "(standard) or message lists for both (conversational)."
            )
    return rows


# ------------------------------------------------------------------------------------------ tokenize


@dataclass
class TokenizedRows:
    """Tokenized rows that survive filtering, in example-id order."""

    example_ids: list[int]
    labels: list[bool]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # untruncated: KL partners are truncated against *another* prompt
    dropped: Counter = field(default_factory=Counter)
    prefix_mismatches: int = 0


def _chat_ids(tokenizer, messages, row, **kwargs) -> list[int]:
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    ctk = row.get("chat_template_kwargs") or {}
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, tools=tools, **ctk, **kwargs)
    return list(out["input_ids"])


def tokenize_row(tokenizer, row: dict[str, Any]) -> tuple[list[int], list[int], bool]:
    """(prompt_ids, completion_ids, prompt_is_prefix) of one normalized row, with trl's semantics."""
    prompt, completion = row["prompt"], row["completion"]
    if is_conversational(prompt) or is_conversational(completion):
        if tokenizer.chat_template is None:
            raise KTOPipelineError(
                "the dataset is conversational (lists of {role, content} messages) but the tokenizer has no "
                "chat template. Use a chat/instruct model's tokenizer, or convert the rows to plain strings."
            )
        prompt_ids = _chat_ids(tokenizer, prompt, row, add_generation_prompt=True)
        full_ids = _chat_ids(tokenizer, prompt + completion, row)
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


def tokenize(tokenizer, rows: list[dict[str, Any]], max_length: int) -> TokenizedRows:
    """Tokenize and filter rows. Rows whose prompt reaches `max_length`, or with an empty prompt or
    completion after tokenization, are dropped and counted (an empty completion has no log-prob)."""
    out = TokenizedRows([], [], [], [])
    for i, row in enumerate(rows):
        prompt_ids, completion_ids, is_prefix = tokenize_row(tokenizer, row)
        out.prefix_mismatches += not is_prefix
        if len(prompt_ids) == 0:
            out.dropped["empty prompt"] += 1
        elif len(prompt_ids) >= max_length:
            out.dropped[f"prompt >= max_length ({max_length})"] += 1
        elif len(completion_ids) == 0:
            out.dropped["empty completion"] += 1
        else:
            out.example_ids.append(i)
            out.labels.append(row["label"])
            out.prompt_ids.append(prompt_ids)
            out.completion_ids.append(completion_ids)
    if out.prefix_mismatches:
        logger.warning(
            "%d rows: the tokenized prompt is not a prefix of the tokenized prompt+completion (chat template "
            "or tokens merging across the boundary); their completion starts where the two diverge, as in trl.",
            out.prefix_mismatches,
        )
    return out


# -------------------------------------------------------------------------------------------- pair


def assign_kl_partners(num_rows: int, seed: int) -> np.ndarray:
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
