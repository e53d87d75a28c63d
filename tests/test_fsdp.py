"""Both stages under FSDP2 (torch's fully_shard, 2 CPU processes on gloo via torchrun), on deliberately skewed
shards, give the 1-process numbers, save sharded checkpoints, come back by themselves after a rank is SIGKILLed
(torchrun --max-restarts, --autoresume), stop at a step boundary on SIGTERM, and refuse what they cannot do with a
message that says what to change. Some runs have their 2 processes on two machines (two torchrun launchers meeting
at a c10d rendezvous, as on a cluster: tests/test_multinode.py), and equal the runs under one launcher.

The skew (rows in blocks of 4; one block is one process's micro-batch and one precompute shard):
  - even blocks (process 0): long prompts, desirable only (one class on one process);
  - odd blocks (process 1): short prompts, both classes;
  - 35 rows: not divisible by the world size; 9 precompute shards, so in the last round one process has none
    (it runs filler forwards); the last training batch is uneven (accelerate repeats rows: 3 real of 8);
  - an eval set of 3 rows, smaller than one global eval batch (2 x 2): one process gets a repeated row. (An eval
    set smaller than the world size, 1 row at 2 processes, cannot exist: KTO needs 2 rows to draw KL partners.)
With --max-tokens-per-batch 64, a long shard takes 4 reference forwards and a short one 1.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from helpers import (
    FSDP_ENV,
    SHARDED_REL,
    assert_same_rows,
    assert_same_steps,
    assert_same_weights,
    check_peak_memory,
    cli_args,
    launch,
    launch_nodes,
    rank_logs,
    read_metrics,
    unpaired_rows,
    write_jsonl,
)

from kto_pipeline import KTOPipelineError, PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import open_cache
from kto_pipeline.runtime.launch import SHARED_CHECK_FILE

PRECOMPUTE_ARGS = ["--max-length", "64", "--shard-size", "4", "--max-tokens-per-batch", "64"]
TRAIN = dict(
    per_device_train_batch_size=4,
    num_train_epochs=2,
    train_sampling_strategy="sequential",
    logging_steps=1,
    learning_rate=1e-3,
    save_steps=2,
    eval_steps=4,
    per_device_eval_batch_size=2,
    seed=3,
)


def skewed_rows(n: int = 35) -> list[dict]:
    rows = []
    for i in range(n):
        if (i // 4) % 2 == 0:  # process 0: long prompts, desirable only
            rows.append({"prompt": f"User: tell me about the sea {i:02d}?\nA:", "completion": " Sure" + "!" * (i % 4)})
            rows[-1]["label"] = True
        else:  # process 1: short prompts, both classes
            rows.append({"prompt": f"Q{i}?", "completion": " Yes" if i % 2 else " No", "label": bool(i % 2)})
    return rows


@pytest.fixture(scope="module")
def skewed(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("fsdp")
    data = write_jsonl(root / "d.jsonl", skewed_rows())
    eval_data = write_jsonl(root / "e.jsonl", skewed_rows(3))
    cache = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(root / "cache1"), **_pre())
    )
    eval_cache = precompute(
        PrecomputeConfig(model=str(tiny_model_dir), dataset=str(eval_data), output=str(root / "eval"), **_pre())
    )
    return root, data, cache, eval_cache


def _pre() -> dict:
    return dict(max_length=64, shard_size=4, max_tokens_per_batch=64)


@pytest.mark.slow
@pytest.mark.parametrize("one_reader", [True, False], ids=["main-reads-on-two-machines", "every-process-reads"])
def test_fsdp2_precompute_on_skewed_shards_equals_one_process(tmp_path, tiny_model_dir, skewed, one_reader):
    """With the weights read by the main process only (configs/accelerate/fsdp.yaml's setting), the 2 processes run
    on two machines, played by two torchrun launchers of one process each that meet at a c10d rendezvous, as `srun
    torchrun` starts one launcher per node (tests/test_multinode.py); with every process reading them, under one
    launcher of 2 processes (the pairs and --append tests below precompute under one launcher with the main process
    reading). One launch each."""
    root, data, cache1, _ = skewed
    out = tmp_path / "cache2"
    args = ["precompute", "--model", str(tiny_model_dir), "--dataset", str(data), "--output", str(out)]
    env = {**FSDP_ENV, "FSDP_CPU_RAM_EFFICIENT_LOADING": str(one_reader).lower()}
    if one_reader:
        launchers = launch_nodes(2, *args, *PRECOMPUTE_ARGS, env=env, log_dir=tmp_path / "logs")
        stdout = "".join(r.stdout for r in launchers)
        assert not (out / SHARED_CHECK_FILE).exists()
    else:
        stdout = launch(2, *args, *PRECOMPUTE_ARGS, env=env, log_dir=tmp_path / "logs").stdout
    assert "sharded (FSDP2) over 2 processes" in stdout
    assert ("the weights read by the main process only" in stdout) is one_reader
    two, one = open_cache(out, verify=True), open_cache(cache1, verify=True)
    assert two.manifest["distributed"] == {"engine": "fsdp2", "world_size": 2}
    assert two.manifest.fingerprint == one.manifest.fingerprint  # the same cache, reusable by either
    check_peak_memory(two.manifest["timing"]["peak_memory"])
    assert "memory       peak private host memory: rank 0 " in stdout
    assert len(one.table) == 35
    assert_same_rows(two.table.to_pylist(), one.table.to_pylist())


@pytest.mark.slow
@pytest.mark.parametrize("pairs_only", [False, True], ids=["with-kl", "pairs-only"])
def test_fsdp2_precompute_of_pairs_equals_one_process(tmp_path, tiny_model_dir, pairs_only):
    """Paired data under FSDP2: the same rows, pair partners and values as one process, with KL completions or
    with --pairs-only (each pair one tree)."""
    rows = [
        {"prompt": f"Question {i}?" + " Why?" * (i % 3), "chosen": f" It is {i}.", "rejected": " No."} for i in range(9)
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = PrecomputeConfig(str(tiny_model_dir), str(data), str(tmp_path / "one"), pairs_only=pairs_only, **_pre())
    one = open_cache(precompute(config), verify=True)
    args = ["precompute", "--model", str(tiny_model_dir), "--dataset", str(data), "--output", str(tmp_path / "two")]
    launch(
        2, *args, *PRECOMPUTE_ARGS, *(["--pairs-only"] if pairs_only else []), env=FSDP_ENV, log_dir=tmp_path / "logs"
    )
    two = open_cache(tmp_path / "two", verify=True)
    assert two.manifest["distributed"] == {"engine": "fsdp2", "world_size": 2}
    assert two.manifest.pairs == one.manifest.pairs == {"complete": 9, "rows_without_partner": 0}
    assert two.manifest.has_kl == one.manifest.has_kl == (not pairs_only)
    assert_same_rows(two.table.to_pylist(), one.table.to_pylist())


@pytest.mark.slow
def test_fsdp2_train_equals_one_process_and_survives_sigkill_and_sigterm(tmp_path, skewed):
    """The uninterrupted run's 2 processes run on two machines, played by two torchrun launchers of one process each
    meeting at a c10d rendezvous (tests/test_multinode.py), each machine writing its part of the sharded checkpoints
    into the one directory; the interrupted runs under one launcher of 2 processes equal it bit for bit. (Four
    launches in all: a fresh FSDP2 run under one launcher is the SIGTERMed run's start.)"""
    from transformers import AutoModelForCausalLM

    _, _, cache, eval_cache = skewed
    config = dict(cache=str(cache), eval_cache=str(eval_cache), **TRAIN)
    # one process, the same global batches: 8 training rows, 4 eval rows
    single = {**config, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 4}
    train(TrainConfig(output_dir=str(tmp_path / "one"), **single))
    # FSDP2, 2 machines x 1 process x 4
    args = ["train", *cli_args(**config)]
    launch_nodes(2, *args, "--output-dir", str(tmp_path / "two"), env=FSDP_ENV, log_dir=tmp_path / "logs")
    assert not (tmp_path / "two" / SHARED_CHECK_FILE).exists()

    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    steps = [r for r in one if "loss" in r]
    assert len(steps) == 10 and len([r for r in two if "loss" in r]) == 10  # 5 steps an epoch, the 5th uneven
    assert_same_steps(two, one, SHARDED_REL)
    assert abs(steps[-1]["loss"] - steps[0]["loss"]) > 1e-3  # it trained
    assert [r["eval_rows"] for r in two if "eval_rows" in r] == [3] * 3  # the repeated eval row counted once
    assert_same_weights(tmp_path / "two" / "model.safetensors", tmp_path / "one" / "model.safetensors")
    AutoModelForCausalLM.from_pretrained(tmp_path / "two")  # the final model is whole, in HF format
    state = json.loads((tmp_path / "two" / "trainer_state.json").read_text())
    assert state["distributed"] == {"engine": "fsdp2", "world_size": 2}
    check_peak_memory(state["peak_memory"])
    checkpoint = tmp_path / "two" / "checkpoint-2"
    assert (checkpoint / "sharded" / ".metadata").exists() and not (checkpoint / "model.safetensors").exists()
    assert sorted(p.name for p in (checkpoint / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "accelerate_state" / "optimizer.bin").exists()  # the optimizer is in the shards

    # SIGTERM to one rank once the first checkpoint is written (a run under --autoresume on an empty directory: it
    # starts): both stop at the next step boundary with a checkpoint
    stopped, logs = tmp_path / "stopped", tmp_path / "logs-stopped"
    torchrun = launch(
        2, *args, "--output-dir", str(stopped), "--autoresume", env=FSDP_ENV, log_dir=logs, background=True
    )
    os.kill(_ranks_once(torchrun, stopped / "checkpoint-2", logs)[0], signal.SIGTERM)
    assert torchrun.wait(timeout=120) != 0
    steps = set()
    for rank in ("0", "1"):  # every rank stopped, at the same step, and says how to continue
        (log,) = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        assert "stopped: SIGTERM received: stopped at step" in log.read_text() and "--autoresume" in log.read_text()
        steps.update(re.findall(r"stopped at step (\d+)", log.read_text()))
    # the step it stopped at has its checkpoint: written on the stop, or by --save-steps just before it (a signal
    # that lands between checkpoint-2's write and that step's stop check stops the run at step 2)
    (step,) = steps
    assert not (stopped / "model.safetensors").exists() and (stopped / f"checkpoint-{step}" / "sharded").is_dir()

    # --autoresume continues it, under torchrun --max-restarts 1, and one rank is SIGKILLed once the continued run has
    # written its next checkpoint: torchrun starts both again, and they continue from that checkpoint by themselves.
    # (One run takes both interruptions: a launch fewer than a SIGTERMed run and a SIGKILLed one, each continued.)
    killed, logs = stopped, tmp_path / "logs-killed"
    after_stop = (int(step) // 2 + 1) * 2  # --save-steps 2: the first checkpoint the continued run writes
    torchrun = launch(
        2,
        *args,
        "--output-dir",
        str(killed),
        "--autoresume",
        env=FSDP_ENV,
        log_dir=logs,
        background=True,
        max_restarts=1,
    )
    os.kill(_ranks_once(torchrun, killed / f"checkpoint-{after_stop}", logs)[1], signal.SIGKILL)
    assert torchrun.wait(timeout=240) == 0, rank_logs(logs)
    assert "resuming from" in rank_logs(logs)
    (restarted,) = logs.glob("*/attempt_1/0/stdout.log")  # the restarted workers resumed, from the kill's checkpoint
    resumed = re.findall(r"resuming from \S*checkpoint-(\d+)", restarted.read_text())
    assert len(resumed) == 1 and int(resumed[0]) >= after_stop, rank_logs(logs)
    _check_equal_runs(killed, tmp_path / "two")

    # another world size cannot resume it: refused before anything is loaded
    with pytest.raises(KTOPipelineError, match=r"written by 2 process\(es\) \(fsdp2\).*this run has 1 \(single\)"):
        train(TrainConfig(output_dir=str(killed), resume=True, **config))


def _ranks_once(torchrun, path: Path, logs: Path) -> list[int]:
    """The worker pids of a background torchrun, by rank, once `path` exists (the run still going)."""
    deadline = time.time() + 120
    while time.time() < deadline and not path.exists() and torchrun.poll() is None:
        time.sleep(0.005)
    ranks = _ranks(torchrun.pid)
    assert torchrun.poll() is None and len(ranks) == 2, rank_logs(logs)
    return ranks


def _check_equal_runs(run: Path, uninterrupted: Path) -> None:
    """An interrupted and continued run equals the uninterrupted one: the metrics log (each step once) and the
    final weights, bit for bit; no half-written checkpoint left."""
    from safetensors.torch import load_file

    assert read_metrics(run) == read_metrics(uninterrupted)
    a, b = load_file(uninterrupted / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(bool((a[k] == b[k]).all()) for k in a)
    assert not list(run.glob(".checkpoint-*")), "a half-written checkpoint was left behind"


def _ranks(parent: int) -> list[int]:
    """The worker processes torchrun started, by rank (read from /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == parent:
            rank = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(rank)] = int(stat.parent.name)
    return [found[r] for r in sorted(found)]


def test_fsdp_settings_come_from_the_accelerate_environment(monkeypatch):
    from kto_pipeline.runtime.engines import engine_for as engine_from_env

    for key in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    assert engine_from_env(1).name == "single" and engine_from_env(2).name == "ddp"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    engine = engine_from_env(8)
    assert engine.record() == {"engine": "fsdp2", "world_size": 8}
    assert not engine.reshard_after_forward and engine.offload_params
    assert not engine.ram_efficient_loading  # accelerate's default: every process reads the weights
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    assert engine_from_env(8).ram_efficient_loading
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(KTOPipelineError, match="FSDP_VERSION=1: kto-pipeline shards with FSDP2 only"):
        engine_from_env(8)


def test_a_model_without_layers_to_wrap_is_refused_by_name(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from kto_pipeline.runtime.engines.fsdp2 import decoder_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert len(decoder_layers(model)) == model.config.num_hidden_layers
    with pytest.raises(KTOPipelineError, match=r"no decoder layer of LlamaForCausalLM.*FSDP_TRANSFORMER_CLS_TO_WRAP"):
        decoder_layers(model, ("NoSuchLayer",))


@pytest.mark.slow
def test_fsdp2_lora_with_merge_equals_one_process(tmp_path, skewed):
    """LoRA adapters on a sharded base; --merge gathers nothing on one process while the others wait in a
    collective: the main process merges the saved adapter into a fresh base. (LoRA dropout off: its masks depend on
    how rows are spread over processes, under DDP as well.)"""
    from safetensors.torch import load_file

    _, _, cache, _ = skewed
    config = dict(cache=str(cache), max_steps=3, logging_steps=1, learning_rate=1e-2, seed=3, lora_r=4)
    config.update(lora_dropout=0.0, merge=True, train_sampling_strategy="sequential")
    train(TrainConfig(output_dir=str(tmp_path / "one"), per_device_train_batch_size=8, **config))
    args = ["train", *cli_args(**config), "--per-device-train-batch-size", "4", "--output-dir", str(tmp_path / "two")]
    launch(2, *args, env=FSDP_ENV, log_dir=tmp_path / "logs")
    for a, b in zip(read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one"), strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=SHARDED_REL), (a["step"], key)
    adapter = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)  # the adapter alone, gathered whole
    merged = [tmp_path / run / "merged" / "model.safetensors" for run in ("two", "one")]
    assert not any("lora_" in k for k in load_file(merged[0]))
    assert_same_weights(*merged)


def test_a_model_built_empty_has_the_loaded_models_parameters(tmp_path):
    """With the weights read by the main process only, the others build the model from its config on the meta
    device: the same parameters (tied embeddings tied, as from_pretrained ties them), or the collectives of the
    sharded forward would not match."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kto_pipeline.runtime.engines.fsdp2 import empty_model, parameter_layout

    for tied in (True, False):
        config = LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            tie_word_embeddings=tied,
        )  # fmt: skip
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / str(tied))
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / str(tied))
        empty = empty_model(loaded.config, torch.float32)
        assert parameter_layout(empty) == parameter_layout(loaded), tied
        assert all(p.is_meta for p in empty.parameters()) and not any(b.is_meta for b in empty.buffers())
        assert (empty.lm_head.weight is empty.model.embed_tokens.weight) is tied


@pytest.mark.slow
def test_fsdp2_append_equals_one_process(tmp_path, tiny_model_dir):
    """`precompute --append` of a grown log under FSDP2 (the weights read by the main process only): the new rows,
    their KL partners and (within the sharded pass's tolerance) their values are one process's append's. 16 new
    rows in shards of 6: in the second round one process has no shard and runs filler forwards."""
    import shutil

    rows = unpaired_rows(40)
    first, log = write_jsonl(tmp_path / "first.jsonl", rows[:24]), write_jsonl(tmp_path / "log.jsonl", rows)
    settings = dict(model=str(tiny_model_dir), max_length=64, shard_size=6)
    one = precompute(PrecomputeConfig(dataset=str(first), output=str(tmp_path / "one"), **settings))
    two = tmp_path / "two"
    shutil.copytree(one, two)
    precompute(PrecomputeConfig(dataset=str(log), output=str(one), append=True, **settings))
    args = cli_args(dataset=log, output=two, append=True, **settings)
    launch(2, "precompute", *args, env=FSDP_ENV, log_dir=tmp_path / "logs")
    ones, twos = open_cache(one, verify=True), open_cache(two, verify=True)
    for key in ("rows", "matched_rows", "first_example_id", "shards", "kl"):
        assert twos.manifest.segments[1][key] == ones.manifest.segments[1][key], key
    assert twos.manifest.segments[1]["timing"]["processes"] == 2
    assert len(twos.table) == 40
    assert_same_rows(twos.table.to_pylist(), ones.table.to_pylist())
