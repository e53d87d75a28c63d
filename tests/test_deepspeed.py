"""Both stages under DeepSpeed, launched exactly as a user launches them (`accelerate launch --config_file
configs/accelerate/deepspeed_zero3.yaml`), 2 CPU processes over gloo: ZeRO-3's reference pass writes the 1-process
cache, ZeRO-3 training gives the 1-process steps and weights and resumes bit for bit, both loading the model
partitioned (zero.Init, the weights read by the main process only); LoRA with --merge, --max-grad-norm (a value and
0) and `precompute --append` give what one process gives; ZeRO-2 with bf16 trains in the regime of one process
(step-1 rewards zero against a cache made in it).

DeepSpeed is an optional extra (`pip install 'kto-pipeline[deepspeed]'`, in the dev extra): without it these skip.
The first DeepSpeed process group on a machine compiles a shared-memory op (about 70 s here, then cached)."""

import json
import re
import shutil

import numpy as np
import pytest
from helpers import (
    check_peak_memory,
    cli_args,
    launch,
    rank_logs,
    read_metrics,
    train_config,
    unpaired_rows,
    write_jsonl,
)

from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import open_cache

pytest.importorskip("deepspeed")

PRECOMPUTE = dict(max_length=64, shard_size=6)
TRAIN = dict(max_steps=4, logging_steps=1, learning_rate=1e-3, save_steps=2, seed=3)


def accelerate_launch(config: str, *args: str, log_dir) -> str:
    """`accelerate launch --config_file configs/accelerate/CONFIG.yaml --num_processes 2 -m kto_pipeline ARGS`
    (helpers.launch); returns everything the launch printed, every rank's log included."""
    result = launch(2, *args, accelerate_config=config, ddp_timeout=120, timeout=400, log_dir=log_dir)
    return f"{result.stdout}\n{result.stderr}\n{rank_logs(log_dir, tail=10**6)}"


def loaded_partitioned(output: str) -> list[int]:
    """The parameters each process held once the model loaded, as the stage printed them (ZeRO-3 with
    zero3_init_flag): each holds its partition only (half, up to each tensor's padding), the main one read them."""
    found = re.search(r"partitioned as it loaded \(zero.Init\), the weights read by the main process only: "
                      r"([\d,]+) parameters, held process 0 ([\d,]+), process 1 ([\d,]+)", output)  # fmt: skip
    assert found, output[-3000:]
    total, *held = (int(n.replace(",", "")) for n in found.groups())
    assert all(total / 2 <= n < total / 2 + 2000 for n in held), (total, held)  # padding: < 2 a tensor
    return held


HOOKS_WARNING = "unknown inputs or outputs type"  # DeepSpeed ZeRO-3: an output whose tensors its hooks cannot see


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("ds") / "d.jsonl", unpaired_rows(40))


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_model_dir, data):
    """One process's float32 cache of `data`, which the float32 training runs read (none writes into it)."""
    out = tmp_path_factory.mktemp("ds-cache") / "c1"
    return precompute(PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(out), **PRECOMPUTE))


# the losses weighted x10, so that every step's gradient norm is well above 1.0 (AdamW's step is nearly scale-free:
# only the clipping of one step against another's shows in the weights)
CLIPPED = dict(desirable_weight=10.0, undesirable_weight=10.0)


def check_clipping(tmp_path, run: str, max_grad_norm: float) -> None:
    """DeepSpeed clipped inside its own step at --max-grad-norm (0: not at all): the run TMP/RUN (2 processes) has
    one process's steps and weights with the same --max-grad-norm (TMP/one), and not one process's at 1.0 (TMP/one-at-1,
    accelerate's fill-in)."""
    from safetensors.torch import load_file

    one, ds = read_metrics(tmp_path / "one"), read_metrics(tmp_path / run)
    for a, b in zip(ds, one, strict=True):
        assert a.keys() == b.keys() and ("grad_norm" in a) is (max_grad_norm > 0)  # logged where clipping is on
        for key in a.keys() & {"loss", "grad_norm"}:
            assert a[key] == pytest.approx(b[key], rel=2e-3, abs=1e-6), (a["step"], key)
    if max_grad_norm:
        assert all(r["grad_norm"] > max_grad_norm for r in one)  # every step clipped
    weights = {name: load_file(tmp_path / name / "model.safetensors") for name in ("one", "one-at-1", run)}

    def distance(a: str, b: str) -> float:
        return max(float((weights[a][k] - weights[b][k]).norm() / weights[a][k].norm()) for k in weights[a])

    assert distance("one", run) < 1e-5  # measured: 2e-7
    # measured: 8e-4 against 1.0 for 0.3, 8e-3 for 0 (off)
    assert distance("one-at-1", run) > 1e-4, "the clipping at --max-grad-norm made no difference: not tested"


