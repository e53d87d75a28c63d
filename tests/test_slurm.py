"""examples/slurm/kto.sbatch under a real SLURM: Debian's slurm-wlm on this machine (`make test-assets` installs it
where it can), one slurmctld and two slurmd "nodes" (node1, node2: multiple slurmd on one host, munge auth), started
and stopped by this module. The script's CPU variant (KTO_DEVICE=cpu, one process a node on gloo) runs both stages on
the 2 nodes: the same cache and steps as one process. Preemption as SLURM delivers it: `scancel --signal=USR1` to the
job's steps while train runs; train stops at a step boundary with a checkpoint, the script requeues the job, and the
requeued job ends where an uninterrupted run ends. Where SLURM cannot start (not root, no package, no munge key) the
module is skipped, saying why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    REPLICATED_REL,
    assert_same_rows,
    assert_same_steps,
    free_port,
    read_metrics,
    unpaired_rows,
    write_jsonl,
)

from kto_pipeline import PrecomputeConfig, TrainConfig, precompute, train
from kto_pipeline.cache import open_cache

SBATCH = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "kto.sbatch"
DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "munged", "munge")
MAX_LENGTH, BATCH = 64, 4  # per node: 2 nodes x 4 rows = one process's 8
STEPS = 24  # long enough for a signal to land while train runs (the preemption test sends it after step 2)


def _why_no_slurm() -> str | None:
    if os.geteuid() != 0:
        return "SLURM's daemons run as root here, and this is not root"
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        installs = "`KTO_INSTALL_SLURM=1 make test-assets` installs them"
        return f"slurm-wlm / munge not installed ({', '.join(missing)} missing; {installs})"
    if not Path("/etc/munge/munge.key").exists():
        return "no munge key (/etc/munge/munge.key)"
    return None


def _run(*cmd: str, env: dict, check: bool = True, timeout: int = 60) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A 2-node SLURM cluster on this machine: the environment its commands need (SLURM_CONF, the venv's PATH)."""
    why = _why_no_slurm()
    if why is not None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}:/usr/sbin"
    try:
        if _run("munge", "-n", env=env, check=False).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            _run("su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged", env=env)
    except (AssertionError, OSError, LookupError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"munge (SLURM's authentication) could not start here: {exc}")
    nodes = "\n".join(
        f"NodeName=node{n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs=2 RealMemory=4000"
        for n in (1, 2)
    )
    (root / "state").mkdir()
    (root / "slurm.conf").write_text(
        f"""ClusterName=kto{os.getpid()}
SlurmctldHost=localhost
SlurmctldPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmUser=root
SlurmdUser=root
JobRequeue=1
{nodes}
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""
    )
    conf = str(root / "slurm.conf")
    try:
        _run("slurmctld", "-f", conf, env=env)
        for n in (1, 2):
            _run("slurmd", "-f", conf, "-N", f"node{n}", env=env)
    except (AssertionError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"SLURM's daemons could not start here: {exc}")
    deadline = time.monotonic() + 60
    while _run("sinfo", "-h", "-o", "%T %D", env=env, check=False).stdout.split() != ["idle", "2"]:
        if time.monotonic() > deadline:
            log = (root / "slurmctld.log").read_text()[-2000:] if (root / "slurmctld.log").exists() else ""
            _run("scontrol", "shutdown", env=env, check=False)
            pytest.skip(f"SLURM's 2 slurmd never came up idle here:\n{log}")
        time.sleep(0.5)
    yield env
    _run("scontrol", "shutdown", env=env, check=False)
    for pid_file in root.glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), 15)
        except (ValueError, ProcessLookupError):
            pass


def sbatch(slurm: dict, work: Path, train_args: str, cache: Path | None = None) -> str:
    """Submit the example in its CPU variant on the 2 nodes; returns the job id."""
    exports = {
        "KTO_DEVICE": "cpu",
        "MAIN_HOST": "127.0.0.1",  # (node1 is a SLURM name here, not a host name)
        "MAIN_PORT": str(free_port()),
        "MODEL": str(work / "model"),
        "DATA": str(work / "data.jsonl"),
        "CACHE": str(cache or work / "cache"),
        "OUT": str(work / "run"),
        "LOGS": str(work / "logs"),
        "PRECOMPUTE_ARGS": f"--max-length {MAX_LENGTH} --ddp-timeout 60",
        "TRAIN_ARGS": f"{train_args} --per-device-train-batch-size {BATCH} --no-bf16 --ddp-timeout 60",
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
    }
    env = {**slurm, **exports}
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]
    cmd += [f"--output={work}/job-%j.out", "--export=ALL", str(SBATCH)]
    return _run(*cmd, env=env).stdout.strip().split(";")[0]


def wait_done(slurm: dict, job: str, work: Path, timeout: int = 300) -> str:
    """Wait until `job` leaves the queue; its final state (sacct is not configured: scontrol's record)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        shown = _run("scontrol", "show", "job", job, env=slurm, check=False).stdout
        state = next((w.split("=")[1] for w in shown.split() if w.startswith("JobState=")), "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return state
        time.sleep(1)
    raise AssertionError(f"job {job} still {state} after {timeout} s\n{job_report(slurm, work)}")


def job_report(slurm: dict, work: Path) -> str:
    """What a failed assertion shows: the job's output and the controller's log, the ends of each."""
    outs = [f"{p}:\n{p.read_text()[-3000:]}" for p in sorted(work.glob("job-*.out"))]
    controller = Path(slurm["SLURM_CONF"]).parent / "slurmctld.log"
    log = controller.read_text()[-2000:] if controller.exists() else "(none)"
    return "\n".join([*outs, f"{controller}:\n{log}"])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir):
    """The data, the model and one process's cache and run of the same settings."""
    work = tmp_path_factory.mktemp("slurm-one")
    shutil.copytree(tiny_model_dir, work / "model")
    write_jsonl(work / "data.jsonl", unpaired_rows(32))
    cache = precompute(
        PrecomputeConfig(
            model=str(work / "model"),
            dataset=str(work / "data.jsonl"),
            output=str(work / "cache"),
            max_length=MAX_LENGTH,
        )
    )
    settings = dict(max_steps=STEPS, logging_steps=1, learning_rate=1e-3, save_steps=0, bf16=False)
    train(
        TrainConfig(cache=str(cache), output_dir=str(work / "run"), per_device_train_batch_size=2 * BATCH, **settings)
    )
    return work


TRAIN_ARGS = f"--max-steps {STEPS} --logging-steps 1 --learning-rate 1e-3 --save-steps 0"


def _job_copy(one_process: Path, work: Path) -> Path:
    shutil.copytree(one_process / "model", work / "model")
    shutil.copy(one_process / "data.jsonl", work / "data.jsonl")
    return work


@pytest.mark.slow
def test_sbatch_runs_both_stages_on_two_nodes_as_one_process_and_a_preempted_job_ends_where_one_process_ends(
    slurm, one_process, tmp_path
):
    """The example on the 2 nodes gives one process's cache and steps, through a preemption: SIGUSR1 to the job's
    steps while train runs (as --signal=USR1@N delivers it before a time limit) makes every rank stop at a step
    boundary with a checkpoint, the script requeues the job, the requeued job skips the complete cache and continues
    from the checkpoint (--autoresume): the final metrics are one process's uninterrupted run's. One job shows both:
    an uninterrupted job would launch the same stages on the same nodes again (its precompute is this job's first
    one, its train runs each step this job runs), for no property that this one does not check."""
    work = _job_copy(one_process, tmp_path)
    job = sbatch(slurm, work, TRAIN_ARGS)
    metrics = work / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, f"train never logged its second step\n{job_report(slurm, work)}"
        time.sleep(0.2)
    _run("scancel", "--signal=USR1", job, env=slurm)
    # SLURM holds a requeued batch job (its BeginTime: the credential lifetime, 121 s, on) so that no launch of the new
    # run carries a credential from the second the nodes revoked the old run's ("Job credential revoked"). Once the
    # requeue is done (pending again), let it start 2 s on instead: a new second on every node's clock.
    deadline = time.monotonic() + 120
    while not {"Restarts=1", "JobState=PENDING"} <= set(
        (shown := _run("scontrol", "show", "job", job, env=slurm).stdout).split()
    ):
        assert time.monotonic() < deadline and "JobState=COMPLETED" not in shown, f"{shown}\n{job_report(slurm, work)}"
        time.sleep(0.5)
    time.sleep(2)
    _run("scontrol", "update", f"JobId={job}", "StartTime=now", env=slurm)
    assert wait_done(slurm, job, work) == "COMPLETED", job_report(slurm, work)
    shown = _run("scontrol", "show", "job", job, env=slurm).stdout
    assert "Restarts=1" in shown, shown
    logs = "\n".join(p.read_text() for p in (work / "logs" / job).glob("node*/*/attempt_*/*/stderr.log"))
    assert "stopped: " in logs
    # both stages on the 2 nodes: the cache (made by the first run, left as it was by the requeued one) is one
    # process's, and so is every step of the run
    out = (work / f"job-{job}.out").read_text()
    assert "over 2 processes" in out
    two, one = open_cache(work / "cache", verify=True), open_cache(one_process / "cache")
    assert two.manifest["distributed"]["world_size"] == 2
    assert_same_rows(two.table.to_pylist(), one.table.to_pylist())
    resumed = json.loads((work / "run" / "trainer_state.json").read_text())
    assert resumed["global_step"] == STEPS and resumed["distributed"]["world_size"] == 2
    assert_same_steps(read_metrics(work / "run"), read_metrics(one_process / "run"), REPLICATED_REL)
    assert sorted(p.name for p in (work / "logs" / job).iterdir()) == ["node0", "node1"]  # each node's ranks' logs


@pytest.mark.slow
def test_nodes_that_do_not_share_the_output_directory_stop_the_job_naming_the_node(slurm, one_process, tmp_path):
    """node2's slurmd restarted in a mount namespace of its own, with an empty tmpfs over the job's output folder (as
    a node-local disk would be): the job stops at precompute's start, node2's rank naming itself and the directory it
    does not see, and nothing is scored. (node2's slurmd is put back as it was afterwards.)"""
    work = _job_copy(one_process, tmp_path / "job")
    private = tmp_path / "node-local"
    private.mkdir()
    conf, root = slurm["SLURM_CONF"], Path(slurm["SLURM_CONF"]).parent
    pid_file = root / "slurmd-node2.pid"

    def restart_node2(*prefix: str) -> None:
        os.kill(int(pid_file.read_text()), 15)
        deadline = time.monotonic() + 30
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        _run(*prefix, "slurmd", "-f", conf, "-N", "node2", env=slurm)
        deadline = time.monotonic() + 60
        while _run("sinfo", "-h", "-o", "%T %D", env=slurm, check=False).stdout.split() != ["idle", "2"]:
            assert time.monotonic() < deadline, "node2 did not come back"
            time.sleep(0.5)

    mount = f'mount -t tmpfs none {private} && exec "$0" "$@"'
    restart_node2("unshare", "--mount", "--propagation", "private", "sh", "-c", mount)
    try:
        exports_cache = private / "cache"
        job = sbatch(slurm, work, TRAIN_ARGS, cache=exports_cache)
        assert wait_done(slurm, job, work) == "FAILED", job_report(slurm, work)
        logs = "\n".join(p.read_text() for p in (work / "logs" / job).glob("node*/*/attempt_*/*/stderr.log"))
        assert f"error: --output {exports_cache}: this process (rank 1" in logs, logs[-3000:]
        assert "does not see the directory the main process" in logs and "1 process(es) do not see" in logs
        assert not list(exports_cache.glob("shards/*.arrow"))
    finally:
        restart_node2()
