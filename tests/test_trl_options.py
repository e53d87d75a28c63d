"""What a trl user reaches for in train: --optim, --run-name, --push-to-hub / --hub-model-id (what would be
uploaded: the hub cannot be reached here) and --use-peft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kto_pipeline import KTOPipelineError, TrainConfig, train

SHORT = dict(max_steps=1, per_device_train_batch_size=4, bf16=False, logging_steps=1)


def test_optim_chooses_the_update(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from kto_pipeline.stages.train.policy import make_optimizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fused = make_optimizer(TrainConfig(cache="c", output_dir="o"), model)
    loop = make_optimizer(TrainConfig(cache="c", output_dir="o", optim="adamw_torch"), model)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    assert isinstance(loop, torch.optim.AdamW) and not loop.defaults["fused"]
    with pytest.raises(KTOPipelineError, match="--optim: must be one of adamw_torch_fused, adamw_torch"):
        TrainConfig(cache="c", output_dir="o", optim="sgd")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(KTOPipelineError, match="--optim adamw_8bit: bitsandbytes is not installed"):
            make_optimizer(TrainConfig(cache="c", output_dir="o", optim="adamw_8bit"), model)


def test_adamw_torch_trains_as_the_fused_kernel_does(small_cache, tmp_path):
    runs = {}
    for optim in ("adamw_torch_fused", "adamw_torch"):
        train(
            TrainConfig(
                cache=str(small_cache), output_dir=str(tmp_path / optim), optim=optim, **{**SHORT, "max_steps": 3}
            )
        )
        runs[optim] = [json.loads(line) for line in (tmp_path / optim / "metrics.jsonl").read_text().splitlines()]
    losses = {k: [r["loss"] for r in v] for k, v in runs.items()}
    assert losses["adamw_torch"] == pytest.approx(losses["adamw_torch_fused"], rel=1e-5)


def test_run_name_names_the_trackers_run(small_cache, tmp_path, monkeypatch):
    from accelerate import Accelerator

    seen = {}
    monkeypatch.setattr(
        Accelerator,
        "init_trackers",
        lambda self, project, config=None, init_kwargs=None: seen.update(p=project, k=init_kwargs),
    )
    train(
        TrainConfig(
            cache=str(small_cache),
            output_dir=str(tmp_path / "r"),
            report_to="tensorboard",
            run_name="beta-0.1",
            **SHORT,
        )
    )
    assert seen == {"p": "kto-pipeline", "k": {"wandb": {"name": "beta-0.1"}}}
    assert json.loads((tmp_path / "r" / "run_config.json").read_text())["run_name"] == "beta-0.1"


class RecordingApi:
    """huggingface_hub.HfApi's two calls that a push makes, recorded; `fails` raises as an unreachable hub does."""

    def __init__(self, fails: bool = False):
        self.calls, self.fails = [], fails

    def create_repo(self, repo_id, exist_ok=False):
        if self.fails:
            raise ConnectionError("the hub cannot be reached")
        self.calls.append(("create_repo", repo_id, exist_ok))

    def upload_folder(self, folder_path, repo_id, ignore_patterns=None, commit_message=None):
        self.calls.append(("upload_folder", folder_path, repo_id, tuple(ignore_patterns or ())))


def uploaded(folder: Path, ignore_patterns) -> list[str]:
    """The files huggingface_hub's upload_folder would send: its own filter over the folder's files."""
    from huggingface_hub.utils import filter_repo_objects

    files = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    return sorted(filter_repo_objects(files, ignore_patterns=list(ignore_patterns)))


def test_push_to_hub_uploads_the_final_model_and_card_not_the_checkpoints(small_cache, tmp_path, monkeypatch):
    import huggingface_hub

    api = RecordingApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    out = tmp_path / "my-kto-run"
    train(
        TrainConfig(
            cache=str(small_cache), output_dir=str(out), push_to_hub=True, save_steps=1, **{**SHORT, "max_steps": 2}
        )
    )
    assert api.calls[0] == ("create_repo", "my-kto-run", True)  # trl's default: the output directory's name
    (_, folder, repo, ignore) = api.calls[1]
    assert Path(folder) == out and repo == "my-kto-run"
    files = uploaded(out, ignore)
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json", "metrics.jsonl"} <= set(files)
    assert (out / "checkpoint-1").is_dir() and not [f for f in files if f.startswith("checkpoint-")]
    assert "hub_model_id" in json.loads((out / "run_config.json").read_text())


def test_a_failed_push_keeps_the_run_and_says_how_to_push_later(small_cache, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: RecordingApi(fails=True))
    out = tmp_path / "run"
    with pytest.raises(KTOPipelineError, match=r"--push-to-hub: the run is saved in .*uploading it to me/kto failed"):
        train(
            TrainConfig(cache=str(small_cache), output_dir=str(out), push_to_hub=True, hub_model_id="me/kto", **SHORT)
        )
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()


def test_use_peft_trains_trls_default_adapter(small_cache, tmp_path):
    train(TrainConfig(cache=str(small_cache), output_dir=str(tmp_path / "p"), use_peft=True, **SHORT))
    adapter = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