@pytest.mark.slow
def test_zero3_both_stages_equal_one_process_and_resume(tmp_path, tiny_model_dir, data, cache):
    """The training run clips at --max-grad-norm 0.3 (its losses weighted x10: `CLIPPED`), so that it also shows
    that DeepSpeed clips inside its own step at the value asked (`check_clipping`): one launch fewer than a run of
    its own for that."""
    from safetensors.torch import load_file

    one_cache = cache
    pre = cli_args(model=tiny_model_dir, dataset=data, output=tmp_path / "c3", **PRECOMPUTE)
    output = accelerate_launch("deepspeed_zero3", "precompute", *pre, log_dir=tmp_path / "logs-pre")
    loaded_partitioned(output)
    assert HOOKS_WARNING not in output
    three = open_cache(tmp_path / "c3", verify=True)
    assert three.manifest["distributed"] == {"engine": "deepspeed-zero3", "world_size": 2}
    # the weights' hash, gathered a tensor at a time, is one process's: the same cache for train and --append
    assert three.manifest.fingerprint == open_cache(one_cache).manifest.fingerprint
    check_peak_memory(three.manifest["timing"]["peak_memory"])
    for a, b in zip(three.table.to_pylist(), open_cache(one_cache).table.to_pylist(), strict=True):
        assert a["example_id"] == b["example_id"] and a["kl_completion_ids"] == b["kl_completion_ids"]
        np.testing.assert_allclose(a["ref_token_logps"], b["ref_token_logps"], atol=1e-5)
        np.testing.assert_allclose(a["ref_kl_token_logps"], b["ref_kl_token_logps"], atol=1e-5)

    settings = dict(TRAIN, **CLIPPED)
    for name, norm in (("one", 0.3), ("one-at-1", 1.0)):
        train(train_config(one_cache, tmp_path / name, per_device_train_batch_size=8, max_grad_norm=norm, **settings))
    args = cli_args(cache=one_cache, per_device_train_batch_size=4, no_bf16=True, max_grad_norm=0.3, **settings)
    output = accelerate_launch(
        "deepspeed_zero3", "train", *args, "--output-dir", str(tmp_path / "z3"), log_dir=tmp_path / "l"
    )
    loaded_partitioned(output)
    assert HOOKS_WARNING not in output  # the scorer's outputs (PolicyScores) are named tuples its hooks walk
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
    check_peak_memory(state["peak_memory"])
    assert not (tmp_path / "z3" / "checkpoint-2" / "model.safetensors").exists()  # weights once: DeepSpeed's
    check_clipping(tmp_path, "z3", 0.3)

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


def test_the_scorers_outputs_are_seen_by_zero3_hooks():
    """DeepSpeed ZeRO-3 attaches its backward hooks to the tensors of a module's output, which it finds in tuples,
    lists and dicts (`apply_to_tensors_only`): every tensor of the policy's `PolicyScores`, nested `Scores`
    included, reaches them, and the output keeps its type."""
    import torch
    from deepspeed.runtime.zero.utils import apply_to_tensors_only

    from kto_pipeline.scoring.logprobs import PolicyScores, Scores

    def scores():
        return Scores(*(torch.randn(3, requires_grad=True) for _ in range(5)))

    seen = []

    def hook(tensor):
        seen.append(tensor)
        return tensor * 1

    def hidden(value):
        pytest.fail(f"ZeRO-3's hooks cannot see the tensors of {type(value)}")

    for output, tensors in ((PolicyScores(scores(), scores(), 12, True), 10), (PolicyScores(scores(), None, 3, 0), 5)):
        seen.clear()
        walked = apply_to_tensors_only(hook, output, warning_msg_fn=hidden)
        assert len(seen) == tensors and type(walked) is PolicyScores and type(walked.completions) is Scores
        assert walked.tokens_executed == output.tokens_executed and walked.completions.logps is not seen[0]


