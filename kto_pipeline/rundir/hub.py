"""`train --push-to-hub`: the final model, its tokenizer and its model card uploaded to the Hugging Face Hub.

As trl's `push_to_hub` (transformers.Trainer's): the run directory's files, without checkpoints and scratch, into the
repository `--hub-model-id` (default: the output directory's name), created if it does not exist, with
huggingface_hub's own calls and its login (a saved token or HF_TOKEN). The hub cannot be reached from the machine
this was built on: the tests check what would be uploaded, not an upload.
"""

from __future__ import annotations

from pathlib import Path

from kto_pipeline.errors import KTOPipelineError

# what stays local: checkpoints (half-written ones too), the trackers' logs, the run's own markers
LOCAL_ONLY = ["checkpoint-*/**", ".checkpoint-*/**", "tensorboard/**", "_*", ".*"]


def repo_id(out: Path, hub_model_id: str | None) -> str:
    """The repository a run pushes to: --hub-model-id, else the output directory's name (trl's default)."""
    return hub_model_id or Path(out).resolve().name


def push_run(out: Path, hub_model_id: str | None, api=None) -> str:
    """Upload the run directory `out` (its final model, tokenizer, README.md model card, metrics) to the Hub; returns
    the repository id. A failure keeps everything local and says how to push later."""
    from huggingface_hub import HfApi

    api = api or HfApi()
    repo = repo_id(out, hub_model_id)
    try:
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(
            folder_path=str(out), repo_id=repo, ignore_patterns=LOCAL_ONLY, commit_message="kto-pipeline train"
        )
    except Exception as exc:  # unreachable hub, no token, no rights: the run itself is complete on disk
        raise KTOPipelineError(
            f"--push-to-hub: the run is saved in {out}, but uploading it to {repo} failed ({type(exc).__name__}: "
            f"{exc}). Push it later with `hf upload {repo} {out}` (huggingface_hub's command line)."
        ) from None
    return repo
