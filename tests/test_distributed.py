"""Resume reproduces an uninterrupted run exactly (after a SIGKILL); checkpointing options; the 1-process cache
and settings that the 2-process DDP tests (tests/test_multinode.py) compare with; compiled layers (the GPU default)
under DDP and FSDP2 on 2 processes equal to one eager process."""

import json
import signal
import subprocess
import time

import pytest
from helpers import (
    FSDP_ENV,
    assert_same_steps,
    cli_args,
    cli_cmd,
    launch,
    launch_env,
    read_metrics,
    train_config,
    unpaired_rows,
    write_jsonl,
)

from kto_pipeline import KTOPipelineError, PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import open_cache

# (helpers.launch_env sets no ACCELERATE_USE_CPU: several processes on a machine without a GPU run on the CPU (gloo)
# by themselves)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("dist") / "d.jsonl", unpaired_rows(40))


@pytest.fixture(scope="module")
def cache_1proc(tmp_path_factory, tiny_model_dir, data):
    out = tmp_path_factory.mktemp("dist") / "cache1"
    return precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(out), max_length=64, shard_size=6)
    )


TRAIN = dict(max_steps=4, logging_steps=1, learning_rate=1e-3, save_steps=2, seed=3)
STEP_KEYS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "grad_norm")


# (2 processes equal to one, DDP, both stages: tests/test_multinode.py, with the processes on two launchers)

COMPILED = dict(attention_kernel="dense", **TRAIN)


