"""Loading a dataset as both stages read it: a local data file, a `save_to_disk` directory or a hub id, as a
`datasets.Dataset`, with an error that names the problem (an empty file, a bad JSON line, a missing split).
Precompute reads its data through it, and train reads a vision dataset's images again through it."""

from __future__ import annotations

import json
from pathlib import Path

from kto_pipeline.errors import KTOPipelineError

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


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
        bad_line = _first_bad_json_line(path) if path.is_file() else None
        if bad_line:
            raise KTOPipelineError(f"--dataset {name}: {bad_line}. Fix or remove that line.") from exc
        cause = f"; {type(exc.__cause__).__name__}: {exc.__cause__}" if exc.__cause__ else ""
        hint = ""
        if not path.exists():  # a hub id
            hint = (
                ". Where the Hugging Face Hub cannot be reached, download it on a machine with network (`hf download "
                f"{name} --repo-type dataset --local-dir DIR`, huggingface_hub's command line), copy DIR here and "
                "pass --dataset DIR"
            )
        raise KTOPipelineError(
            f"--dataset {name}: could not load it ({type(exc).__name__}: {exc}{cause}){hint}"
        ) from exc


def _first_bad_json_line(path: Path) -> str | None:
    """For a JSON-lines file that datasets could not read: the first line that is not a JSON object, named by
    its line number (datasets' own error does not say where). One streaming pass; None for other files."""
    if path.suffix.lower() not in (".json", ".jsonl"):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        if f.read(1) == "[":
            return None  # a JSON array, not JSON lines
        f.seek(0)
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                return f"line {number} is not valid JSON ({exc.msg} at column {exc.colno})"
            if not isinstance(value, dict):
                return f"line {number} is a JSON {type(value).__name__}, not an object with named columns"
    return None
