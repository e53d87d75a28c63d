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
