"""What the benchmarks share: the worker protocol (every measurement in a fresh process that prints one `RESULT`
line), memory and machine readings, step timing, and the sections of RESULTS.md.

The benchmarks are scripts run from the repository root (`python benchmarks/bench.py ...`): Python puts
benchmarks/ on sys.path, so they `import harness` (and each other) directly.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent  # benchmarks/
WORK_DIR = HERE / ".work"  # scratch: models, data, runs (git-ignored)
RESULT_PREFIX = "RESULT "

# ------------------------------------------------------------------------------------------- workers


def print_result(result: dict) -> None:
    """A worker's answer: its one `RESULT {json}` line on stdout, read back by `run_worker`."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(
    script: Path,
    name: str,
    work: Path,
    flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
    must_succeed: bool = True,
    width: int = 24,
) -> dict:
    """`script worker NAME --work WORK --out WORK/runs/NAME FLAGS` in a fresh process; returns the dict of its
    RESULT line with `process_seconds` (the process from start to exit) added. `env` overrides the environment
    (offline, no progress bars, HF_DATASETS_CACHE in `work`). A failed worker ends the benchmark, or with
    `must_succeed=False` returns {"failed": its last line of stderr}. `width`: of the name in the progress line."""
    out = work / "runs" / name
    env = {
        **os.environ,
        "TQDM_DISABLE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(work / "hf-datasets-cache"),
        **(env or {}),
    }
    cmd = [sys.executable, str(Path(script).resolve()), "worker", name, "--work", str(work), "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run([*cmd, *flags], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        if must_succeed:
            raise SystemExit(f"worker {name} failed:\n{proc.stderr[-4000:]}")
        last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        print(f"  {name:<{width}} FAILED after {time.perf_counter() - start:.1f} s: {last[0][:300]}", flush=True)
        return {"failed": last[0][:300]}
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(RESULT_PREFIX))
    result = json.loads(line[len(RESULT_PREFIX) :])
    result["process_seconds"] = time.perf_counter() - start
    print(f"  {name:<{width}} done in {result['process_seconds']:.1f} s", flush=True)
    return result


def fresh_runs(work: Path) -> None:
    """Measure from scratch: no worker may reuse the outputs or the datasets cache of an earlier run."""
    shutil.rmtree(work / "runs", ignore_errors=True)
    shutil.rmtree(work / "hf-datasets-cache", ignore_errors=True)


# ------------------------------------------------------------------------------------ memory, machine


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/PID/status (VmRSS, RssAnon, RssFile, ...)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[key] = int(parts[0])
    return fields


def rss_mib() -> float:
    """This process' resident memory now."""
    kib = proc_status().get("VmRSS")
    return float("nan") if kib is None else kib / 1024


def peak_rss_mib() -> float:
    """This process' peak resident memory (ru_maxrss: it cannot be reset)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def children_peak_rss_mib() -> float:
    """The peak resident memory of the largest terminated child process (0 where none ran)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def cpu_name() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def machine() -> str:
    import torch

    return (
        f"{platform.system()} {platform.machine()}, {cpu_name()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def utc_stamp() -> str:
    """Now, as the results write their date: 2026-11-22 07:15 UTC."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ------------------------------------------------------------------------------------------ timing


def median_step(times: list[float]) -> float:
    """Median over the steps after the first (the first pays one-off warm-up costs)."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def step_timer(synchronize: Callable[[], None] | None = None):
    """A transformers TrainerCallback whose `times` are the wall seconds of each training step; `synchronize`
    (e.g. torch.cuda.synchronize) runs before a step's end is read."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if synchronize is not None:
                synchronize()
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


def time_calls(cls, attr: str, record: Callable, synchronize: Callable[[], None] | None = None) -> None:
    """Patch method `attr` of `cls` so that every call is timed: `record(seconds, *args, **kwargs)` gets its wall
    time and arguments (self left out) as it returns. `synchronize` runs before the start and the end are read."""
    original = getattr(cls, attr)

    def timed(self, *args, **kwargs):
        if synchronize is not None:
            synchronize()
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        if synchronize is not None:
            synchronize()
        record(time.perf_counter() - start, *args, **kwargs)
        return out

    setattr(cls, attr, timed)


# ------------------------------------------------------------------------------------ RESULTS.md


def _heading_span(lines: list[str], heading: str) -> tuple[int, int] | None:
    """[start, end) lines of the section under `heading` (a line of its own) up to the next `## ` heading."""
    if heading not in lines:
        return None
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return start, end


def get_section(text: str, heading: str) -> str | None:
    lines = text.splitlines()
    span = _heading_span(lines, heading)
    return None if span is None else "\n".join(lines[span[0] : span[1]]).rstrip() + "\n"


def replace_section(text: str, heading: str, section: str) -> str:
    """`text` with the section under `heading` replaced by `section` (appended if absent); the rest is kept."""
    lines = text.splitlines()
    span = _heading_span(lines, heading)
    new = section.rstrip().splitlines()
    if span is None:
        return (text.rstrip() + "\n\n" if text.strip() else "") + "\n".join(new) + "\n"
    after = lines[span[1] :]
    return "\n".join([*lines[: span[0]], *new, *([""] if after else []), *after]).rstrip() + "\n"


def write_section(results: Path, heading: str, section: str) -> None:
    text = results.read_text() if results.exists() else ""
    results.write_text(replace_section(text, heading, section))
    print(f"written to {results}")
