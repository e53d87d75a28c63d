"""A pair loss (DPO) under every engine, 2 CPU processes on gloo, equals one process: DDP (torchrun), FSDP2
(torch's fully_shard) and DeepSpeed ZeRO-3 (accelerate launch with the shipped config). 11 pairs at 2 x 2 pairs a
batch: the last training batch is uneven (accelerate repeats a pair, left out of the loss and the metrics), and
the 3 eval pairs are fewer than one global eval batch. Every rank's log is kept."""

import json

import pytest
import test_fsdp  # its FSDP2 launch environment (as configs/accelerate/fsdp.yaml exports it)
from helpers import (
    REPLICATED_REL,
    SHARDED_REL,
    assert_same_steps,
    assert_same_weights,
    cli_args,
    launch,
    read_metrics,
    write_jsonl,
)

from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train

TRAIN = dict(
    loss_type="sigmoid",
    num_train_epochs=2,
    train_sampling_strategy="sequential",
    logging_steps=1,
    learning_rate=1e-3,
    eval_steps=3,
    seed=3,
)


def pairs(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "prompt": f"Q{i}: " + ("tell me about the sea?" if i % 2 else "2 + 2?") + "\nA:",
            "chosen": f" It is {i}" + "!" * (i % 3),
            "rejected": " No" + "." * (i % 4),
        }
        for i in range(start, start + n)
    ]


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("pair-engines")
    made = []
    for name, rows in (("train", pairs(11)), ("eval", pairs(3, start=100))):
        data = write_jsonl(root / f"{name}.jsonl", rows)
        config = PrecomputeConfig(
            model=str(tiny_model_dir), dataset=str(data), output=str(root / name), max_length=64, shard_size=4
        )
        made.append(precompute(config))
    return made


@pytest.fixture(scope="module")
def one_process(caches, tmp_path_factory):
    cache, eval_cache = caches
    out = tmp_path_factory.mktemp("pair-one") / "run"
    config = dict(cache=str(cache), eval_cache=str(eval_cache), **TRAIN)
    train(TrainConfig(output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=2, **config))
    return out


@pytest.mark.parametrize(
    "engine, launch_kw, rel",
    [
        ("ddp", {}, REPLICATED_REL),
        ("fsdp2", {"env": test_fsdp.FSDP_ENV}, SHARDED_REL),
        ("deepspeed-zero3", {"accelerate_config": "deepspeed_zero3", "timeout": 400}, SHARDED_REL),
    ],
)
def test_two_processes_equal_one(engine, launch_kw, rel, caches, one_process, tmp_path):
    if engine.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    cache, eval_cache = caches
    args = cli_args(cache=cache, eval_cache=eval_cache, per_device_train_batch_size=2, per_device_eval_batch_size=1)
    launch(2, "train", *args, *cli_args(**TRAIN), "--output-dir", str(tmp_path / "two"), log_dir=tmp_path / "logs",
           **launch_kw)  # fmt: skip
    one, two = read_metrics(one_process), read_metrics(tmp_path / "two")
    assert len([r for r in one if "loss" in r]) == 6  # 3 steps an epoch, the 3rd uneven
    assert_same_steps(two, one, rel)
    assert [r["eval_pairs"] for r in two if "eval_pairs" in r] == [3, 3]  # the repeated eval pair counted once
    assert abs(one[-2]["rewards/margins"]) > 1e-3  # it trained
    assert_same_weights(tmp_path / "two" / "model.safetensors", one_process / "model.safetensors")
    state = json.loads((tmp_path / "two" / "trainer_state.json").read_text())
    assert state["distributed"]["world_size"] == 2
