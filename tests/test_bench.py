"""The benchmark harness runs end to end (smoke size) and refuses to report speed without agreement; the
benchmarks share benchmarks/harness.py and do not import each other in a cycle."""

import ast
import json
from pathlib import Path

import pytest
from helpers import run_script

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
MODULES = {p.stem for p in BENCHMARKS.glob("*.py")}


@pytest.fixture
def harness(monkeypatch):
    """benchmarks/harness.py, imported as the benchmarks import it (benchmarks/ on sys.path)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import harness

    return harness


def _imports(path: Path) -> list[tuple[str, str]]:
    """(benchmark module, name) for each name `path` imports from another benchmark module; (module, "") for
    `import module`. Function-level imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name in MODULES]
    return found


def test_benchmarks_share_the_harness_without_cycles():
    imports = {p.relative_to(BENCHMARKS).as_posix(): _imports(p) for p in SCRIPTS}
    graph = {name: {module for module, _ in found} for name, found in imports.items()}
    assert graph["harness.py"] == set()  # the base: it imports no benchmark
    assert "bench" not in graph["bench_scale.py"]  # bench dispatches to bench_scale, never the other way
    assert "bench_dpo" not in graph["bench.py"]  # bench_dpo builds on bench, never the other way
    assert graph["gpu_harness.py"] == {"harness"}
    for name in ("bench.py", "bench_dpo.py", "bench_scale.py", "gpu_harness.py", "profile_step.py", "lora_memory.py"):
        assert "harness" in graph[name], name
    for name, found in imports.items():
        private = [f"{module}.{n}" for module, n in found if n.startswith("_")]
        assert not private, f"{name} imports private names {private}"
    for path in SCRIPTS:
        assert "sys.path.insert" not in path.read_text(), path  # run from the root, benchmarks/ is on sys.path


def test_harness_sections_replace_in_place(harness):
    text = "# T\n\nmain\n\n## A\n\nold a\n\n## B\n\nb\n"
    assert harness.get_section(text, "## A") == "## A\n\nold a\n"
    assert harness.get_section(text, "## C") is None
    replaced = harness.replace_section(text, "## A", "## A\n\nnew a\n")
    assert replaced == "# T\n\nmain\n\n## A\n\nnew a\n\n## B\n\nb\n"
    assert harness.replace_section(text, "## B", "## B\n\nnew b") == "# T\n\nmain\n\n## A\n\nold a\n\n## B\n\nnew b\n"
    assert harness.replace_section(text, "## C", "## C\n\nc").endswith("## B\n\nb\n\n## C\n\nc\n")
    assert harness.replace_section("", "## C", "## C\n\nc") == "## C\n\nc\n"


def test_harness_worker_protocol(harness, tmp_path):
    """run_worker: `SCRIPT worker NAME --work --out FLAGS` in a fresh process with the benchmark environment, its
    RESULT line back as a dict with the process' seconds; a failed worker ends the run or, if allowed, is reported."""
    script = tmp_path / "w.py"
    script.write_text(
        "import json, os, sys\n"
        "if sys.argv[2] == 'bad':\n"
        "    sys.exit('it broke')\n"
        "print('RESULT not this one')\n"
        "env = {k: os.environ.get(k) for k in ('HF_DATASETS_CACHE', 'HF_HUB_OFFLINE', 'TQDM_DISABLE', 'X')}\n"
        "print('RESULT ' + json.dumps({'argv': sys.argv[1:], 'env': env}))\n"
        "print('trailing noise')\n"
    )
    work = tmp_path / "w"
    result = harness.run_worker(script, "good", work, ["--size", "smoke"], env={"X": "1"})
    out = str(work / "runs" / "good")
    assert result["argv"] == ["worker", "good", "--work", str(work), "--out", out, "--size", "smoke"]
    assert result["env"] == {
        "HF_DATASETS_CACHE": str(work / "hf-datasets-cache"),
        "HF_HUB_OFFLINE": "1",
        "TQDM_DISABLE": "1",
        "X": "1",
    }
    assert result["process_seconds"] > 0
    with pytest.raises(SystemExit, match="worker bad failed:\n.*it broke"):
        harness.run_worker(script, "bad", work)
    assert harness.run_worker(script, "bad", work, must_succeed=False) == {"failed": "it broke"}


