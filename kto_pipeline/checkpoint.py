"""Checkpoints of stage 2: written atomically, loadable as Hugging Face models, and resumable.

    OUT/checkpoint-STEP/
        config.json, model.safetensors, tokenizer files   the policy, loadable with from_pretrained
        trainer_state.json                               step, epoch, position in the data, metrics
        accelerate_state/                                optimizer, scheduler, RNG states (accelerate)

The weights are stored once, in Hugging Face format: accelerate's own copy of them is skipped
with a save hook (the pattern diffusers uses) and they are loaded back from the HF files. A
checkpoint is written to a hidden temporary directory and renamed into place when complete, so
a run killed while saving never leaves a half checkpoint that `--resume` would pick.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.rundir import STATE_FILE, TrainerState

ACCELERATE_STATE = "accelerate_state"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def skip_model_weights_in_accelerate_state(accelerator) -> None:
    """The HF-format files hold the weights; keep accelerate from writing (and reading) a second copy."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())


def save_model(accelerator, module, tokenizer, path: Path, run_config: dict[str, Any]) -> None:
    """Save the policy (HF format) + tokenizer at `path`. Every process must call this (FSDP gathers)."""
    state_dict = accelerator.get_state_dict(module)  # collective under FSDP / ZeRO-3
    if not accelerator.is_main_process:
        return
    model = accelerator.unwrap_model(module).model
    state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
    model.config.kto_pipeline_run = run_config  # the run's settings travel with the weights
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def save_checkpoint(
    accelerator, module, tokenizer, out: Path, state: TrainerState, run_config: dict, total_limit: int | None
) -> Path:
    """Write OUT/checkpoint-STEP (STEP: `state.global_step`) atomically and prune old ones; every process must call
    this."""
    step = state.global_step
    final = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / ACCELERATE_STATE))
    save_model(accelerator, module, tokenizer, tmp, run_config)
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


def resolve_resume(out: Path, resume: bool, resume_from: str | None) -> Path | None:
    if resume_from:
        path = Path(resume_from)
        if not (path / STATE_FILE).exists():
            raise KTOPipelineError(
                f"--resume-from {path}: not a kto-pipeline checkpoint (no {STATE_FILE}). "
                f"Point it at an OUT/checkpoint-STEP directory."
            )
        return path
    if resume:
        found = list_checkpoints(out)
        if not found:
            raise KTOPipelineError(
                f"--resume: {out} holds no checkpoint to resume from. Train with --save-steps N to write "
                "checkpoints, or drop --resume to start over."
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


def load_checkpoint(accelerator, module, path: Path) -> TrainerState:
    """Restore weights, optimizer, scheduler and RNG states from `path`; returns its trainer state."""
    from safetensors.torch import load_file

    model = accelerator.unwrap_model(module).model
    if (path / "adapter_model.safetensors").exists():  # a LoRA run: the checkpoint holds the adapters only
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(path / "adapter_model.safetensors")))
    else:
        _load_full_weights(model, path)
    accelerator.load_state(str(path / ACCELERATE_STATE))
    return TrainerState.read(path)
