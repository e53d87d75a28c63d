"""Checkpoints of stage 2: written atomically, resumable, and the final model in Hugging Face format.

    OUT/checkpoint-STEP/
        config.json, model.safetensors, tokenizer files   the policy, loadable with from_pretrained
        trainer_state.json                               step, epoch, position in the data, metrics
        accelerate_state/                                optimizer, scheduler, RNG states (accelerate)

The weights are stored once, in Hugging Face format: accelerate's own copy of them is skipped
with a save hook (the pattern diffusers uses) and they are loaded back from the HF files.

Under FSDP2 no process holds the whole model: a checkpoint stores the weights and the optimizer state
sharded, each process writing its own shards (`torch.distributed.checkpoint`), in `sharded/`
instead of model.safetensors and accelerate's optimizer file; config.json and the tokenizer are still
there. Under DeepSpeed the weights and optimizer state are DeepSpeed's own checkpoint, which accelerate
writes into `accelerate_state/`. The final model is gathered and written whole, in Hugging Face format,
by the main process.

A checkpoint is written to a hidden temporary directory and renamed into place when complete, so
a run killed while saving never leaves a half checkpoint that `--resume` would pick.
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.rundir import STATE_FILE, TrainerState

ACCELERATE_STATE = "accelerate_state"
SHARDED = "sharded"  # FSDP2: weights and optimizer state, each process's shards (torch.distributed.checkpoint)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def skip_model_weights_in_accelerate_state(accelerator) -> None:
    """The HF-format files hold the weights; keep accelerate from writing (and reading) a second copy."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())


def full_state_dict(accelerator, engine, module) -> dict:
    """The whole model's weights on the main process (others: what they hold). Every process must call this:
    under FSDP2 the shards are gathered, onto the CPU of the main process only."""
    if engine.shards:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return accelerator.get_state_dict(module)


def save_model(accelerator, engine, module, tokenizer, path: Path, run_config: dict[str, Any]) -> None:
    """Save the policy (HF format) + tokenizer at `path`. Every process must call this (FSDP gathers)."""
    state_dict = full_state_dict(accelerator, engine, module)
    if not accelerator.is_main_process:
        return
    model = accelerator.unwrap_model(module).model
    state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
    model.config.kto_pipeline_run = run_config  # the run's settings travel with the weights
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def save_merged(accelerator, engine, module, tokenizer, out: Path, load_base) -> None:
    """--merge: the base model with the trained LoRA adapter merged in, whole, in OUT/merged (main process only;
    after `save_model`). Sharded, no process holds the whole adapter model: the main process merges the adapter just
    saved in OUT into a fresh copy of the base model (`load_base()`), as one would offline, while the others wait."""
    if accelerator.is_main_process:
        if engine.shards:
            from peft import PeftModel

            merged = PeftModel.from_pretrained(load_base(), out).merge_and_unload()
        else:
            merged = accelerator.unwrap_model(module).model.merge_and_unload()
        merged.save_pretrained(out / "merged")
        tokenizer.save_pretrained(out / "merged")
    accelerator.wait_for_everyone()


@contextmanager
def _optimizer_not_in_accelerate_state(accelerator, engine):
    """Under FSDP2 the optimizer state is saved sharded with the weights: accelerate would save (and load) only
    the main process's shards of it."""
    saved = accelerator._optimizers
    if engine.shards:
        accelerator._optimizers = []
    try:
        yield
    finally:
        accelerator._optimizers = saved


def save_checkpoint(
    accelerator,
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
    step = state.global_step
    final = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    with _optimizer_not_in_accelerate_state(accelerator, engine):
        accelerator.save_state(str(tmp / ACCELERATE_STATE))
    if engine.shards:
        import torch.distributed.checkpoint as dcp

        dcp.save(_sharded_state(module, optimizer), checkpoint_id=str(tmp / SHARDED))
    if engine.shards or engine.deepspeed:  # the weights are in the shards (DeepSpeed's: in accelerate_state/)
        if accelerator.is_main_process:
            model = accelerator.unwrap_model(module).model
            model.config.kto_pipeline_run = run_config
            model.config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    else:
        save_model(accelerator, engine, module, tokenizer, tmp, run_config)
    # Every process writes its own files (accelerate's RNG states, FSDP2's shards) and nothing waits for them after:
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


def _sharded_state(module, optimizer) -> dict:
    """This process's shards of the weights and of the optimizer state, by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(module, getattr(optimizer, "optimizer", optimizer))
    return {"model": model_state, "optimizer": optimizer_state}


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


def load_checkpoint(accelerator, module, optimizer, path: Path, engine) -> TrainerState:
    """Restore weights, optimizer, scheduler and RNG states from `path`; returns its trainer state. Every process
    must call this."""
    state = TrainerState.read(path)
    _check_same_processes(state, engine, path)
    if engine.shards:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sharded = _sharded_state(module, optimizer)
        dcp.load(sharded, checkpoint_id=str(path / SHARDED))
        set_state_dict(
            module,
            getattr(optimizer, "optimizer", optimizer),
            model_state_dict=sharded["model"],
            optim_state_dict=sharded["optimizer"],
        )
    elif not engine.deepspeed:  # DeepSpeed: accelerate's load_state restores them from DeepSpeed's checkpoint
        _load_hf_weights(accelerator.unwrap_model(module).model, path)
    with _optimizer_not_in_accelerate_state(accelerator, engine):
        accelerator.load_state(str(path / ACCELERATE_STATE))
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