@pytest.mark.slow
def test_max_grad_norm_0_reaches_deepspeeds_clipping(tmp_path, cache):
    """DeepSpeed clips inside its own step, at --max-grad-norm, and not at all at 0: here 0, under ZeRO-2 (both
    stages share the setting; a value, 0.3, under ZeRO-3: test_zero3_both_stages_equal_one_process_and_resume)."""
    settings = dict(TRAIN, save_steps=0, **CLIPPED)
    for name, norm in (("one", 0.0), ("one-at-1", 1.0)):
        train(train_config(cache, tmp_path / name, per_device_train_batch_size=8, max_grad_norm=norm, **settings))
    args = cli_args(cache=cache, per_device_train_batch_size=4, no_bf16=True, max_grad_norm=0.0, **settings)
    accelerate_launch(
        "deepspeed_zero2", "train", *args, "--output-dir", str(tmp_path / "ds"), log_dir=tmp_path / "logs"
    )
    check_clipping(tmp_path, "ds", 0.0)


@pytest.mark.slow
def test_zero3_lora_with_merge_equals_one_process(tmp_path, cache):
    """LoRA adapters on a base loaded partitioned; --merge merges the saved adapter into a fresh base, built whole on
    the main process alone (outside zero.Init, whose partitioning would wait for the others) while they wait. (LoRA
    dropout off: its masks depend on how rows are spread over processes.)"""
    from safetensors.torch import load_file

    config = dict(cache=str(cache), max_steps=3, logging_steps=1, learning_rate=1e-2, seed=3, lora_r=4)
    config.update(lora_dropout=0.0, merge=True, train_sampling_strategy="sequential")
    train(TrainConfig(output_dir=str(tmp_path / "one"), per_device_train_batch_size=8, **config))
    args = cli_args(**config, per_device_train_batch_size=4, no_bf16=True, output_dir=tmp_path / "z3")
    output = accelerate_launch("deepspeed_zero3", "train", *args, log_dir=tmp_path / "logs")
    loaded_partitioned(output)
    for a, b in zip(read_metrics(tmp_path / "z3"), read_metrics(tmp_path / "one"), strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=2e-3), (a["step"], key)
    adapter = load_file(tmp_path / "z3" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)  # the adapter alone, gathered whole
    w1, w3 = (load_file(tmp_path / run / "merged" / "model.safetensors") for run in ("one", "z3"))
    assert w1.keys() == w3.keys() and not any("lora_" in k for k in w3)
    for key in w1:
        assert float((w1[key] - w3[key]).norm() / w1[key].norm().clamp(min=1e-12)) < 1e-4, key


@pytest.mark.slow
def test_append_equals_one_process(tmp_path, tiny_model_dir):
    """`precompute --append` of a grown log under DeepSpeed: the rows, their KL partners and (within the sharded
    pass's tolerance) their values are one process's append's. 16 new rows in shards of 6: in the second round one
    process has no shard (under ZeRO-3 it runs filler forwards); the weights' hash, gathered a tensor at a time
    under ZeRO-3, must be the cache's or the append is refused."""
    rows = unpaired_rows(40)
    first, log = write_jsonl(tmp_path / "first.jsonl", rows[:24]), write_jsonl(tmp_path / "log.jsonl", rows)
    one = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(first), output=str(tmp_path / "one"), **PRECOMPUTE)
    )
    two = tmp_path / "two"
    shutil.copytree(one, two)
    grown = PrecomputeConfig(model=str(tiny_model_dir), dataset=str(log), output=str(one), append=True, **PRECOMPUTE)
    precompute(grown)
    args = cli_args(model=tiny_model_dir, dataset=log, output=two, append=True, **PRECOMPUTE)
    # ZeRO-3 only: under ZeRO-2 the reference is whole on every process and scores as under DDP (measured once,
    # when the test also ran under ZeRO-2: the same rows and values)
    accelerate_launch("deepspeed_zero3", "precompute", *args, log_dir=tmp_path / "logs")
    ones, twos = open_cache(one, verify=True), open_cache(two, verify=True)
    segment_one, segment_two = ones.manifest.segments[1], twos.manifest.segments[1]
    for key in ("rows", "matched_rows", "first_example_id", "shards", "kl"):
        assert segment_two[key] == segment_one[key], key
    assert segment_two["timing"]["processes"] == 2
    rows_one, rows_two = ones.table.to_pylist(), twos.table.to_pylist()
    assert len(rows_two) == len(rows_one) == 40
    for a, b in zip(rows_two, rows_one, strict=True):
        for key in ("example_id", "label", "prompt_ids", "completion_ids", "kl_example_id", "kl_completion_ids"):
            assert a[key] == b[key], key
        np.testing.assert_allclose(a["ref_token_logps"], b["ref_token_logps"], atol=1e-5)
        np.testing.assert_allclose(a["ref_kl_token_logps"], b["ref_kl_token_logps"], atol=1e-5)
