"""A training run's output directory: the contract between `train` and the tools that read runs.

    OUT/
        run_config.json        the run's settings (TrainConfig), written when it starts
        metrics.jsonl          one JSON record per logging step or evaluation (trl's metric names)
        trainer_state.json     the `TrainerState` the run finished in; present only once it has finished
        config.json, model.safetensors (or adapter_*), tokenizer files, README.md   the final model and its card
        checkpoint-STEP/       `checkpoint.py`: the model, trainer_state.json (the state to resume from) and
                               accelerate_state/
        samples.jsonl          written by `kto-pipeline generate`: reference and policy answers side by side
        tensorboard/           with --report-to tensorboard

`trainer_state.json` means one thing wherever it lies: the trainer's state after a step. In a checkpoint it is
what `--resume` restarts from; at the top of OUT it is the state the run ended in, and so the mark that the run
finished (`finished_at`, which `sweep` and an extended run read). This module owns these names, their readers
and the metrics writer: `train`, `report`, `generate` and `sweep` all go through it. Beside it in this folder:
`checkpoint.py` (saving, listing and loading checkpoints, the final model) and `hub.py` (`--push-to-hub`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kto_pipeline.errors import KTOPipelineError

RUN_CONFIG_FILE = "run_config.json"
METRICS_FILE = "metrics.jsonl"
STATE_FILE = "trainer_state.json"
SAMPLES_FILE = "samples.jsonl"


@dataclass
class TrainerState:
    """The trainer's state after optimizer step `global_step`.

    A checkpoint's state carries the data position (`epoch_index`, `batches_in_epoch`), the metrics not logged yet
    and the run config; the final state adds what the run did (`train_seconds` and the token counters)."""

    global_step: int = 0
    max_steps: int = 0  # the schedule's total: a resume with another total says so
    epoch: float = 0.0  # fractional, as logged
    epoch_index: int = 0  # the epoch the next batch belongs to
    batches_in_epoch: int = 0  # batches of that epoch already trained
    log_history: list[dict[str, float]] = field(default_factory=list)
    pending_metrics: dict[str, list[float]] = field(default_factory=dict)
    run_config: dict[str, Any] | None = None
    distributed: dict[str, Any] | None = None  # how the run was spread: {"engine": "fsdp2", "world_size": 2}
    cache_rows: dict[str, Any] | None = None  # the rows trained on: {"content_id", "rows"} (`Manifest.content_id`)
    # the final state only: this run's work (since a resume, if resumed)
    train_seconds: float | None = None
    tokens_executed: int | None = None  # tokens the forwards ran, padding included
    tokens_needed: int | None = None  # each prompt once, then its completion and KL completion, no padding
    token_efficiency: float | None = None
    precision: str | None = None  # the policy's regime, e.g. "float32 weights under bfloat16 autocast"
    packing: str | None = None  # "packed", or "padded (why)"
    attention_kernel: str | None = None  # how packed rows attended: "by-tree", "block-mask" or "dense"
    compile: dict | None = None  # with --torch-compile: {graphs, graph_breaks, recompiles, seconds}
    kl_forward: str | None = None
    # the final state only: where the run started and what it saw
    reference_hash: str | None = None  # the frozen reference's weights hash (the cache's): --init-from checks it
    round: int | None = None  # 1, or the --init-from run's round + 1
    # each process's peak memory:
    # [{"rank", "host_private_mib", "loaded_host_private_mib", "host_rss_mib", "accelerator_mib"}]
    peak_memory: list[dict[str, Any]] | None = None
    parent_run: dict[str, Any] | None = None  # the --init-from run: path, global_step, round, kind (full / adapter)
    cache_segments: list[dict[str, Any]] | None = None  # the cache segments trained on: index, rows, source, hash

    def write(self, directory: Path) -> None:
        values = {k: v for k, v in asdict(self).items() if v is not None}
        (directory / STATE_FILE).write_text(json.dumps(values, indent=2) + "\n")

    @classmethod
    def read(cls, directory: Path) -> TrainerState:
        values = json.loads((directory / STATE_FILE).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def finished_at(out: Path) -> int | None:
    """The step at which the run in `out` finished (its trainer_state.json), or None if it has not."""
    try:
        return TrainerState.read(out).global_step
    except (OSError, ValueError, TypeError):
        return None


def is_run(path: Path) -> bool:
    return (path / METRICS_FILE).exists()


def start_run(out: Path, config: dict[str, Any], history: list[dict[str, float]]) -> None:
    """Write a (re)started run's config and the metrics it already has; its finished mark goes until it ends."""
    out.mkdir(parents=True, exist_ok=True)
    (out / STATE_FILE).unlink(missing_ok=True)
    (out / RUN_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (out / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in history))