def test_harness_median_step_skips_the_first(harness):
    assert harness.median_step([9.0, 1.0, 2.0, 3.0]) == 2.0
    assert harness.median_step([5.0]) == 5.0


def test_ours_train_tokens_reads_the_trainer_state(monkeypatch, tmp_path):
    """Top-level token counters of trainer_state.json first, else the newest log record that has them."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench import ours_train_tokens

    assert ours_train_tokens(tmp_path) is None
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 3, "tokens_needed": 10, "tokens_executed": 20, "log_history": []}))
    assert ours_train_tokens(tmp_path) == {"tokens_needed": 10, "tokens_executed": 20, "token_efficiency": 0.5}
    history = [{"loss": 1.0}, {"tokens_needed": 6, "tokens_executed": 8, "token_efficiency": 0.75}, {"loss": 0.5}]
    state.write_text(json.dumps({"global_step": 3, "log_history": history}))
    assert ours_train_tokens(tmp_path) == {"tokens_needed": 6, "tokens_executed": 8, "token_efficiency": 0.75}
    state.write_text(json.dumps({"global_step": 3, "log_history": [{"loss": 1.0}]}))
    assert ours_train_tokens(tmp_path) is None


def test_ops_per_step_do_not_grow_with_rows(monkeypatch, tmp_path):
    """profile_step's measurement, in this process: with one attention call a layer, a steady training step
    dispatches as many ops at 16 rows as at 4 (no per-row work in the collator or the scorer), and reads as few
    values back from tensors."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from profile_step import worker

    few, many = (worker(f"ops_ours-dense_{rows}", tmp_path, steps=(2, 3)) for rows in (4, 16))
    assert few["ops"] > 100 and few["aten"] > 100
    assert many["ops"] <= 1.02 * few["ops"], (few, many)
    assert few["reads"] == many["reads"] == 2  # every step logs here: its metrics and its grad norm


def run_bench(tmp_path, results, *flags):
    """`benchmarks/bench.py --size smoke FLAGS`, its scratch in tmp_path, its report in `results`."""
    flags = ["--size", "smoke", *flags, "--work", str(tmp_path / "w"), "--results", str(results)]
    return run_script(BENCHMARKS / "bench.py", *flags, timeout=600)


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = run_bench(tmp_path, results)
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
    """`--only scale` at the smoke size (500 and 2,000 rows, char tokenizer): kto-pipeline at both (its peak RSS
    growth), trl at the larger only (a process each, whose work at this size is its start-up), every num_proc, token
    ids checked before any number is written; its section replaces the old one in place, the others are kept."""
    heading = "## Scale: preprocessing 20k / 200k / 1M rows"
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Benchmark\n\nmain table\n\n{heading}\n\nold numbers\n\n## LoRA\n\nlora table\n")
    proc = run_bench(tmp_path, results, "--only", "scale")
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
    ours = [("kto-pipeline", "1"), ("kto-pipeline", "2")]
    trl = [("trl", "default (None)"), ("trl", "1"), ("trl", "2")]
    expected = [("500", *r) for r in ours + trl] + [("2,000", *r) for r in ours + trl]
    assert sorted(cells) == sorted(expected), cells
    for key in [("500", *r) for r in trl]:
        assert cells.pop(key)[0] == "not run: trl at 2,000 rows only (--size smoke)", key
    for key, (seconds, rows_per_s, parent, children, speedup) in cells.items():
        assert float(seconds) > 0 and float(rows_per_s.replace(",", "")) > 0, key
        assert float(parent) > 0 and float(children) >= 0, key
        assert (speedup != "-") == (key[2] == "2"), key
    assert "--num-proc 2 tokenizes at least 1.7x faster than 1 (2,000 rows; the datasets.map: " in text
    assert "preprocessing's peak RSS at 2,000 rows at most 150 MB above at 500" in text