@pytest.fixture(scope="module")
def one_eager_process(tmp_path_factory, cache_1proc):
    """The run that both engines' compiled runs are compared with: one eager process x 8 rows (the tests only read
    it)."""
    out = tmp_path_factory.mktemp("dist") / "one"
    train(train_config(cache_1proc, out, **{**COMPILED, "per_device_train_batch_size": 8}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_compiled_layers_on_two_processes_equal_one_eager_process(tmp_path, cache_1proc, one_eager_process, engine):
    """Training's decoder layers compiled (`--torch-compile`, the default on CUDA GPUs) under DDP and under FSDP2: 2
    processes x 4 rows give the steps of one eager process x 8 (within the compiled-against-eager tolerance of
    tests/test_compile.py), with no graph break and no eager fallback. The dense mask: by tree, attention's calls
    follow the trees."""
    args = cli_args(cache=cache_1proc, output_dir=tmp_path / "two", per_device_train_batch_size=4, **COMPILED)
    env = FSDP_ENV if engine == "fsdp2" else None
    launch(2, "train", *args, "--torch-compile", env=env, log_dir=tmp_path / "logs", timeout=600)
    two, one = read_metrics(tmp_path / "two"), read_metrics(one_eager_process)
    assert len(two) == 4
    assert_same_steps(two, one, 1e-3, STEP_KEYS)
    state = json.loads((tmp_path / "two" / "trainer_state.json").read_text())
    assert state["distributed"]["engine"] == engine and state["distributed"]["world_size"] == 2, state["distributed"]
    compiled = state["compile"]
    assert compiled["graphs"] > 0 and compiled["graph_breaks"] == 0 and not compiled.get("eager_fallback"), compiled


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_metrics_and_weights(tmp_path, cache_1proc):
    """A run SIGKILLed once its checkpoint-6 is written and resumed gives the uninterrupted run's metrics and weights
    bit for bit. 12 epochs of 5 steps (40 rows, 2 micro-batches of 4 a step): the resumed run crosses epoch
    boundaries, and the killed run still has 54 steps to go when its checkpoint-6 appears, so that the kill lands
    before its end however busy the machine (25 steps took no less time in the suite: 20 s either way)."""
    from safetensors.torch import load_file

    args = dict(
        cache=str(cache_1proc),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=12,
        logging_steps=1,
        learning_rate=1e-3,
        save_steps=3,
        save_total_limit=2,
        seed=5,
    )
    train(TrainConfig(output_dir=str(tmp_path / "full"), **args))
    cmd = cli_cmd("train", "--output-dir", str(tmp_path / "killed"), *cli_args(**args))
    proc = subprocess.Popen(cmd, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "killed" / "checkpoint-6").exists():
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "model.safetensors").exists(), "killed before the end"
    checkpoints = sorted(p.name for p in (tmp_path / "killed").glob("checkpoint-*"))
    assert 1 <= len(checkpoints) <= 2  # --save-total-limit 2

    train(TrainConfig(output_dir=str(tmp_path / "killed"), resume=True, **args))
    assert read_metrics(tmp_path / "killed") == read_metrics(tmp_path / "full")  # every step, bit for bit
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "killed" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
    # 60 steps: every 3rd step and the last, the newest 2 kept
    assert sorted(p.name for p in (tmp_path / "full").glob("checkpoint-*")) == ["checkpoint-57", "checkpoint-60"]


def test_resume_without_checkpoint_is_explained(tmp_path, small_cache):
    with pytest.raises(KTOPipelineError, match="holds no checkpoint to resume from"):
        train(TrainConfig(cache=str(small_cache), output_dir=str(tmp_path / "x"), resume=True))
    with pytest.raises(KTOPipelineError, match="not a kto-pipeline checkpoint"):
        train(TrainConfig(cache=str(small_cache), output_dir=str(tmp_path / "x"), resume_from=str(tmp_path)))


def test_gradient_checkpointing_gives_the_same_steps(tmp_path, small_cache):
    """The tiny model's keys/values are as large as its hidden states (2 key/value heads of 16 in 64): checkpointed,
    its KL completions run with their prompts again (tests/test_packing.py has the kept cache)."""
    train(train_config(small_cache, tmp_path / "plain"))
    train(train_config(small_cache, tmp_path / "ckpt", gradient_checkpointing=True))
    for a, b in zip(read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "ckpt"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"])
    assert json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())["kl_forward"] == (
        "with the prompts run again"
    )


def test_fp16_needs_a_gpu(tmp_path, small_cache):
    with pytest.raises(KTOPipelineError, match="--fp16 needs a CUDA GPU"):
        train(TrainConfig(cache=str(small_cache), output_dir=str(tmp_path / "x"), fp16=True))


@pytest.mark.parametrize(
    "name,kind",
    [("ddp", "MULTI_GPU"), ("fsdp", "FSDP"), ("deepspeed_zero2", "DEEPSPEED"), ("deepspeed_zero3", "DEEPSPEED")],
)
def test_shipped_accelerate_configs_parse(name, kind):
    """The recipes in configs/accelerate are valid accelerate config files (run on GPUs, not here)."""
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(__file__).resolve().parent.parent / "configs" / "accelerate" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type.name == kind and config.mixed_precision == "bf16"
    if name.startswith("deepspeed"):
        assert config.deepspeed_config["zero_stage"] == int(name[-1])


def test_fresh_run_in_reused_dir_drops_stale_checkpoints(tmp_path, small_cache):
    base = dict(
        cache=str(small_cache),
        output_dir=str(tmp_path / "r"),
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-3,
    )
    train(TrainConfig(max_steps=5, save_steps=2, **base))
    names = ["checkpoint-2", "checkpoint-4", "checkpoint-5"]  # every 2 steps and the last
    assert sorted(p.name for p in (tmp_path / "r").glob("checkpoint-*")) == names
    train(TrainConfig(max_steps=3, save_steps=1, save_total_limit=2, overwrite_output_dir=True, beta=0.5, **base))
    assert sorted(p.name for p in (tmp_path / "r").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    state = json.loads((tmp_path / "r" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["run_config"]["beta"] == 0.5  # its own checkpoint, not the old run's


def test_resume_with_other_batch_settings_is_refused(tmp_path, small_cache):
    base = dict(cache=str(small_cache), output_dir=str(tmp_path / "r"), logging_steps=1, max_steps=4)
    train(TrainConfig(per_device_train_batch_size=4, save_steps=2, **base))
    with pytest.raises(KTOPipelineError, match="--per-device-train-batch-size: checkpoint 4, now 6"):
        train(TrainConfig(per_device_train_batch_size=6, resume=True, **base))


@pytest.mark.slow
def test_append_two_processes_equals_one(tmp_path, tiny_model_dir, data):
    """An append under two processes writes the shards (numbered after the cache's) and manifest one process
    would write."""
    import shutil

    first = write_jsonl(tmp_path / "first.jsonl", unpaired_rows(40)[:16])
    base = precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(first), output=str(tmp_path / "base"), max_length=64, shard_size=6
        )
    )
    shutil.copytree(base, tmp_path / "two")
    precompute(
        PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(data), output=str(base), max_length=64, shard_size=6, append=True
        )
    )
    args = ["--model", str(tiny_model_dir), "--dataset", str(data), "--output", str(tmp_path / "two")]
    result = launch(
        2, "precompute", *args, "--max-length", "64", "--shard-size", "6", "--append", log_dir=tmp_path / "logs"
    )
    assert result.stdout.count("append finished") == 1
    two, one = open_cache(tmp_path / "two", verify=True), open_cache(base, verify=True)
    assert two.table.to_pylist() == one.table.to_pylist()
    assert [s["file"] for s in two.manifest.shards] == [s["file"] for s in one.manifest.shards]
    assert [s["sha256"] for s in two.manifest.shards] == [s["sha256"] for s in one.manifest.shards]
    assert (
        two.manifest.segments[1]["rows"] == 24 and two.manifest.segments[1]["shards"][0] == "shards/shard-00003.arrow"
    )
