"""benchmarks/bench_dpo.py runs end to end at the smoke size (the tiny model on 8 HH-RLHF pairs, 2 steps of 2 pairs):
the two reference passes agree before anything is timed, and its section of RESULTS.md holds the step, FLOP and
token-efficiency rows with numbers."""

from pathlib import Path

import pytest
from helpers import run_script

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
HEADING = "## DPO step: SmolLM2-135M-Instruct on HH-RLHF pairs"


def _rows(text: str) -> dict[str, list[str]]:
    """The cells after the first of each `| measurement | ... |` row of the section's table."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def _number(cell: str) -> float:
    """ "2.48x (trl / ours)" -> 2.48; "100.0% (645 / 645)" -> 100.0; "232.6" -> 232.6."""
    return float(cell.split()[0].rstrip("x%").replace(",", ""))


def _rounded(cell: str) -> tuple[float, float]:
    """A cell's number and half its last decimal's unit: "0.02" -> (0.02, 0.005), "3.17x" -> (3.17, 0.005)."""
    text = cell.split()[0].rstrip("x%").replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text), 0.5 * 10.0**-decimals


@pytest.mark.slow
def test_dpo_benchmark_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Benchmark\n\nmain table\n\n{HEADING}\n\nold numbers\n\n## LoRA\n\nlora table\n")
    flags = ["--size", "smoke", "--work", str(tmp_path / "w"), "--results", str(results)]
    proc = run_script(BENCHMARKS / "bench_dpo.py", *flags, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # correctness before speed: the agreement is printed before the first training worker starts
    out = proc.stdout
    assert "reference log-probs agree on 16 sequences" in out
    assert out.index("reference log-probs agree") < out.index("ours_train ")

    text = results.read_text()
    assert "old numbers" not in text and text.count(HEADING) == 1
    assert text.index("main table") < text.index(HEADING) < text.index("## LoRA") < text.index("lora table")
    assert "- correctness: reference log-probs agree on 16 answers (rel 1e-4)" in text
    rows = _rows(text)
    for what in (
        "train, median step (s), vs trl precomputed",
        "train, median step (s), vs trl online",
        "GFLOP per step, vs trl precomputed",
        "GFLOP per step, vs trl online",
    ):
        ours, trl, ratio, goal, _ = rows[what]
        assert _number(ours) > 0 and _number(trl) > 0, what
        # the ratio is of the unrounded values: it lies within what the cells' rounding allows (smoke steps take
        # about 0.01 s, so a cell of 2 decimals is only a bound)
        (o, o_half), (t, t_half), (r, r_half) = (_rounded(cell) for cell in (ours, trl, ratio))
        low, high = (t - t_half) / (o + o_half), (t + t_half) / max(o - o_half, 1e-12)
        assert ratio.endswith("(trl / ours)") and low - r_half <= r <= high + r_half, (what, ours, trl, ratio)
    assert rows["train, median step (s), vs trl precomputed"][3] == ">= 1.5x"
    # trl runs each prompt twice and pads (and online, a reference forward): more FLOPs a step than ours
    for what in ("GFLOP per step, vs trl precomputed", "GFLOP per step, vs trl online"):
        assert _number(rows[what][2]) > 1, rows[what]
    training = "token efficiency (needed / executed), training"
    efficiency = next(cells for what, cells in rows.items() if what.startswith(training))
    assert _number(efficiency[0]) > _number(efficiency[1]) > 0
    assert "- FLOP ceiling: at equal FLOP rates the step-time ratio" in text
    assert "- raw step times (s): ours [" in text
