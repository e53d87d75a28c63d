"""Checkpoints of stage 2: written atomically, resumable, and the final model in Hugging Face format.

    OUT/checkpoint-STEP/
        config.json, model.safetensors, tokenizer files   the policy, loadable with from_pretrained
        trainer_state.json                               step, epoch, position in the data, metrics
        accelerate_state/                                optimizer, scheduler, RNG states (accelerate)

The weights are stored once, in Hugging Face format: accelerate's own copy of them is skipped
with a save hook (the pattern diffusers uses) and they are loaded back from the HF files.

What resuming needs besides the HF files is the engine's to write and read (`runtime/engines`:
`save_state`, `load_state`). An engine whose state holds the weights (`state_holds_weights`) leaves
only config.json and the tokenizer in HF format: under FSDP2 each process writes its shards of the
weights and the optimizer state (`torch.distributed.checkpoint`) into `sharded/`; under DeepSpeed
they are DeepSpeed's own checkpoint, inside `accelerate_state/`. The final model is gathered and
written whole, in Hugging Face format, by the main process.

A checkpoint is written to a hidden temporary directory and renamed into place when complete, so
a run killed while saving never leaves a half checkpoint that `--resume` would pick.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.models import dropout_restored
from kto_pipeline.rundir import RUN_CONFIG_FILE, STATE_FILE, TrainerState

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def skip_model_weights_in_accelerate_state(accelerator) -> None:
    """The HF-format files hold the weights; keep accelerate from writing (and reading) a second copy."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())


def save_model(engine, module, tokenizer, path: Path, run_config: dict[str, Any]) -> None:
    """Save the policy (HF format) + tokenizer at `path`. Every process must call this (a sharded model is
    gathered)."""
    state_dict = engine.full_state_dict(module)
    if not engine.accelerator.is_main_process:
        return
    model = engine.unwrap(module).model
    state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
    model.config.kto_pipeline_run = run_config  # the run's settings travel with the weights
    path.mkdir(parents=True, exist_ok=True)
    with dropout_restored(model):  # the config's own dropout rates, not training's zeros
        model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def save_merged(engine, module, tokenizer, out: Path, load_base, into_loaded: bool = False) -> None:
    """--merge: the base model with the trained LoRA adapter merged in, whole, in OUT/merged (main process only;
    after `save_model`). Where no process holds the whole adapter model (a sharded one), or `into_loaded` (the
    trained base is quantized: the adapter goes into its float weights, as served), the main process merges the
    adapter just saved in OUT into a fresh copy of the base model (`load_base()`), as one would offline, while the
    others wait."""
    accelerator = engine.accelerator
    if accelerator.is_main_process:
        if engine.holds_whole_model and not into_loaded:
            merged = engine.unwrap(module).model.merge_and_unload()
        else:
            from peft import PeftModel

            with engine.whole_models():  # by this process alone: the others wait below
                merged = PeftModel.from_pretrained(load_base(), out).merge_and_unload()
        with dropout_restored(merged):
            merged.save_pretrained(out / "merged")
        tokenizer.save_pretrained(out / "merged")
    accelerator.wait_for_everyone()


