"""`kto-pipeline report RUN_OR_SWEEP_DIR [MORE ...]`: plots and a self-contained HTML page from metrics.jsonl.

One run (a directory with metrics.jsonl) or a sweep (a directory whose subdirectories are runs)
gives the same figures; a sweep's runs are overlaid with a legend. The HTML embeds the PNGs and
the summary table, so the single file can be mailed or attached to an issue. A run with a
samples.jsonl (`kto-pipeline generate`) also shows its reference and policy answers side by side.
"""

from __future__ import annotations

import base64
import html
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.rundir import (
    SAMPLES_FILE,
    STATE_FILE,
    TrainerState,
    find_runs,
    read_metrics,
    read_samples,
    run_config,
)

TRAIN_SERIES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "kl")
EVAL_SERIES = ("eval_reward_accuracy", "eval_pair_accuracy", "eval_rewards/margins")


def _plot(
    runs: dict[str, tuple[list, list]], series: str, evaluation: bool, out: Path, index: dict[str, dict[str, int]]
) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    plotted = 0
    for label, (train, evals) in runs.items():
        records = evals if evaluation else train
        points = [(r["step"], r[series]) for r in records if series in r and "step" in r]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=label)
            index.setdefault(series, {})[label] = len(points)
            plotted += 1
    if not plotted:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(series)
    ax.set_title(series)
    ax.grid(True, alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = out / (series.replace("/", "_") + ".png")
    fig.savefig(path)
    plt.close(fig)
    return path


def summary_rows(runs: dict[str, Path], settings: Iterable[str] = ()) -> list[dict[str, Any]]:
    """One row per run: its main settings (plus `settings`) and its final metrics, best first. Runs of training in
    rounds (`train --init-from`) come in round order instead, with their round, parent and cache rows."""
    rows = []
    lineage = _lineage(runs)
    for label, run_dir in runs.items():
        train, evals = read_metrics(run_dir)
        config = run_config(run_dir)
        last = train[-1] if train else {}
        last_eval = evals[-1] if evals else {}
        rows.append(
            {
                "run": label,
                "beta": config.get("beta"),
                "learning_rate": config.get("learning_rate"),
                "loss_type": config.get("loss_type"),
                "steps": last.get("step"),
                "final_loss": last.get("loss"),
                "final_margin": last.get("rewards/margins"),
                "final_kl": last.get("kl"),
                "eval_pair_accuracy": last_eval.get("eval_pair_accuracy"),
                "eval_margin": last_eval.get("eval_rewards/margins"),
                "eval_reward_accuracy": last_eval.get("eval_reward_accuracy"),
            }
        )
        rows[-1].update({k: config.get(k) for k in settings})
        if lineage:
            rows[-1] = {"run": label, **lineage[label], **{k: v for k, v in rows[-1].items() if k != "run"}}
    if lineage:
        return sorted(rows, key=lambda row: (row["round"] or 0, row["run"]))
    return rank(rows)


def _lineage(runs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """{label: round, started from, cache rows and segments} when some run started from another; else {}."""
    states = {label: TrainerState.read(d) if (d / STATE_FILE).exists() else None for label, d in runs.items()}
    if not any(state and state.parent_run for state in states.values()):
        return {}
    by_path = {str(d.resolve()): label for label, d in runs.items()}
    out = {}
    for label, state in states.items():
        parent = (state.parent_run if state else None) or {}
        segments = (state.cache_segments if state else None) or []
        out[label] = {
            "round": state.round if state else None,
            "started_from": by_path.get(parent.get("path"), parent.get("path")) if parent else "reference",
            "cache_rows": sum(seg["rows"] for seg in segments) or None,
            "cache_segments": len(segments) or None,
        }
    return out


def rank(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best first: by held-out pair accuracy where the eval set has pairs (every loss reports it alike, KTO's and the
    pair losses'), else by eval reward accuracy, then by the held-out reward margin, then the final training one."""

    def key(row):
        pair, acc = row.get("eval_pair_accuracy"), row.get("eval_reward_accuracy")
        margin = row.get("eval_margin")
        margin = row.get("final_margin") if margin is None else margin
        return (pair is not None, pair or 0.0, acc is not None, acc or 0.0, margin if margin is not None else -1e300)

    return sorted(rows, key=key, reverse=True)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


SAMPLES_CSS = (
    "table.samples td,table.samples th{text-align:left;vertical-align:top;white-space:pre-wrap;max-width:36em}"
    "table.samples .same{color:#777}table.samples .good{color:#1a7f37}table.samples .bad{color:#b42318}"
)


def samples_html(label: str, run_dir: Path) -> str:
    """A run's samples.jsonl (`kto-pipeline generate`) as a table: prompt, reference and policy answers side by
    side, and the dataset's labelled completions when the prompts came from a cache; "" if the run has none."""

    path = run_dir / SAMPLES_FILE
    records = read_samples(path) if path.exists() else []
    if not records:
        return ""
    s = records[0].get("settings", {})
    how = f"sampled (temperature {s.get('temperature')}, top-p {s.get('top_p')}, seed {s.get('seed')})"
    caption = (
        f"{len(records)} prompts, {how if s.get('do_sample') else 'greedy'}, at most {s.get('max_new_tokens')} new "
        f"tokens; reference {s.get('reference')}. Grey: the policy's answer is the reference's."
    )
    with_dataset = any("dataset_completions" in r for r in records)

    def cell(text: str, css: str = "") -> str:
        body = html.escape(text) if text else "<em>(empty)</em>"
        return f'<td class="{css}">{body}</td>' if css else f"<td>{body}</td>"

    rows = []
    for r in records:
        cells = (
            cell(r["prompt"])
            + cell(r["reference"])
            + cell(r["policy"], "same" if r["policy"] == r["reference"] else "")
        )
        if with_dataset:
            completions = "".join(
                f'<div class="{"good" if c["label"] else "bad"}">'
                f"{'desirable' if c['label'] else 'undesirable'}: {html.escape(c['text'])}</div>"
                for c in r.get("dataset_completions", [])
            )
            cells += f"<td>{completions}</td>"
        rows.append(f"<tr>{cells}</tr>")
    header = "<th>prompt</th><th>reference</th><th>policy</th>" + ("<th>dataset</th>" if with_dataset else "")
    return (
        f'<h3 id="samples-{html.escape(label)}">{html.escape(label)}</h3><p>{html.escape(caption)}</p>'
        f'<table class="samples"><tr>{header}</tr>{"".join(rows)}</table>'
    )


def write_report(*paths: str | Path, output: str | Path | None = None) -> Path:
    """Write PNG plots and report.html for the runs in `paths` (runs, sweeps, or the rounds of a training in rounds,
    side by side) into `output`: by default the one path, or the deepest folder that holds them all. Returns the
    HTML file."""
    if not paths:
        raise KTOPipelineError("report: name at least one run or sweep directory.")
    dirs = [Path(p) for p in paths]
    for d in dirs:
        if not d.is_dir():
            raise KTOPipelineError(f"{d}: no such directory.")
    runs: dict[str, Path] = {}
    for d in dirs:
        for label, run_dir in find_runs(d).items():
            runs[label if label not in runs else f"{d.name}/{label}"] = run_dir
    path = (
        Path(output) if output else dirs[0] if len(dirs) == 1 else Path(os.path.commonpath([d.resolve() for d in dirs]))
    )
    path.mkdir(parents=True, exist_ok=True)
    metrics = {label: read_metrics(run_dir) for label, run_dir in runs.items()}
    out = path / "report"
    out.mkdir(exist_ok=True)
    index: dict[str, dict[str, int]] = {}  # series -> {run: points plotted}, written next to the PNGs
    images = [p for s in TRAIN_SERIES if (p := _plot(metrics, s, False, out, index))]
    images += [p for s in EVAL_SERIES if (p := _plot(metrics, s, True, out, index))]
    (out / "plots.json").write_text(json.dumps(index, indent=2) + "\n")
    rows = summary_rows(runs)
    table = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row.values()) + "</tr>" for row in rows
    )
    header = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0]) if rows else ""
    figures = "".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{html.escape(p.stem)}</figcaption></figure>"
        for p in images
    )
    samples = "".join(samples_html(label, run_dir) for label, run_dir in runs.items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kto-pipeline report: {html.escape(path.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:4px 8px;text-align:right}}figure{{display:inline-block;margin:0.5em}}img{{max-width:640px}}
{SAMPLES_CSS}</style></head>
<body><h1>kto-pipeline report: {html.escape(str(path))}</h1>
<h2>{"Rounds" if rows and "round" in rows[0] else "Runs (best first)"}</h2><table><tr>{header}</tr>{table}</table>
<h2>Curves</h2>{figures}
{"<h2>Samples</h2>" + samples if samples else ""}
</body></html>
"""
    report = path / "report.html"
    report.write_text(page)
    return report