class MetricsWriter:
    """One metrics record at a time: appended to `history`, to metrics.jsonl (main process) and to accelerate's
    trackers (--report-to)."""

    def __init__(self, out: Path, accelerator, history: list[dict[str, float]], trackers: bool):
        self.path, self.accelerator, self.history, self.trackers = out / METRICS_FILE, accelerator, history, trackers

    def __call__(self, record: dict[str, float]) -> None:
        self.history.append(record)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.trackers:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


# ------------------------------------------------------------------------------------------ reading


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, eval records) of one run's metrics.jsonl."""
    train, evals = [], []
    for line in (run_dir / METRICS_FILE).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            (evals if any(k.startswith("eval_") for k in record) else train).append(record)
    return train, evals


def find_runs(path: Path) -> dict[str, Path]:
    """{label: run dir}: the directory itself if it is a run, else its subdirectories that are runs."""
    if is_run(path):
        return {path.name: path}
    runs = {p.name: p for p in sorted(path.iterdir()) if p.is_dir() and is_run(p)}
    if not runs:
        raise KTOPipelineError(
            f"{path}: no {METRICS_FILE} here or in its subdirectories. Point report at a train --output-dir "
            "or a sweep directory."
        )
    return runs


def run_config(run_dir: Path) -> dict[str, Any]:
    """The settings a run was trained with: its run_config.json, or a checkpoint's trainer_state.json; {} if none."""
    if (run_dir / RUN_CONFIG_FILE).exists():
        return json.loads((run_dir / RUN_CONFIG_FILE).read_text())
    if (run_dir / STATE_FILE).exists():
        return TrainerState.read(run_dir).run_config or {}
    return {}


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The records of a samples file."""
    path = Path(path)
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise KTOPipelineError(
                    f"{path} line {lineno}: not valid JSON ({exc.msg}). Write it again with `kto-pipeline generate`."
                ) from exc
    return records


# ------------------------------------------------------------------------------------------ rounds


@dataclass
class InitPoint:
    """A previous run's trained policy that a new run starts from (`train --init-from`): the next round."""

    run_dir: Path  # the run (or checkpoint) directory: its weights or adapter, and its tokenizer
    kind: str  # "full" (model weights) or "adapter" (a LoRA adapter over `base`)
    base: str | None  # an adapter's base model (name or path, as PEFT recorded it)
    global_step: int | None
    round: int  # the parent's round (1 for a run that did not start from another)
    reference_hash: str | None  # the frozen reference it trained against, where the run recorded it

    def parent(self) -> dict:
        """What the new run's trainer_state.json records of this point (`parent_run`)."""
        path = str(self.run_dir.resolve())
        return {"path": path, "global_step": self.global_step, "round": self.round, "kind": self.kind}


def read_init_point(path: str | Path) -> InitPoint:
    """What `--init-from PATH` holds, or a KTOPipelineError saying why it holds no trained model."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise KTOPipelineError(f"--init-from {run_dir}: no such directory.")
    weights = any(run_dir.glob("*.safetensors")) or (run_dir / "pytorch_model.bin").exists()
    if (run_dir / "adapter_config.json").exists():
        kind = "adapter"
        base = json.loads((run_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    elif (run_dir / "config.json").exists() and weights:
        kind, base = "full", None
    else:
        checkpoints = sorted(run_dir.glob("checkpoint-*"))
        hint = (
            f" It has checkpoints ({checkpoints[-1].name} ...): the run did not finish; continue it with --resume, "
            "or point --init-from at a checkpoint."
            if checkpoints
            else ""
        )
        raise KTOPipelineError(
            f"--init-from {run_dir} holds no trained model: neither model weights (config.json + *.safetensors) "
            f"nor a LoRA adapter (adapter_config.json). Point it at a finished `kto-pipeline train --output-dir`.{hint}"
        )
    state = TrainerState.read(run_dir) if (run_dir / STATE_FILE).exists() else None
    return InitPoint(
        run_dir=run_dir,
        kind=kind,
        base=base,
        global_step=state.global_step if state else None,
        round=(state.round or 1) if state else 1,
        reference_hash=state.reference_hash if state else None,
    )


class MetricLog:
    """Per-forward-pass metric values, averaged over the forward passes of each logging interval (as trl)."""

    def __init__(self):
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, name: str, value: float) -> None:
        self.values[name].append(value)

    def flush(self) -> dict[str, float]:
        out = {k: sum(v) / len(v) for k, v in self.values.items() if v}
        self.values.clear()
        return out
