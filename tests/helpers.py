"""Helpers shared by the tests: configs, data rows and files, running the CLI in-process, reading metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path


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


def torchrun_cmd(nproc: int, *args: str, log_dir: Path) -> list[str]:
    """`torchrun --nproc_per_node N -m kto_pipeline ARGS`, every rank's output kept in `log_dir` (--log-dir --tee)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*cmd, "--log-dir", str(log_dir), "--tee", "3", "-m", "kto_pipeline", *args]


def launch(nproc: int, *args: str, env: dict | None = None, log_dir: Path, timeout: int = 300):
    """Run `torchrun_cmd` to the end. A failure or a hang shows each rank's log, so the rank that failed first
    names its cause."""
    import subprocess

    try:
        result = subprocess.run(
            torchrun_cmd(nproc, *args, log_dir=log_dir), env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"timed out after {timeout} s\n{rank_logs(log_dir)}") from None
    assert result.returncode == 0, f"exit {result.returncode}\n{rank_logs(log_dir)}\ntorchrun: {result.stderr[-2000:]}"
    return result


def cli_args(**options) -> list[str]:
    """Command-line flags for config fields: --name value, a bare --name for True."""
    args = []
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    return args


def rank_logs(log_dir: Path, tail: int = 3000) -> str:
    """The end of every rank's stdout and stderr under a torchrun --log-dir."""
    parts = []
    for path in sorted(Path(log_dir).glob("*/attempt_*/*/std*.log")):
        text = path.read_text(errors="replace")
        parts.append(f"--- rank {path.parent.name} {path.name} ---\n{text[-tail:]}")
    return "\n".join(parts) or f"(no rank logs in {log_dir})"
