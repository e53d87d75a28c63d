"""The shipped configs/accelerate files work under `accelerate launch --config_file`: each one's launch environment,
built by accelerate's own launch code, lets the train stage's `Accelerator(...)` construct, with the distributed
type and plugin settings the file asks for, and leaves --gradient-accumulation-steps to the train stage.

No GPU is needed: the launch runs with `--num_processes 1`, and torchrun's start of the process is replaced by
recording the environment it would be given. The probe process gets that environment as is, without the variables
torchrun itself adds (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*): with LOCAL_RANK set, accelerate starts DeepSpeed's
process group, whose first start on a CPU machine compiles DeepSpeed's shared-memory op (about 70 s on 2 cores) and
which is not what is tested here. Nor ACCELERATE_USE_CPU, which would make accelerate drop the DeepSpeed settings
instead of checking them. On a machine without GPUs one process then reports DistributedType.NO for the ddp and
fsdp files (MULTI_GPU and FSDP need CUDA devices), so their plugin settings are checked on the plugin the
Accelerator builds from the same environment."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "accelerate"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# Run in a fresh process (accelerate's state is global): construct the Accelerator as the train stage does
# (stages/train/stage.py `_accelerator`, but leaving the precision to the config file), report what it resolved.
PROBE = """
import json, os
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

accelerator = Accelerator(gradient_accumulation_steps=3)
state = accelerator.state
report = {
    "distributed_type": state.distributed_type.name,
    "mixed_precision": os.environ.get("ACCELERATE_MIXED_PRECISION"),
    "num_processes": accelerator.num_processes,
    "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
}
if state.deepspeed_plugin is not None:
    plugin = state.deepspeed_plugin
    config = plugin.deepspeed_config
    report["deepspeed"] = {
        "zero_stage": plugin.zero_stage,
        "config_gradient_accumulation_steps": config.get("gradient_accumulation_steps"),
        "config_gradient_clipping": config.get("gradient_clipping", "auto"),
        "config_bf16": config.get("bf16", {}).get("enabled"),
        "offload_optimizer": config["zero_optimization"]["offload_optimizer"]["device"],
        "offload_param": config["zero_optimization"]["offload_param"]["device"],
        "gather_16bit_on_save": config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"],
        "zero3_init": plugin.zero3_init_flag,
    }
if os.environ.get("ACCELERATE_USE_FSDP") == "true":
    plugin = FullyShardedDataParallelPlugin()  # what Accelerator() built from the same environment
    report["fsdp"] = {
        "version": plugin.fsdp_version,
        "reshard_after_forward": plugin.reshard_after_forward,
        "state_dict_type": plugin.state_dict_type.name,
        "auto_wrap_policy": getattr(plugin.auto_wrap_policy, "__name__", None),
        "cpu_ram_efficient_loading": plugin.cpu_ram_efficient_loading,
        "activation_checkpointing": plugin.activation_checkpointing,
    }
print("REPORT " + json.dumps(report))
"""


def launch_env(config_file: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file CONFIG --num_processes 1 -m kto_pipeline` starts its process
    with: accelerate's launch_command (config file -> arguments -> prepare_multi_gpu_env / prepare_deepspeed_cmd_env),
    with torchrun's `run` replaced by a recorder."""
    import torch.distributed.run
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(
        ["--config_file", str(config_file), "--num_processes", "1", "-m", "kto_pipeline"]
    )
    recorded: dict[str, str] = {}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    with mock.patch.dict(os.environ, clean, clear=True):
        with mock.patch.object(torch.distributed.run, "run", lambda _args: recorded.update(os.environ)):
            launch_command(args)
    assert recorded, f"accelerate launch did not reach torchrun for {config_file.name}"
    return {**recorded, "OMP_NUM_THREADS": "1"}


def probe(env: dict[str, str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, cwd=CONFIGS
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line.removeprefix("REPORT "))


def check(config_file: Path) -> None:
    name = config_file.stem
    env = launch_env(config_file)
    report = probe(env)
    assert report["num_processes"] == 1 and report["mixed_precision"] == "bf16"
    # --gradient-accumulation-steps (passed to Accelerator) is what the run uses, not a value from the config
    assert report["gradient_accumulation_steps"] == 3, report
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env, "the config must leave it to the train stage"
    if name.startswith("deepspeed"):
        stage = int(name[-1])
        assert report["distributed_type"] == "DEEPSPEED", report
        ds = report["deepspeed"]
        assert ds["zero_stage"] == stage and ds["zero3_init"] is (stage == 3)  # ZeRO-3 loads partitioned
        assert ds["offload_optimizer"] == ds["offload_param"] == "none"
        assert ds["config_bf16"] is True
        # filled in by accelerator.prepare (from the Accelerator's value): nothing in the config pins them
        assert ds["config_gradient_accumulation_steps"] == "auto"
        assert ds["config_gradient_clipping"] == "auto"
        assert ds["gather_16bit_on_save"] is (stage == 3)
    elif name == "fsdp":
        assert report["distributed_type"] == "NO", report  # FSDP needs GPUs; the plugin's settings:
        assert report["fsdp"] == {
            "version": 2,
            "reshard_after_forward": True,
            "state_dict_type": "FULL_STATE_DICT",
            "auto_wrap_policy": "transformer_auto_wrap_policy",
            "cpu_ram_efficient_loading": True,
            "activation_checkpointing": False,
        }
    else:
        assert name == "ddp" and report["distributed_type"] == "NO", report  # MULTI_GPU needs GPUs
        assert "fsdp" not in report and "deepspeed" not in report


@pytest.mark.parametrize(
    "name",
    [
        "ddp",
        "fsdp",
        pytest.param(
            "deepspeed_zero2",
            marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs pip install 'kto-pipeline[deepspeed]'"),
        ),
        pytest.param(
            "deepspeed_zero3",
            marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs pip install 'kto-pipeline[deepspeed]'"),
        ),
    ],
)
def test_shipped_config_builds_an_accelerator(name):
    check(CONFIGS / f"{name}.yaml")


def test_every_shipped_config_is_tested():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == ["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"]
