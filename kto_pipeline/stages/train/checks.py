"""Stage 2's checks of where a run starts: its output directory, and a checkpoint it resumes from."""

from __future__ import annotations

from pathlib import Path

from kto_pipeline.config import TrainConfig
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.lock import holds_files
from kto_pipeline.objectives import objective_for
from kto_pipeline.rundir import finished_at, run_config


def check_output_dir(out: Path, config: TrainConfig) -> None:
    """A run starts in an empty directory, or with --overwrite-output-dir; with --autoresume also in the directory
    of an unfinished run of the same settings that wrote no checkpoint yet (it starts that run again)."""
    # (a file at --output-dir is refused by the lock, taken before this check)
    if not out.is_dir() or not holds_files(out) or config.overwrite_output_dir:  # our own lock does not count
        return
    if config.autoresume and same_unfinished_run(out, config):
        return
    raise KTOPipelineError(
        f"--output-dir {out} is not empty. Choose a new directory, or pass --overwrite-output-dir to write into it."
        + (
            " (--autoresume found no checkpoint in it, and it is not an unfinished run of these settings.)"
            if config.autoresume
            else ""
        )
    )


def same_unfinished_run(out: Path, config: TrainConfig) -> bool:
    """`out` holds a run that started with the settings that fix its steps (`RESUME_INVARIANTS`) and did not finish."""
    saved = run_config(out)
    if not saved or finished_at(out) is not None:
        return False
    return all(saved.get(k) == getattr(config, k) for k in RESUME_INVARIANTS)


# settings that fix what a checkpoint's step and data position mean; resuming with others would be wrong
RESUME_INVARIANTS = (
    "cache",
    "model",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_length",
    "seed",
    "train_sampling_strategy",
    "lora_r",
    "lora_target_modules",
)


def check_resume_compatible(saved: dict, config: TrainConfig, path: Path) -> None:
    diff = [
        f"--{k.replace('_', '-')}: checkpoint {saved[k]!r}, now {getattr(config, k)!r}"
        for k in RESUME_INVARIANTS
        if k in saved and saved[k] != getattr(config, k)
    ]
    # a pair loss's batches count pairs, KTO's rows: another data position
    was, now = objective_for(saved.get("loss_type", "kto")).unit, objective_for(config.loss_type).unit
    if was != now:
        diff.append(f"--loss-type: checkpoint {saved['loss_type']!r}, now {config.loss_type!r} ({was} vs {now})")
    if diff:
        raise KTOPipelineError(
            f"cannot resume from {path}: it was trained with other settings:\n  - "
            + "\n  - ".join(diff)
            + "\nResume with the original settings, or start a new run."
        )
