"""Stage 2's checks of where a run starts: its output directory, the policy's first weights, and a checkpoint it
resumes from."""

from __future__ import annotations

from pathlib import Path

from kto_pipeline.cache.manifest import Manifest
from kto_pipeline.config import TrainConfig
from kto_pipeline.config.fields import FIXED_ON_RESUME, NOTED_ON_RESUME, fields_with
from kto_pipeline.errors import KTOPipelineError, flag
from kto_pipeline.lock import holds_files
from kto_pipeline.objectives import objective_for
from kto_pipeline.rundir import TrainerState, finished_at, run_config
from kto_pipeline.rundir.checkpoint import list_checkpoints


def check_output_dir(out: Path, config: TrainConfig) -> None:
    """A run starts in an empty directory, or with --overwrite-output-dir; with --autoresume also in the directory
    of an unfinished run of the same settings that wrote no checkpoint yet (it starts that run again)."""
    # (a file at --output-dir is refused by the lock, taken before this check)
    where = out.resolve()
    for flag_name, cache in (("--cache", config.cache), ("--eval-cache", config.eval_cache)):
        if cache is not None and (where == Path(cache).resolve() or Path(cache).resolve() in where.parents):
            raise KTOPipelineError(
                f"--output-dir {out} is inside the cache {flag_name} {cache}: a run writes its model, metrics and "
                "checkpoints there. Choose a directory outside the cache."
            )
    if not out.is_dir() or not holds_files(out) or config.overwrite_output_dir:  # our own lock does not count
        return
    if config.autoresume and same_unfinished_run(out, config):
        return
    if config.autoresume:
        why = " (--autoresume found no checkpoint in it, and it is not an unfinished run of these settings.)"
    elif found := list_checkpoints(out):
        why = f" Its newest checkpoint is {found[-1].name}: --resume continues from there."
    elif same_unfinished_run(out, config):
        why = " It holds an unfinished run of these settings that wrote no checkpoint: --autoresume starts it again."
    else:
        why = ""
    raise KTOPipelineError(
        f"--output-dir {out} is not empty. Choose a new directory, or pass --overwrite-output-dir to write into it."
        + why
    )


def same_unfinished_run(out: Path, config: TrainConfig) -> bool:
    """`out` holds a run that started with the settings that fix its steps (`RESUME_INVARIANTS`) and did not finish."""
    saved = run_config(out)
    if not saved or finished_at(out) is not None:
        return False
    return all(same_setting(k, saved.get(k), getattr(config, k)) for k in RESUME_INVARIANTS)


PATH_SETTINGS = ("cache", "model")  # a directory (or a hub id, for the model): the same however it is spelled


def same_setting(name: str, saved, now) -> bool:
    """Whether a run's saved setting and this one's are the same: paths compared as the directories they name
    (`cache_dir`, `./cache_dir/` and its absolute path alike), other values as they are."""
    if name in PATH_SETTINGS and isinstance(saved, str) and isinstance(now, str) and saved != now:
        return Path(saved).exists() and Path(now).exists() and Path(saved).resolve() == Path(now).resolve()
    return saved == now


def policy_start_note(config: TrainConfig, manifest: Manifest) -> str | None:
    """A note where --model names another model than the one the cache's reference log-probs came from: the
    policy then starts away from its reference (trl's setting with a ref_model other than the model)."""
    reference = manifest.reference_model
    if config.model is None or same_setting("model", config.model, reference):
        return None
    return (
        f"note: --model {config.model} is not the model the cache's reference log-probs came from ({reference}). "
        "Unless it holds the same weights, the policy starts away from its reference and step 1's rewards are not "
        "0. Without --model, training starts from the reference."
    )


# settings that fix what a checkpoint's step and data position mean; resuming with others would be wrong
RESUME_INVARIANTS = fields_with(TrainConfig, FIXED_ON_RESUME)
# settings a resumed run may change, but that change what the steps after the checkpoint do: said when they differ
RESUME_CHANGES = fields_with(TrainConfig, NOTED_ON_RESUME)


def resume_changes_note(state: TrainerState, config: TrainConfig) -> str | None:
    """A note naming the settings of RESUME_CHANGES that differ from the checkpoint's."""
    saved = state.run_config or {}
    changed = [
        f"{flag(k)} {saved[k]!r} -> {getattr(config, k)!r}"
        for k in RESUME_CHANGES
        if k in saved and saved[k] != getattr(config, k)
    ]
    return f"note: resuming with other settings than the checkpoint's: {', '.join(changed)}" if changed else None


def check_resume_compatible(state: TrainerState, config: TrainConfig, path: Path, manifest: Manifest) -> None:
    """A checkpoint continues only with the settings that fix what its step and data position mean, and on the
    rows it trained on: the cache it read, by content (moved or copied, the same; made again or appended to since,
    another), where the checkpoint recorded it (else by its path)."""
    saved, rows = state.run_config or {}, state.cache_rows
    by_content = rows is not None and "cache" in saved
    diff = [
        f"{flag(k)}: checkpoint {saved[k]!r}, now {getattr(config, k)!r}"
        for k in RESUME_INVARIANTS
        if k in saved and not (k == "cache" and by_content) and not same_setting(k, saved[k], getattr(config, k))
    ]
    if by_content and rows["content_id"] != manifest.content_id:
        then = f"{rows['rows']} rows then, {manifest.counts['rows']} now"
        diff.append(
            f"--cache {config.cache}: not the rows the checkpoint trained on ({then}): the cache was made again or "
            "appended to since"
        )
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