@pytest.mark.slow
def test_benchmark_append_smoke(tmp_path):
    """`--only append` at the smoke size (a cache of 200 rows, 10 new rows, char tokenizer): a full precompute,
    then both append forms (grown log, new rows only) into copies of its cache, checked (only the new rows tokenized
    and scored, the cache's files unchanged, inspect --verify, the two appends byte-identical) before any number is
    written; its section replaces the old one in place, the others are kept."""
    heading = "## Append: `precompute --append` of 1% new rows to a 200,000-row cache"
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Benchmark\n\nmain table\n\n{heading}\n\nold numbers\n\n## LoRA\n\nlora table\n")
    proc = run_bench(tmp_path, results, "--only", "append")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("tokenized and scored 10 rows") == 2
    assert proc.stdout.count("inspect --verify OK (") == 2  # (the section names it too)
    assert proc.stdout.count("both appends wrote the same") == 1
    text = results.read_text()
    assert "old numbers" not in text and text.count(heading) == 1
    assert text.index("main table") < text.index(heading) < text.index("## LoRA") < text.index("lora table")
    runs = {}
    for line in text.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(parts) == 13 and parts[0] == "200":
            runs[(parts[0], parts[1])] = parts[2:]
    forms = ("full precompute", "append, grown log", "append, new rows only")
    assert sorted(runs) == sorted(("200", form) for form in forms), runs
    for (n, form), cells in runs.items():
        dataset, tokenized, scored = (int(c.replace(",", "")) for c in cells[:3])
        full = form == "full precompute"
        assert tokenized == scored == (int(n) if full else 10), (n, form)
        assert dataset == {"full precompute": int(n), "append, grown log": int(n) + 10}.get(form, 10), (n, form)
        assert float(cells[4]) > 0 and float(cells[9]) > 0, (n, form)  # process s, peak RSS
        assert (cells[10] == "-") == full, (n, form)
    assert "only the new rows are tokenized and scored | tokenized 10, scored 10 rows" in text
    assert "peak RSS at most the full pass's" in text  # (flatness across cache sizes: the full size only)
    assert "a fixed overhead X = " in text


def test_a_main_table_rerun_keeps_every_other_section(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as `python benchmarks/bench.py` runs it
    from bench import with_other_sections

    old = "# B\n\n## Against the goals\n\nold table\n\n## LoRA\n\nlora\n\n## Demo: held-out\n\n59.4%\n"
    new = with_other_sections("# B\n\n## Against the goals\n\nnew table\n", old)
    assert new == "# B\n\n## Against the goals\n\nnew table\n\n## LoRA\n\nlora\n\n## Demo: held-out\n\n59.4%\n"


def test_host_work_per_token_is_measured_phase_by_phase(monkeypatch, tmp_path):
    """profile_step's host measurement, on a few rows: every phase of the reference pass takes time, the kernels
    take less than the profiled pass they ran in, and the phases (one thread ahead of the forwards) account for most
    of the pass."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import profile_step

    monkeypatch.setattr(profile_step, "HOST_ROWS", 64)
    measured, cache = profile_step.reference_phases(tmp_path)
    phases = dict.fromkeys(p for p, _, _ in profile_step.PHASES)
    assert all(measured[f"ref_{p}"] > 0 for p in phases), measured
    assert 0 < measured["ref_kernels"] < measured["ref_profiled"]  # (both of the profiled run)
    assert measured["ref_rows"] == 64 and (cache / "manifest.json").exists()
    assert sum(measured[f"ref_{p}"] for p in phases) > 0.5 * measured["ref_all"], measured
