"""Labelling rows with the user's own Python function: `generate --num-return-sequences N --label-with M:F` labels
the completions it samples, `kto-pipeline label FILE --label-with M:F --output OUT` the rows of a file.

The function (a rule, a verifier, a call to a judge) is

    def label(row: dict) -> bool

`row` is a copy of the row as written: `prompt`, `completion` (a string, or [{"role": "assistant", "content": ...}]
when the prompt is a list of messages), and whatever else the row holds (from generate: `policy`, `sample_index`,
`generation`, the prompts row's other keys, such as a gold answer; `label`, null or the file's current value). It
returns True (desirable) or False (undesirable): exactly a Python bool or a numpy bool. Anything else is refused,
0 and 1 included, so a function that returns a score or a count by mistake is caught at its first row.

MODULE is a path to a .py file (`rules.py:label`, `path/to/rules.py:label`: it may import modules beside it) or a
dotted module name importable from the current directory or the environment (`my_package.rules:label`).

Any problem (the module, the function, an exception it raises, a value it returns) is a KTOPipelineError naming
the row, and nothing is written: the rows are labelled in memory and the file written whole at the end.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kto_pipeline.errors import KTOPipelineError

Labeller = Callable[[dict[str, Any]], bool]


@contextmanager
def _on_path(directory: Path) -> Iterator[None]:
    """`directory` first on sys.path while a module is imported (its own imports of modules beside it work)."""
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        sys.path.remove(entry)


def _is_file_spec(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def load_labeller(spec: str, flag: str = "--label-with") -> Labeller:
    """The function named by `spec`, MODULE:FUNCTION (MODULE a .py path or a dotted module name)."""
    where = f"{flag} {spec}"
    module_name, _, function = spec.rpartition(":")
    if not module_name.strip() or not function.strip().isidentifier():
        raise KTOPipelineError(
            f"{where}: expected MODULE:FUNCTION, a .py file or a dotted module name and a function in it "
            "(e.g. rules.py:label or my_package.rules:label)."
        )
    module_name, function = module_name.strip(), function.strip()
    if _is_file_spec(module_name):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise KTOPipelineError(
                f"{where}: {path}: no such file. Give the path of a .py file that defines {function}."
            )
        name = f"kto_pipeline_labeller_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise KTOPipelineError(f"{where}: {path} cannot be imported as a Python module (is it a .py file?).")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # as an import would (dataclasses and pickling look the module up)
        try:
            with _on_path(path.resolve().parent):
                module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise KTOPipelineError(f"{where}: importing {path} failed: {_exception(exc)}") from exc
        shown = str(path)
    else:
        try:
            with _on_path(Path.cwd()):
                module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise KTOPipelineError(
                    f"{where}: no module named {exc.name!r} in the current directory ({Path.cwd()}) or the "
                    "environment. Give the path of its .py file instead (path/to/rules.py:label)."
                ) from exc
            raise KTOPipelineError(f"{where}: importing {module_name} failed: {_exception(exc)}") from exc
        except Exception as exc:
            raise KTOPipelineError(f"{where}: importing {module_name} failed: {_exception(exc)}") from exc
        shown = module_name
    if not hasattr(module, function):
        functions = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        known = f"; it defines {', '.join(functions)}" if functions else ""
        raise KTOPipelineError(f"{where}: {shown} has no {function!r}{known}.")
    labeller = getattr(module, function)
    if not callable(labeller):
        raise KTOPipelineError(
            f"{where}: {function} in {shown} is a {type(labeller).__name__}, not a function. "
            "Name a function `def label(row: dict) -> bool`."
        )
    return labeller


def _exception(exc: BaseException) -> str:
    """`Type: message (at file.py:line)`, the line being the innermost frame: where the user's code failed."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = ""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        at = f" (at {Path(exc.filename or '?').name}:{exc.lineno})"
    elif frames:
        at = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})"
    return f"{type(exc).__name__}: {exc}{at}"


def label_rows(rows: list[dict[str, Any]], labeller: Labeller, spec: str, where: list[str]) -> None:
    """Set each row's `label` to `labeller(copy of the row)`; `where[i]` names row i in an error. The rows are
    changed only once every label is known (a failure leaves them as they were)."""
    import numpy as np

    labels = []
    for i, row in enumerate(rows):
        try:
            value = labeller(copy.deepcopy(row))
        except Exception as exc:
            raise KTOPipelineError(
                f"--label-with {spec}: the labeller raised on {where[i]}: {_exception(exc)}. Nothing was written."
            ) from exc
        if not isinstance(value, bool | np.bool_):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise KTOPipelineError(
                f"--label-with {spec}: on {where[i]} the labeller returned {shown} ({type(value).__name__}); it "
                "must return True (desirable) or False (undesirable), a bool (0/1, None and scores are refused). "
                "Nothing was written."
            )
        labels.append(bool(value))
    for row, value in zip(rows, labels, strict=True):
        row["label"] = value


# ------------------------------------------------------------------------------------------ files


def check_output(out: Path, overwrite: bool, flag: str = "--output") -> None:
    """Refuse a directory, and an existing file unless `overwrite`."""
    if out.is_dir():
        raise KTOPipelineError(f"{flag} {out} is a directory. Pass a file path (e.g. {out / 'completions.jsonl'}).")
    if out.exists() and not overwrite:
        raise KTOPipelineError(f"{flag} {out} exists. Pass --overwrite to replace it, or another {flag}.")


def read_rows(path: Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of each non-blank line of a .jsonl file of prompt/completion rows."""
    if not path.is_file():
        raise KTOPipelineError(f"{what} {path}: no such file.")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KTOPipelineError(f"{what} {path} line {lineno}: not valid JSON ({exc.msg}).") from exc
            if not isinstance(row, dict) or not {"prompt", "completion"} <= row.keys():
                raise KTOPipelineError(
                    f'{what} {path} line {lineno}: each line must be an object with "prompt" and "completion".'
                )
            rows.append((lineno, row))
    if not rows:
        raise KTOPipelineError(f"{what} {path} holds no rows.")
    return rows


def rows_text(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def label_counts(rows: list[dict[str, Any]]) -> str:
    true = sum(row.get("label") is True for row in rows)
    false = sum(row.get("label") is False for row in rows)
    unlabeled = len(rows) - true - false
    return f"labels: {true} true (desirable), {false} false (undesirable), {unlabeled} unlabeled"


def label_file(path: str | Path, label_with: str, output: str | Path, overwrite: bool = False) -> Path:
    """`kto-pipeline label`: every row of `path` (a .jsonl of prompt/completion rows) labelled by `label_with`
    (MODULE:FUNCTION), any label it had replaced, written to `output`; returns `output`. `output` may be `path`
    itself with `overwrite` (it is replaced whole, once every row is labelled)."""
    from kto_pipeline.files import atomic_write_text

    path, out = Path(path), Path(output)
    check_output(out, overwrite)
    labeller = load_labeller(label_with)
    numbered = read_rows(path, "FILE")
    rows = [row for _, row in numbered]
    label_rows(rows, labeller, label_with, [f"{path} line {lineno}" for lineno, _ in numbered])
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, rows_text(rows))
    return out
