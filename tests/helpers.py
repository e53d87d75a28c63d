"""Helpers shared by the tests: configs, data rows and files, running the CLI in-process, launching it in several
processes, reading metrics."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

ACCELERATE_CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "accelerate"


def train_config(cache, out, **kw):
    """A short TrainConfig for tiny-model tests: 3 steps of 4 rows, every step logged; keywords override."""
    from kto_pipeline import TrainConfig

    base = dict(
        cache=str(cache),
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-3,
        seed=0,
    )
    return TrainConfig(**{**base, **kw})


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run the real entry point in-process: (exit code, stdout, stderr)."""

    from kto_pipeline.cli import main

    monkeypatch.setattr(sys, "argv", ["kto-pipeline", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_metrics(out: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def unpaired_rows(n: int = 24) -> list[dict]:
    """Standard unpaired rows of varied lengths, labels alternating in a 2:1 pattern."""
    rows = []
    for i in range(n):
        good = i % 3 != 0
        rows.append(
            {
                "prompt": f"User: question number {i} about {'cats' if i % 2 else 'the weather'}?\nAssistant:",
                "completion": (" Yes, happy to help with that" + "!" * (i % 5)) if good else f" No{'.' * (i % 4)}",
                "label": good,
            }
        )
    return rows


def conversational_rows(n: int = 12) -> list[dict]:
    rows = []
    for i in range(n):
        good = i % 2 == 0
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"Tell me about topic {i}."}],
                "completion": [
                    {"role": "assistant", "content": f"Topic {i} is interesting." if good else "I will not."}
                ],
                "label": good,
            }
        )
    return rows


def run_script(path: Path, *args: str, timeout: int | None = None):
    """`python PATH ARGS` in a process of its own, to the end, its output captured."""
    import subprocess

    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout)


def cli_cmd(*args: str) -> list[str]:
    """`python -m kto_pipeline ARGS`: the CLI in a process of its own."""
    return [sys.executable, "-m", "kto_pipeline", *args]


