"""The benchmark harness runs end to end (smoke size) and refuses to report speed without agreement."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench.py"),
            "--size",
            "smoke",
            "--work",
            str(tmp_path / "w"),
            "--results",
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reference log-probs agree" in proc.stdout
    text = results.read_text()
    for row in (
        "reference pass, rows/s",
        "train step (s), vs trl online",
        "train step (s), vs trl precomputed",
        "train peak RSS (MiB), vs trl online",
        "sweep of 4 runs",
    ):
        assert row in text
    assert "trl precomputed 4 (" in text  # trl's sweep paid one reference pass per run


@pytest.mark.slow
def test_benchmark_scale_smoke(tmp_path):
    """`--only scale` at the smoke size (500 and 2,000 rows, char tokenizer): both tools, every num_proc, token ids
    checked before any number is written; its section replaces the old one in place, the others are kept."""
    heading = "## Scale: preprocessing 20k / 200k / 1M rows"
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Benchmark\n\nmain table\n\n{heading}\n\nold numbers\n\n## LoRA\n\nlora table\n")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench.py"),
            "--size",
            "smoke",
            "--only",
            "scale",
            "--work",
            str(tmp_path / "w"),
            "--results",
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("token ids agree on the first 100 rows") == 2
    text = results.read_text()
    assert "old numbers" not in text and text.count(heading) == 1
    assert text.index("main table") < text.index(heading) < text.index("## LoRA") < text.index("lora table")
    cells = {}
    for line in text.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(parts) == 8 and parts[0] in ("500", "2,000"):
            cells.setdefault((parts[0], parts[1], parts[2]), parts[3:])  # the first table (the second has 8 too)
    expected = [("kto-pipeline", "1"), ("kto-pipeline", "2"), ("trl", "default (None)"), ("trl", "1"), ("trl", "2")]
    assert sorted(cells) == sorted((n, tool, p) for n in ("500", "2,000") for tool, p in expected), cells
    for key, (seconds, rows_per_s, parent, children, speedup) in cells.items():
        assert float(seconds) > 0 and float(rows_per_s.replace(",", "")) > 0, key
        assert float(parent) > 0 and float(children) >= 0, key
        assert (speedup != "-") == (key[2] == "2"), key
    assert "--num-proc 2 tokenizes at least 1.7x faster than 1 (2,000 rows; the datasets.map: " in text
    assert "preprocessing's peak RSS at 2,000 rows at most 150 MB above at 500" in text
