"""`kto-pipeline sweep`: a grid of training runs on one cache (never a second reference pass).

Any train flag takes comma-separated values; the grid is their product. `--loss-type kto,sigmoid,ipo` puts KTO
and pair losses in one grid (on a paired cache): each run takes the options of its own loss (the pair losses'
--label-smoothing ... are left out of KTO's runs, KTO's --desirable-weight / --undesirable-weight out of the pair
losses'), and runs that come out the same are trained once. Each run trains into
SWEEP/<name>/ where the name lists only what varies (`beta0.05-lr5e-07`). Finished runs are
skipped when the sweep is run again, so an interrupted sweep resumes. Under `accelerate launch`
every run is one distributed run across all processes (the grid is walked once, together), and
only the main process writes the summary.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import shutil
import typing
from pathlib import Path
from typing import Any

from kto_pipeline.config import TrainConfig, parse_value
from kto_pipeline.config.fields import LISTED, NO_EFFECT, SET_BY_SWEEP, fields_with, has_role
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.objectives import foreign_options
from kto_pipeline.report import markdown_table
from kto_pipeline.rundir import finished_at, run_config

FIXED_FIELDS = fields_with(TrainConfig, SET_BY_SWEEP)  # set by the sweep itself, run by run
SHORT_NAMES = {
    "beta": "beta",
    "learning_rate": "lr",
    "per_device_train_batch_size": "bs",
    "gradient_accumulation_steps": "ga",
    "desirable_weight": "dw",
    "undesirable_weight": "uw",
    "num_train_epochs": "ep",
    "max_steps": "steps",
    "warmup_ratio": "warmup",
    "weight_decay": "wd",
    "max_length": "len",
    "seed": "seed",
    "loss_type": "",
    "lr_scheduler_type": "",
}
NO_EFFECT_FIELDS = fields_with(TrainConfig, NO_EFFECT)  # a finished run with other values of these still counts


def sweepable_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if f.name not in FIXED_FIELDS]


def expand_grid(values: dict[str, str | None]) -> tuple[list[dict[str, Any]], list[str]]:
    """{field: "v1,v2" or None} -> (one settings dict per run, names of the fields that vary)."""
    fields = {f.name for f in sweepable_fields()}
    types = typing.get_type_hints(TrainConfig)  # (the annotations are strings here)
    options: dict[str, list[Any]] = {}
    for name, text in values.items():
        if text is None:
            continue
        if name not in fields:
            raise KTOPipelineError(f"--{name.replace('_', '-')} cannot be swept")
        # list-valued flags take their commas literally: one value, not several runs
        parts = [str(text)] if has_role(TrainConfig, name, LISTED) else str(text).split(",")
        parsed = [parse_value(types[name], part, name) for part in parts]
        options[name] = list(dict.fromkeys(parsed))  # drop repeats, keep order
    varied = [name for name, vals in options.items() if len(vals) > 1]
    grid = [_for_its_loss(dict(zip(options, combo, strict=True))) for combo in itertools.product(*options.values())]
    return [dict(t) for t in dict.fromkeys(tuple(g.items()) for g in grid)], varied  # each run once


def _for_its_loss(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's settings without the options of the other loss families (a grid of KTO and pair losses)."""
    other = foreign_options(str(settings.get("loss_type", "kto")))
    return {k: v for k, v in settings.items() if k not in other}


def run_name(settings: dict[str, Any], varied: list[str]) -> str:
    if not varied:
        return "run"
    parts = []
    for name in varied:
        if name not in settings:  # an option of the other loss family (`_for_its_loss`)
            continue
        value = settings[name]
        text = f"{value:g}" if isinstance(value, float) else str(value)
        parts.append(f"{SHORT_NAMES.get(name, name)}{text}")
    return "-".join(parts).replace("/", "_")


def sweep(cache: str, output_dir: str, values: dict[str, str | None], keep: str = "all") -> list[dict[str, Any]]:
    """Train every combination of `values` on `cache` into `output_dir`; returns the summary rows, best first."""
    from kto_pipeline.report import summary_rows
    from kto_pipeline.runtime.launch import process_state
    from kto_pipeline.stages.train.stage import train

    if keep not in ("all", "best"):
        raise KTOPipelineError(f"--keep must be all or best, got {keep!r}")
    grid, varied = expand_grid(values)
    out = Path(output_dir)
    names = [run_name(settings, varied) for settings in grid]
    configs = [
        TrainConfig(cache=cache, output_dir=str(out / name), overwrite_output_dir=True, **settings)
        for name, settings in zip(names, grid, strict=True)
    ]  # built first, so a bad value fails before any run starts
    state = process_state()
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        print(f"sweep: {len(configs)} runs on {cache}: {', '.join(names)}", flush=True)
    for name, config in zip(names, configs, strict=True):
        if _finished_with(out / name, config):
            if state.is_main_process:
                print(f"sweep: {name} already finished, skipped", flush=True)
            continue
        train(config)
        state.wait_for_everyone()
    rows = summary_rows({name: out / name for name in names}, settings=varied)  # varied settings: own columns
    if state.is_main_process:
        _write_summary(out, rows)
        if keep == "best" and rows:
            for row in rows[1:]:
                run_dir = out / row["run"]
                for weights in [*run_dir.glob("model*.safetensors*"), *run_dir.glob("adapter_model*.safetensors*")]:
                    weights.unlink()
                for directory in [*run_dir.glob("checkpoint-*"), run_dir / "merged"]:
                    shutil.rmtree(directory, ignore_errors=True)
        print(f"sweep: summary in {out / 'summary.md'}; best run: {rows[0]['run'] if rows else '-'}", flush=True)
    state.wait_for_everyone()
    return rows


def _finished_with(run_dir: Path, config: TrainConfig) -> bool:
    """A run counts as done only if it finished with the same settings (else it is trained again)."""
    if finished_at(run_dir) is None:
        return False
    saved, wanted = run_config(run_dir), config.to_dict()
    return all(saved.get(k) == v for k, v in wanted.items() if k not in NO_EFFECT_FIELDS)


def _write_summary(out: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    (out / "summary.md").write_text(
        f"# Sweep summary ({len(rows)} runs, best first)\n\n"
        + markdown_table([{c: r.get(c) for c in columns} for r in rows])
    )