def launch_env(**overrides: str | None) -> dict[str, str]:
    """The environment of a multi-process test: this one without accelerate's launch variables (ACCELERATE_*,
    FSDP_*: a test sets the ones it means), one thread per process, no progress bars, Python's fault handler on,
    inductor compiling in the process itself; then `overrides` (None removes a variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT, SIGSEGV) writes every thread's Python stack into its log.
    # TORCHINDUCTOR_COMPILE_THREADS=1: the same kernels, built by the rank itself instead of a pool of compile workers
    # that each rank would start (an interpreter importing torch, then a worker a core): 2 ranks on 2 cores gain
    # nothing from the pools. Measured, both compiled two-process tests alone: 216 -> 187 s of CPU, 138 -> 125 s.
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONFAULTHANDLER="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def launch_cmd(
    nproc: int,
    *args: str,
    log_dir: Path,
    accelerate_config: str | None = None,
    max_restarts: int = 0,
    script: Path | None = None,
    nodes: tuple[int, int] | None = None,
) -> list[str]:
    """`torchrun --standalone --nproc_per_node N -m kto_pipeline ARGS`, or with `accelerate_config` (a file of
    configs/accelerate, without .yaml) `accelerate launch --config_file CONFIG --num_processes N -m kto_pipeline ARGS`,
    as a user launches them (accelerate on a free --main_process_port); every rank's output kept in `log_dir`
    (--log-dir --tee 3; accelerate passes them on to torchrun). `max_restarts`: torchrun restarts the workers that
    many times when one fails. `script`: a Python file that runs the command line (ARGS) itself, in place of
    `-m kto_pipeline`. `nodes` (node count, port): torchrun as one of several machines, meeting the others at a c10d
    rendezvous on 127.0.0.1:PORT instead of --standalone (no --node-rank: c10d ignores it and numbers the nodes
    itself)."""
    if accelerate_config is None:
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        if nodes is None:
            cmd += ["--standalone"]
        else:
            cmd += ["--nnodes", str(nodes[0]), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{nodes[1]}"]
        cmd += [f"--nproc_per_node={nproc}", "--log-dir", str(log_dir), "--tee", "3", f"--max-restarts={max_restarts}"]
    else:
        assert nodes is None, "several machines: torchrun only"
        config = ACCELERATE_CONFIGS / f"{accelerate_config}.yaml"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        cmd += ["--num_processes", str(nproc), "--log_dir", str(log_dir), "--tee", "3"]
        # a free port, not accelerate's default 29500: the suite's workers may launch at the same time
        cmd += ["--main_process_port", str(free_port())]
    return [*cmd, *([str(script)] if script else ["-m", "kto_pipeline"]), *args]


def launch(
    nproc: int,
    *args: str,
    log_dir: Path,
    env: dict[str, str | None] | None = None,
    accelerate_config: str | None = None,
    ddp_timeout: int = 60,
    timeout: int = 300,
    fails: bool = False,
    background: bool = False,
    max_restarts: int = 0,
    script: Path | None = None,
):
    """Every multi-process test's launch: `kto_pipeline ARGS --ddp-timeout DDP_TIMEOUT` in `nproc` processes
    (`launch_cmd`), in `launch_env(**env)`. The short process-group timeout makes a rank stuck in a collective fail
    and say where instead of waiting 30 minutes; then (or at a crash, or past `timeout` seconds) the assertion shows
    each rank's log, so the rank that failed first names its cause. Returns the finished process, its output
    captured; `fails`: the launch must fail instead. `background`: returns the started process at once (its output
    discarded, the rank logs kept), for a test that kills a rank."""
    import subprocess

    cmd = launch_cmd(
        nproc,
        *args,
        "--ddp-timeout",
        str(ddp_timeout),
        log_dir=log_dir,
        accelerate_config=accelerate_config,
        max_restarts=max_restarts,
        script=script,
    )
    if background:
        return subprocess.Popen(
            cmd, env=launch_env(**(env or {})), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    try:
        result = subprocess.run(cmd, env=launch_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"timed out after {timeout} s\n{rank_logs(log_dir)}") from None
    _check_exit(result, log_dir, fails)
    return result


def _check_exit(result, log_dir: Path, fails: bool) -> None:
    if fails:
        assert result.returncode != 0, f"the launch did not fail\n{rank_logs(log_dir)}"
    else:
        assert result.returncode == 0, (
            f"exit {result.returncode}\n{rank_logs(log_dir)}\nlauncher: {result.stderr[-2000:]}"
        )


def launch_nodes(
    nnodes: int,
    *args: str,
    log_dir: Path,
    node_args: list[list[str]] | None = None,
    env: dict[str, str | None] | None = None,
    ddp_timeout: int = 60,
    timeout: int = 300,
    fails: bool = False,
):
    """`launch` on `nnodes` machines, played on this one by as many torchrun launchers of one process each, started
    together and meeting at a c10d rendezvous on a free port, as `srun torchrun` starts one per node. Node R's
    ranks log to LOG_DIR/nodeR (its launcher's own output to LOG_DIR/nodeR.out, .err); `node_args[R]` is added to
    node R's arguments. Returns the finished launchers, their output captured; with `fails`, every launcher must
    fail. (c10d numbers the nodes itself, in the order of their launchers' pids: a test that gives one node other
    arguments reads which node rank it became in its log.)"""
    import subprocess
    import time

    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    started = []
    for r in range(nnodes):
        extra = node_args[r] if node_args else []
        cmd = launch_cmd(
            1, *args, *extra, "--ddp-timeout", str(ddp_timeout), log_dir=log_dir / f"node{r}", nodes=(nnodes, port)
        )
        with open(log_dir / f"node{r}.out", "w") as out, open(log_dir / f"node{r}.err", "w") as err:
            started.append(subprocess.Popen(cmd, env=launch_env(**(env or {})), stdout=out, stderr=err))
    deadline = time.monotonic() + timeout
    try:
        for proc in started:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"timed out after {timeout} s\n{rank_logs(log_dir)}") from None
    finally:
        for proc in started:
            if proc.poll() is None:  # torchrun passes SIGTERM on to its workers
                proc.terminate()
                proc.wait(timeout=60)
    results = []
    for r, proc in enumerate(started):
        out, err = ((log_dir / f"node{r}.{kind}").read_text(errors="replace") for kind in ("out", "err"))
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        _check_exit(results[-1], log_dir, fails)
    return results


def free_port() -> int:
    """A TCP port nothing listens on now (the launchers' rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_args(**options) -> list[str]:
    """Command-line flags for config fields: --name value, a bare --name for True."""
    args = []
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    return args


def rank_logs(log_dir: Path, tail: int = 3000) -> str:
    """The end of every rank's stdout and stderr under a torchrun --log-dir (or under launch_nodes' LOG_DIR/nodeR)."""
    parts = []
    for path in sorted(Path(log_dir).glob("**/attempt_*/*/std*.log")):
        text = path.read_text(errors="replace")
        where = path.relative_to(log_dir).parts[0]
        node = f"{where} " if where.startswith("node") else ""  # launch_nodes: LOG_DIR/nodeR/...
        parts.append(f"--- {node}rank {path.parent.name} {path.name} ---\n{text[-tail:]}")
    return "\n".join(parts) or f"(no rank logs in {log_dir})"


# ----------------------------------------------------------------------- several processes vs one

# how far a run's step metrics under several processes may be from one process's: replicated (DDP), sharded (FSDP2)
REPLICATED_REL, SHARDED_REL = 1e-4, 2e-3
# FSDP2 on 2 CPU processes as configs/accelerate/fsdp.yaml exports it: the main process alone reads the weights
FSDP_ENV = dict(
    ACCELERATE_USE_CPU="1",
    ACCELERATE_USE_FSDP="true",
    FSDP_VERSION="2",
    FSDP_RESHARD_AFTER_FORWARD="true",
    FSDP_CPU_RAM_EFFICIENT_LOADING="true",
)


def assert_same_rows(two: list[dict], one: list[dict]) -> None:
    """The rows of a cache written by several processes are one process's: the same ids, tokens, KL and pair
    partners, per-token reference log-probs within 1e-5, their sums within 1e-4."""
    import numpy as np
    import pytest

    assert len(two) == len(one)
    for a, b in zip(two, one, strict=True):
        for key in ("example_id", "label", "prompt_ids", "completion_ids", "kl_example_id", "kl_completion_ids"):
            assert a[key] == b[key], key
        assert a.get("pair_example_id") == b.get("pair_example_id")
        np.testing.assert_allclose(a["ref_token_logps"], b["ref_token_logps"], atol=1e-5)
        np.testing.assert_allclose(a["ref_kl_token_logps"], b["ref_kl_token_logps"], atol=1e-5)
        assert a["ref_logp"] == pytest.approx(b["ref_logp"], abs=1e-4)


def assert_same_steps(two: list[dict], one: list[dict], rel: float, keys: tuple[str, ...] | None = None) -> None:
    """The metrics records of a run under several processes are one process's, step by step: `keys` (default:
    every metric but the schedule's) within `rel` (and 1e-5 absolute)."""
    import pytest

    assert len(two) == len(one)
    for a, b in zip(two, one, strict=True):
        assert a.keys() == b.keys()
        for key in keys or sorted(a.keys() - {"learning_rate", "epoch", "step"}):
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-5), (a["step"], key)


def assert_same_weights(two: Path, one: Path, rel: float = 1e-4) -> None:
    """Two model.safetensors hold the same tensors, each within `rel` of its norm."""
    from safetensors.torch import load_file

    w2, w1 = load_file(two), load_file(one)
    assert w1.keys() == w2.keys()
    for key in w1:
        assert float((w1[key] - w2[key]).norm() / w1[key].norm().clamp(min=1e-12)) < rel, key


def check_peak_memory(peaks: list[dict]) -> None:
    """Each process's peaks, by rank, as runtime/peak_memory.py records them: private host memory (a Python process
    with torch holds well over 100 MiB), loading's peak within the stage's, the kernel's peak RSS at least that, no
    accelerator here."""
    assert [m["rank"] for m in peaks] == [0, 1]
    for m in peaks:
        assert 100 < m["loaded_host_private_mib"] <= m["host_private_mib"] <= m["host_rss_mib"], m
        assert m["accelerator_mib"] is None, m


def paired_conversational_rows(n: int = 12) -> list[dict]:
    """Conversational (prompt, chosen, rejected) rows of varied lengths, up to about 400 characters (the tiny
    model's tokens): the answers are longer or shorter than each other, so that which answer comes first changes the
    layout, and runs cross the lengths at which the CPU's attention kernel splits its work differently."""
    return [
        {
            "prompt": [{"role": "user", "content": f"Tell me about topic {i}" + ", please" * (4 + 5 * (i % 4)) + "."}],
            "chosen": [{"role": "assistant", "content": f"Topic {i} is interesting" + ", truly" * (3 + 7 * (i % 3))}],
            "rejected": [{"role": "assistant", "content": "I will not" + " say it" * (2 + 9 * (i % 5)) + "."}],
        }
        for i in range(n)
    ]


@contextmanager
def host_reads_per_step(monkeypatch):
    """Counts, for each call of the train stage's `train_step` (a micro-batch's forward, metrics and backward, the
    optimizer step where it ends one) and `after_step` (an optimizer step's bookkeeping: logging, checkpoints), the
    values read back from tensors in it, as `benchmarks/profile_step.py` counts them (`reads_counted`): yields
    {name: [count of each call]}, filled while the block runs."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from profile_step import reads_counted

    from kto_pipeline.stages.train import stage

    counts: dict[str, list[int]] = {"train_step": [], "after_step": []}

    def phase(name, total):
        original = getattr(stage, name)

        def call(*args, **kwargs):
            before = total[0]
            try:
                return original(*args, **kwargs)
            finally:
                counts[name].append(total[0] - before)

        monkeypatch.setattr(stage, name, call)

    with reads_counted() as total:
        for name in counts:
            phase(name, total)
        yield counts


KL_ON_CACHED_PROMPTS = "on the prompts' cached keys/values"


def reorder_bound(terms: int, magnitude, dtype=None):
    """The most two evaluations of the same sums can differ by when they add in another order (compiled and eager,
    packed and padded, one process and two), elementwise: each lies within gamma_n * sum|term_i| of the exact sum
    for a sum of n terms in any order (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 4.4),
    gamma_n = n u / (1 - n u) with u the unit roundoff of `dtype` (half its machine epsilon), so the two lie within
    twice that of each other. `terms`: the length of the longest chain of sums behind an element (the sums that feed
    a sum add their lengths); `magnitude`: sum|term_i| for each element, computed exactly (float64) or bounded."""
    import torch

    u = torch.finfo(dtype or torch.float32).eps / 2
    return 2 * terms * u / (1 - terms * u) * magnitude


def cpu_attention(model, kernel: str = "auto"):
    """How `model`'s packed rows attend on the CPU where `kernel` is asked for, as the stages' plan decides it
    (`choose_kernel`, in the model's mode now), for the scorers that take it."""
    from kto_pipeline.scoring.attention import attention_costs, choose_kernel

    return attention_costs(model, choose_kernel(model, kernel, "cpu")[0])