def save_checkpoint(
    engine,
    module,
    optimizer,
    tokenizer,
    out: Path,
    state: TrainerState,
    run_config: dict,
    total_limit: int | None,
) -> Path:
    """Write OUT/checkpoint-STEP (STEP: `state.global_step`) atomically and prune old ones; every process must call
    this."""
    accelerator = engine.accelerator
    step = state.global_step
    final = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    engine.save_state(module, optimizer, tmp)
    if engine.state_holds_weights:  # the HF files are the config and the tokenizer only
        if accelerator.is_main_process:
            model = engine.unwrap(module).model
            model.config.kto_pipeline_run = run_config
            model.config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    else:
        save_model(engine, module, tokenizer, tmp, run_config)
    # Every process writes its own files (accelerate's RNG states, sharded weights) and nothing waits for them after:
    # without this barrier the main process could rename the directory while another is still writing into it,
    # which then fails (the intermittent "rank 1 exited 1" of a 2-process test run).
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # the run config goes with the state: resume refuses a checkpoint trained with other batch settings
        state.run_config = run_config
        state.write(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if total_limit:
            for old in [c for c in list_checkpoints(out) if int(c.name.split("-")[1]) <= step][:-total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def list_checkpoints(out: Path) -> list[Path]:
    """Finished checkpoints in OUT, oldest first."""
    found = [(int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).exists()]


def resolve_resume(out: Path, resume: bool, resume_from: str | None, autoresume: bool = False) -> Path | None:
    """The checkpoint a run restarts from, or None to start: --autoresume's newest complete checkpoint in OUT
    (falling back to --resume-from, then to a start), --resume-from's (a checkpoint, or a run's output directory:
    its newest), or --resume's newest."""
    if autoresume:
        found = list_checkpoints(out)
        if found:
            return found[-1]
    if resume_from:
        path = Path(resume_from)
        if (path / RUN_CONFIG_FILE).exists():  # a run's output directory: its newest checkpoint
            found = list_checkpoints(path)
            if not found:
                raise KTOPipelineError(
                    f"--resume-from {path}: a run's output directory with no checkpoint in it (OUT/checkpoint-STEP, "
                    "written every --save-steps). Start a new run, or --init-from it to train on from its final model."
                )
            return found[-1]
        if not (path / STATE_FILE).exists():
            raise KTOPipelineError(
                f"--resume-from {path}: not a kto-pipeline checkpoint (no {STATE_FILE}). "
                f"Point it at an OUT/checkpoint-STEP directory, or at a run's OUT (its newest checkpoint)."
            )
        return path
    if resume:
        found = list_checkpoints(out)
        if not found:
            raise KTOPipelineError(
                f"--resume: {out} holds no checkpoint to resume from (checkpoints are written every --save-steps). "
                "To start it over: --overwrite-output-dir instead of --resume, or --autoresume, which starts again "
                "an unfinished run of the same settings that wrote no checkpoint."
            )
        return found[-1]
    return None


def _load_full_weights(model, path: Path) -> None:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    weights = {}
    for name in files:  # save_pretrained shards big models into several files
        weights.update(load_file(str(path / name)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {}) | set(
        getattr(model, "_tied_weights_keys", None) or []
    )
    if unexpected or any(k not in tied for k in missing):
        raise KTOPipelineError(
            f"checkpoint {path} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})."
        )


def load_checkpoint(engine, module, optimizer, path: Path) -> TrainerState:
    """Restore weights, optimizer, scheduler and RNG states from `path`; returns its trainer state. Every process
    must call this."""
    state = TrainerState.read(path)
    _check_same_processes(state, engine, path)
    if not engine.state_holds_weights:
        _load_hf_weights(engine.unwrap(module).model, path)
    engine.load_state(module, optimizer, path)
    return state


def _load_hf_weights(model, path: Path) -> None:
    from safetensors.torch import load_file

    if (path / "adapter_model.safetensors").exists():  # a LoRA run: the checkpoint holds the adapters only
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(path / "adapter_model.safetensors")))
    else:
        _load_full_weights(model, path)


def _check_same_processes(state: TrainerState, engine, path: Path) -> None:
    """A checkpoint's data position and optimizer shards are those of its engine and world size."""
    saved, now = state.distributed, engine.record()
    if saved is None:
        return  # written before kto-pipeline recorded it
    if saved != now:
        raise KTOPipelineError(
            f"cannot resume from {path}: it was written by {saved['world_size']} process(es) ({saved['engine']}), "
            f"and this run has {now['world_size']} ({now['engine']}). A step's batch, the data position and the "
            f"sharded optimizer state depend on them. Resume with {saved['world_size']} process(es) and the same "
            "launch configuration, or start a new run."
        )
