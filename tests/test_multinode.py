"""Both stages on two machines, played on this one by two torchrun launchers of one process each that meet at a c10d
rendezvous (gloo, CPU), as `srun torchrun` starts one launcher per node: under DDP they give the 1-process cache and
training run of tests/test_distributed.py (its fixtures, settings and comparisons); under FSDP2, tests/test_fsdp.py
runs its reference pass (the weights read by the main process only) and its uninterrupted training run this way. A
machine that does not see the output directory stops the run at once, every process with it, and names itself. The
SLURM example starts its launchers this way."""

import os
import socket
import subprocess
from pathlib import Path

import pytest
import test_distributed
from helpers import (
    REPLICATED_REL,
    assert_same_rows,
    assert_same_steps,
    cli_args,
    launch_nodes,
    rank_logs,
    read_metrics,
    train_config,
)

from kto_pipeline import train
from kto_pipeline.cache import open_cache
from kto_pipeline.runtime.launch import SHARED_CHECK_FILE

# the 1-process cache of the sibling tests, reused: data + cache_1proc (40 rows)
data, cache_1proc = test_distributed.data, test_distributed.cache_1proc


@pytest.mark.slow
def test_ddp_on_two_machines_equals_one_process(tmp_path, tiny_model_dir, data, cache_1proc):
    out = tmp_path / "cache"
    args = cli_args(model=tiny_model_dir, dataset=data, output=out, max_length=64, shard_size=6)
    launchers = launch_nodes(2, "precompute", *args, log_dir=tmp_path / "logs-precompute")
    assert sum(r.stdout.count("precompute finished") for r in launchers) == 1  # one summary, from the main process
    two, one = open_cache(out, verify=True), open_cache(cache_1proc, verify=True)
    assert two.manifest["distributed"] == {"engine": "ddp", "world_size": 2}
    assert two.manifest["timing"]["processes"] == 2
    assert [s["rows"] for s in two.manifest["shards"]] == [s["rows"] for s in one.manifest["shards"]]
    assert_same_rows(two.table.to_pylist(), one.table.to_pylist())

    # 2 machines x 4 rows on the cache they wrote = 1 x 8 on the 1-process cache
    config = dict(per_device_train_batch_size=4, **test_distributed.TRAIN)
    launch_nodes(2, "train", *cli_args(cache=out, output_dir=tmp_path / "two", **config), log_dir=tmp_path / "logs")
    train(train_config(cache_1proc, tmp_path / "one", **{**config, "per_device_train_batch_size": 8}))
    two_steps, one_steps = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert len(two_steps) == 4
    assert_same_steps(two_steps, one_steps, REPLICATED_REL, test_distributed.STEP_KEYS)
    assert abs(one_steps[-1]["loss"] - one_steps[0]["loss"]) > 1e-3  # the runs actually trained
    # only the main process wrote the model, the optimizer and the schedule; each process its RNG state (node 1's)
    assert (tmp_path / "two" / "checkpoint-2" / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoint-2" / "accelerate_state").iterdir()) == [
        "custom_checkpoint_0.pkl",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert not (out / SHARED_CHECK_FILE).exists() and not (tmp_path / "two" / SHARED_CHECK_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["precompute", "train"])
def test_a_machine_that_does_not_see_the_output_directory_stops_every_process(
    tmp_path, tiny_model_dir, small_cache, stage
):
    """Each launcher is given its own directory, as a path on each node's local disk would be: the machine that
    is not the main process's says that it does not see the main process's directory, names itself and its path,
    and every process stops with it. The main process's own message comes after the gather in which every process
    answered, so no process waited for a peer that had gone (that would end in the process group's timeout)."""
    if stage == "precompute":
        flag, args = "--output", cli_args(model=tiny_model_dir, dataset=small_cache.parent / "data.jsonl")
    else:
        flag, args = "--output-dir", cli_args(cache=small_cache)
    local = [tmp_path / "node0-local", tmp_path / "node1-local"]
    launch_nodes(2, stage, *args, node_args=[[flag, str(p)] for p in local], log_dir=tmp_path / "logs", fails=True)
    logs = [rank_logs(tmp_path / "logs" / f"node{r}") for r in (0, 1)]
    # c10d numbered the machines: find the launcher that became node rank 1
    second = next(r for r in (0, 1) if "this process (rank 1, node rank 1" in logs[r])
    first = 1 - second
    host = socket.gethostname()
    assert (
        f"error: {flag} {local[second]}: this process (rank 1, node rank 1, host {host}) does not see the "
        f"directory the main process (rank 0, node rank 0, host {host}) writes into, {local[first]}: the file it "
        f"has just written there is missing at {local[second] / SHARED_CHECK_FILE} on this node. Every process "
        f"writes into {flag}, so on several machines it must be on storage every node sees"
    ) in logs[second]
    assert (
        f"error: {flag} {local[first]}: 1 process(es) do not see this directory, which the main process (rank 0, "
        f"node rank 0, host {host}) writes into: rank 1, node rank 1, host {host}"
    ) in logs[first]
    assert not any("timed out" in log.lower() for log in logs)
    assert not (local[first] / SHARED_CHECK_FILE).exists()


SBATCH = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "kto.sbatch"
# stand-ins: srun runs its command once per node, here, in parallel, with that node's SLURM_NODEID; scontrol names
# the allocation's hosts; torchrun records what it was asked to run
STAND_INS = {
    "srun": """while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & done
wait""",
    "scontrol": """[[ "$1 $2" == "show hostnames" ]] && printf 'gpu-a\\ngpu-b\\n'""",
    "torchrun": """echo "node$SLURM_NODEID $*" >> "$RECORD" """,
}


def test_the_slurm_example_starts_one_torchrun_per_node_for_each_stage(tmp_path):
    """examples/slurm/kto.sbatch (never run under SLURM here) under stand-ins for srun, scontrol and torchrun: one
    torchrun per node and stage, meeting on the first host, each node logging apart, restarting and forwarding
    SIGUSR1; train continues by itself (--autoresume)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    record, out = tmp_path / "torchrun.txt", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "MAIN_PORT", "GPUS_PER_NODE")}  # its defaults
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record), SLURM_JOB_ID="7", SLURM_NNODES="2")
    env.update(SLURM_JOB_NODELIST="gpu-[a-b]", DATA="d.jsonl", CACHE="c", OUT=str(out), LOGS="l")

    def run() -> list[str]:
        record.unlink(missing_ok=True)
        result = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return sorted(record.read_text().splitlines())

    launcher = "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu-a:29500 --rdzv-id 7"
    restarts = "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 110 --max-restarts 1"
    precompute = "precompute --model Qwen/Qwen2-0.5B-Instruct --dataset d.jsonl --output c"
    train = f"train --cache c --output-dir {out} --per-device-train-batch-size 8 --save-steps 200 --autoresume"
    expected = [
        f"node{n} {launcher} --log-dir l/7/node{n} --tee 3 {restarts} -m kto_pipeline {stage}"
        for n in (0, 1)
        for stage in (precompute, train)
    ]
    assert run() == sorted(expected)


def test_a_check_file_left_by_a_killed_run_does_not_make_the_directory_taken(tmp_path, small_cache):
    """A run killed between writing the check file and deleting it leaves the file behind: the next run into the
    directory starts as in an empty one (the file is the tool's own, as the lock file is)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / SHARED_CHECK_FILE).write_text("0123")
    train(train_config(small_cache, tmp_path / "run", max_steps=1))
    assert (tmp_path / "run" / "trainer_state.json").exists()
