"""Both stages under DeepSpeed, launched exactly as a user launches them (`accelerate launch --config_file
configs/accelerate/deepspeed_zero3.yaml`), 2 CPU processes over gloo: ZeRO-3's reference pass writes the 1-process
cache, ZeRO-3 training gives the 1-process steps and weights and resumes bit for bit, and ZeRO-2 with bf16 trains in
the regime of one process (step-1 rewards zero against a cache made in it).

DeepSpeed is an optional extra (`pip install 'kto-pipeline[deepspeed]'`, in the dev extra): without it these skip.
The first DeepSpeed process group on a machine compiles a shared-memory op (about 70 s here, then cached)."""

import json
import shutil

import numpy as np
import pytest
from helpers import cli_args, launch, read_metrics, train_config, unpaired_rows, write_jsonl

from kto_pipeline import PrecomputeConfig, precompute, train
from kto_pipeline.cache import open_cache

pytest.importorskip("deepspeed")

PRECOMPUTE = dict(max_length=64, shard_size=6)
TRAIN = dict(max_steps=4, logging_steps=1, learning_rate=1e-3, save_steps=2, seed=3)


def accelerate_launch(config: str, *args: str, log_dir) -> None:
    """`accelerate launch --config_file configs/accelerate/CONFIG.yaml --num_processes 2 -m kto_pipeline ARGS`
    (helpers.launch)."""
    launch(2, *args, accelerate_config=config, ddp_timeout=120, timeout=400, log_dir=log_dir)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("ds") / "d.jsonl", unpaired_rows(40))


@pytest.mark.slow
def test_zero3_both_stages_equal_one_process_and_resume(tmp_path, tiny_model_dir, data):
    from safetensors.torch import load_file

    one_cache = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c1"), **PRECOMPUTE)
    )
    pre = cli_args(model=tiny_model_dir, dataset=data, output=tmp_path / "c3", **PRECOMPUTE)
    accelerate_launch("deepspeed_zero3", "precompute", *pre, log_dir=tmp_path / "logs-pre")
    three = open_cache(tmp_path / "c3", verify=True)
    assert three.manifest["distributed"] == {"engine": "deepspeed-zero3", "world_size": 2}
    for a, b in zip(three.table.to_pylist(), open_cache(one_cache).table.to_pylist(), strict=True):
        assert a["example_id"] == b["example_id"] and a["kl_completion_ids"] == b["kl_completion_ids"]
        np.testing.assert_allclose(a["ref_token_logps"], b["ref_token_logps"], atol=1e-5)
        np.testing.assert_allclose(a["ref_kl_token_logps"], b["ref_kl_token_logps"], atol=1e-5)

    train(train_config(one_cache, tmp_path / "one", per_device_train_batch_size=8, **TRAIN))
    args = cli_args(cache=one_cache, per_device_train_batch_size=4, no_bf16=True, **TRAIN)
    accelerate_launch("deepspeed_zero3", "train", *args, "--output-dir", str(tmp_path / "z3"), log_dir=tmp_path / "l")
    one, z3 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "z3")
    assert len(z3) == 4
    for a, b in zip(z3, one, strict=True):
        for key in ("loss", "grad_norm", "kl", "rewards/chosen", "logps/chosen"):
            assert a[key] == pytest.approx(b[key], rel=2e-3, abs=1e-6), (a["step"], key)
    w1, w3 = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "z3" / "model.safetensors")
    assert w1.keys() == w3.keys()  # gathered whole (zero3_save_16bit_model), float32
    for key in w1:
        assert float((w1[key] - w3[key]).norm() / w1[key].norm()) < 1e-4, key
    state = json.loads((tmp_path / "z3" / "trainer_state.json").read_text())
    assert state["distributed"] == {"engine": "deepspeed-zero3", "world_size": 2}
    assert not (tmp_path / "z3" / "checkpoint-2" / "model.safetensors").exists()  # weights once: DeepSpeed's

    resumed = tmp_path / "z3-resumed"
    shutil.copytree(tmp_path / "z3", resumed)
    (resumed / "model.safetensors").unlink()
    (resumed / "trainer_state.json").unlink()
    resume = [*args, "--output-dir", str(resumed), "--resume-from", str(resumed / "checkpoint-2")]
    accelerate_launch("deepspeed_zero3", "train", *resume, log_dir=tmp_path / "logs-resume")
    assert read_metrics(resumed) == z3
    w4 = load_file(resumed / "model.safetensors")
    assert all(bool((w3[k] == w4[k]).all()) for k in w3)


@pytest.mark.slow
def test_zero2_bf16_trains_in_the_regime_of_one_process(tmp_path, tiny_model_dir, data):
    cache = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), bf16=True, **PRECOMPUTE
        )
    )
    train(train_config(cache, tmp_path / "one", per_device_train_batch_size=8, bf16=True, **TRAIN))
    args = cli_args(cache=cache, per_device_train_batch_size=4, bf16=True, **TRAIN)
    accelerate_launch("deepspeed_zero2", "train", *args, "--output-dir", str(tmp_path / "z2"), log_dir=tmp_path / "l")
    state = json.loads((tmp_path / "z2" / "trainer_state.json").read_text())
    assert state["distributed"] == {"engine": "deepspeed-zero2", "world_size": 2}
    assert state["precision"] == "float32 weights under bfloat16 autocast"
    one, z2 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "z2")
    for key in ("rewards/chosen", "rewards/rejected", "kl"):  # step 1: policy = reference, in the cache's regime
        assert z2[0][key] == 0.0 and one[0][key] == 0.0, (key, z2[0][key], one[0][key])
    for a, b in zip(z2, one, strict=True):
        for key in ("loss", "grad_norm", "kl"):
            assert a[key] == pytest.approx(b[key], rel=2e-3, abs=1e-6), (a["step"], key)
