"""Anthropic's HH-RLHF as conversational paired data for a chat model.

HH-RLHF stores each comparison as two whole dialogues in plain text (`\\n\\nHuman: ...\\n\\nAssistant:
...`) that share every turn but the last assistant answer. A chat model wants messages instead, so a
pair becomes `{"prompt": [user/assistant turns but the last], "chosen": [last answer],
"rejected": [last answer]}`: the paired conversational format, rendered with the model's own chat
template at precompute time (as trl does). The role names map Human -> user, Assistant -> assistant.

A row that does not split into alternating turns, ending with an assistant answer and sharing
its prompt between chosen and rejected, is refused with its line number: silently skipping it
would change which rows a cache holds without anyone noticing.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from kto_pipeline.errors import KTOPipelineError

# The 1,200-pair sample shipped with the package (attribution in kto_pipeline/demo/assets/HH-RLHF-NOTICE.md).
BUNDLED = "hh-rlhf-harmless-base-test-0-1199.jsonl.gz"

_TURN = re.compile(r"\n\n(Human|Assistant): ?")
_ROLES = {"Human": "user", "Assistant": "assistant"}
EXPECTED = (
    "expected a dialogue of '\\n\\nHuman: ...' and '\\n\\nAssistant: ...' turns that starts with a Human turn "
    "and ends with an Assistant answer"
)


def bundled_path() -> Path:
    return Path(str(resources.files("kto_pipeline.demo") / "assets" / BUNDLED))


def split_dialogue(text: str, where: str) -> list[dict[str, str]]:
    """`\\n\\nHuman: a\\n\\nAssistant: b` -> [{"role": "user", "content": "a"}, {"role": "assistant", ...}]."""
    if not isinstance(text, str):
        raise KTOPipelineError(f"{where}: {EXPECTED}, got {type(text).__name__}.")
    parts = _TURN.split(text)
    # re.split with one group: [before, role, content, role, content, ...]
    if parts[0].strip() or len(parts) < 5:
        raise KTOPipelineError(f"{where}: {EXPECTED}; found {max(0, (len(parts) - 1) // 2)} turn(s).")
    if parts[1] != "Human":
        raise KTOPipelineError(f"{where}: {EXPECTED}; it starts with an {parts[1]} turn.")
    messages: list[dict[str, str]] = []
    for role, content in zip(parts[1::2], parts[2::2], strict=True):
        if messages and messages[-1]["role"] == _ROLES[role]:
            # The raw text has a few turns of one speaker in a row (a "Human:" typed inside an answer);
            # chat templates want alternating roles, so they are joined, as other HH-RLHF loaders do.
            messages[-1]["content"] += "\n\n" + content.strip()
        else:
            messages.append({"role": _ROLES[role], "content": content.strip()})
    if messages[-1]["role"] != "assistant":
        raise KTOPipelineError(f"{where}: {EXPECTED}; it ends with a Human turn.")
    return messages


def convert_pair(row: dict[str, Any], line: int) -> dict[str, list[dict[str, str]]]:
    """One HH-RLHF pair -> {"prompt": messages, "chosen": [answer], "rejected": [answer]}."""
    for key in ("chosen", "rejected"):
        if key not in row:
            raise KTOPipelineError(f"line {line}: no '{key}' field; HH-RLHF rows have 'chosen' and 'rejected'.")
    chosen = split_dialogue(row["chosen"], f"line {line}, 'chosen'")
    rejected = split_dialogue(row["rejected"], f"line {line}, 'rejected'")
    if chosen[:-1] != rejected[:-1]:
        raise KTOPipelineError(
            f"line {line}: 'chosen' and 'rejected' must share every turn but the last answer; they differ earlier."
        )
    return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}


def read_pairs(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, parsed row) of a .jsonl or .jsonl.gz file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield number, json.loads(text)
            except json.JSONDecodeError as exc:
                raise KTOPipelineError(f"{path}, line {number}: not valid JSON ({exc.msg}).") from None


def convert_file(
    source: str | Path,
    destinations: dict[str, tuple[int, int | None]],
    max_turns: int | None = None,
) -> dict[str, int]:
    """Convert `source` and write row ranges of the converted pairs to files.

    `destinations` maps an output .jsonl path to a (start, stop) range over the pairs that pass the
    `max_turns` filter (prompt turns, counting both roles), e.g. {"train.jsonl": (0, 400),
    "test.jsonl": (400, 480)}; stop None = to the end. Every line is validated before anything is written.
    Returns the number of pairs written to each file.
    """
    converted = []
    for line, row in read_pairs(source):
        pair = convert_pair(row, line)
        if max_turns is None or len(pair["prompt"]) <= max_turns:
            converted.append(pair)
    written = {}
    for dest, (start, end) in destinations.items():
        stop = len(converted) if end is None else end
        if stop > len(converted):
            raise KTOPipelineError(
                f"{source}: {len(converted)} pairs pass the filter, fewer than the {stop} that {dest} needs."
            )
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{dest}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for pair in converted[start:stop]:
                f.write(json.dumps(pair, ensure_ascii=False) + "\n")
        tmp.replace(dest)
        written[str(dest)] = stop - start
    return written
