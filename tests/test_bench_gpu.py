"""The GPU benchmarks' code path, run on CPU at the tiny preset: every case runs and every number is reported."""

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from helpers import KL_ON_CACHED_PROMPTS, run_script

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_benchmarks_use_the_harness(monkeypatch):
    """No second copy of the worker runner, the step median or the memory readings: the GPU benchmarks use harness's."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_gpu_matrix
    import gpu_harness
    import harness

    shared = {"run_worker", "median_step", "rss_mib", "peak_rss_mib", "machine", "cpu_name", "step_timer", "measured"}
    for module in (gpu_harness, bench_gpu_matrix):
        source = Path(module.__file__).read_text()
        defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
        assert not defined & shared, module
    assert gpu_harness.harness is harness and bench_gpu_matrix.harness is harness


def test_gpu_data_has_hh_lengths_and_a_pair_loss_counts_both_answers_trained(tmp_path, monkeypatch):
    """A pair loss's data: pairs (prompt, chosen, rejected) with HH lengths within max_length; both answers are
    trained (forward and backward), where KTO runs its KL completion forward only."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_harness
    import harness

    preset = dict(harness.GPU_PRESETS["tiny"], loss_type="sigmoid")
    data = gpu_harness.build_data(tmp_path / "data.jsonl", preset)
    lengths = gpu_harness.pair_lengths(tmp_path)
    assert len(lengths) == preset["rows"] and data["max"] <= preset["max_length"]
    assert all(p + c <= preset["max_length"] and p + k <= preset["max_length"] for p, c, k in lengths)
    kto = gpu_harness.Flops(dict(preset, loss_type="kto"))
    pairs = gpu_harness.Flops(preset)
    (p, c, k) = lengths[0]
    assert pairs.train([lengths[0]]) - kto.train([lengths[0]]) == 2 * k * pairs.per_token(p + k)
    reference = (p + c) * kto.per_token(p + c) + k * kto.per_token(p + k)
    assert pairs.reference([lengths[0]]) == kto.reference([lengths[0]]) == reference


def table_lines(text: str) -> list[list[str]]:
    """Every row of the first markdown table of `text` (its header first), as cells."""
    rows, started = [], False
    for line in text.splitlines():
        if line.startswith("| "):
            started = True
            if not line.startswith("| ---"):
                rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif started:
            break
    return rows


# on a CPU: no MFU (no peak to compare with); a compiled case says which of its timed steps compiled
COMPILING = r"( \(steps 2\.\.\d+: (every timed step compiled|\d+ compiling left out)\))?"
STEP_CELL = re.compile(rf"^\d+\.\d{{4}} s{COMPILING}, [\d,]+ MiB$")


@pytest.mark.slow
def test_bench_gpu_matrix_on_cpu_measures_every_case_or_says_it_did_not(tmp_path, monkeypatch):
    """`make bench-gpu`'s matrix at tiny shapes on the CPU: the default path's step-1 check, the CUDA graphs check and
    the step-1 differences by layout, then every (loss, batch) row with ours compiled (by aot_eager) and eager and trl
    precomputed measured (CUDA graphs and liger skipped with their reasons: the check ran the CUDA graphs mode), the
    reference passes and the goals; written as the newest run after the file's first block."""
    results = tmp_path / "M.md"
    results.write_text("# GPU results\n\nwhat ran where\n\n# An older run\n\nits numbers\n")
    script, work = ROOT / "benchmarks" / "bench_gpu_matrix.py", str(tmp_path / "w")
    proc = run_script(
        script, "--device", "cpu", "--work", work, "--results", str(results), "--budget-s", "900", timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = results.read_text()
    assert text.startswith("# GPU results\n\nwhat ran where\n\n# GPU matrix: `make bench-gpu`\n"), text[:300]
    assert text.rstrip().endswith("# An older run\n\nits numbers")
    assert "exactly 0: yes" in text.split("## The default path's step-1 check")[1].split("##")[0]
    graphs = text.split("## CUDA graphs against the compiled run without them")[1].split("##")[0]
    assert "equal (<= 0.001): yes" in graphs and "(a CPU has none)" in graphs, graphs
    # what moves a sequence's log-prob between layouts: every kernel, then the block mask and by tree with the products
    # in blocks of rows, every layout; by tree, a CPU's default (its sequences attend alone), nothing does
    header, *rows = table_lines(text.split("## Step 1 by layout")[1].split("##")[0])
    import torch

    from kto_pipeline.scoring.products import row_block

    blocked = [f"{k}, products in blocks of {row_block(torch.bfloat16)} rows" for k in ("block-mask", "by-tree")]
    assert header[2:] == ["block-mask", "by-tree", "dense", *blocked] and len(rows) == 9, (header, rows)
    number = re.compile(r"^(-|[\d.e+-]+) / [\d.e+-]+$")
    assert rows[0][2:] == ["0 / 0"] * 5 and all(number.match(c) for r in rows for c in r[2:]), rows
    for by_tree in (3, 6):
        assert [r[by_tree] for r in rows] == ["0 / 0"] * 5 + ["- / 0"] * 4, rows
    header, *rows = table_lines(text.split("## Training steps")[1])
    assert header[:4] == ["model", "loss", "batch", "needed tokens a step"] and len(rows) == 2, (header, rows)
    assert {(r[1], r[2]) for r in rows} == {("kto", "4"), ("sigmoid", "4")}
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        for column in ("kto-pipeline compiled", "kto-pipeline eager", "trl precomputed"):
            assert STEP_CELL.match(cells[column]), (row, column)
        assert cells["trl precomputed + liger"].startswith("skipped: liger-kernel"), row
        assert cells["kto-pipeline CUDA graphs"].startswith("skipped: a CPU has no CUDA graphs"), row
        assert re.match(r"^\d+\.\d\dx$", cells["ours compiled vs trl's best"]), row
        assert int(cells["needed tokens a step"]) > 0, row
    profiled = text.split("## Where a compiled step's time goes (torch.profiler)")[1].split("##")[0]
    assert re.search(
        r"per step: a 5-step minus a 2-step run under torch.profiler: wall \d+\.\d{4} s \(profiled\), "
        r"no GPU \(a CPU run: ops only\), [\d,]+ aten ops dispatched",
        profiled,
    ), profiled
    head, *passes = table_lines(text.split("## Reference passes: needed tokens/s")[1])
    variants = ["kto-pipeline, again", "kto-pipeline, dense mask", "kto-pipeline, --static-shapes"]
    variants += ["kto-pipeline, --torch-compile"]
    assert head[2:] == ["kto-pipeline", "trl precomputed @ 4", *variants] and len(passes) == 2, (head, passes)
    rate = re.compile(r"^[\d,]+(, \d+ s of its \d+ s compiling)?$")  # the compiled pass: its compiling seconds
    kto, pairs = (dict(zip(head, r, strict=True)) for r in passes)
    assert all(rate.match(kto[c]) and float(kto[c].split(", ")[0].replace(",", "")) > 0 for c in head[2:]), kto
    assert "compiling" not in kto["kto-pipeline"] and "compiling" in kto["kto-pipeline, --torch-compile"], kto
    assert rate.match(pairs["kto-pipeline"]) and [pairs[c] for c in variants] == ["-"] * 4, pairs
    goals = table_lines(text.split("## Against the goals")[1])
    assert any(r[0].startswith("step >= 1.5x trl's best (tiny, kto, batch 4)") for r in goals), goals
    assert any(r[0].startswith("step-1 rewards exactly 0") and r[1] == "yes" for r in goals), goals
    formula = text.split("## Formula")[1]
    assert "f(L) = 2 N + 2 n_layers L d" in formula and "- tiny: N = " in formula, formula
    assert "none on CPU (MFU is reported as n/a)" in formula, formula
    # what a GPU run brings back besides the report: the raw results, and every worker's output
    raw = json.loads((Path(work) / "matrix-results.json").read_text())
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import harness

    assert set(raw["checks"]) == {"step_one", "graphs", "layouts"}
    assert "step_seconds" in raw["cases"]["tiny / kto / kto-pipeline eager @ 4"], raw["cases"]
    assert raw["cases"]["tiny / kto / kto-pipeline compiled, profiled @ 4"]["profiled"]["ops"] > 0
    # a compiled case's cell: its median without the steps that compiled (trainer_state.json), saying how many
    compiled_cells = {r[1]: dict(zip(header, r, strict=True))["kto-pipeline compiled"] for r in rows}
    for loss, text in compiled_cells.items():
        res = raw["cases"][f"tiny / {loss} / kto-pipeline compiled @ 4"]
        steps = res["compile"]["compiling_steps"]
        assert steps[0] == 1 and res["compile"]["backend"] == "aot_eager", res["compile"]  # its first step compiled
        left, timed = harness.steps_compiling(res["step_seconds"], steps)
        said = {0: "", timed: " (steps 2..3: every timed step compiled)"}.get(left, f" (steps 2..3: {left} compiling")
        assert text.startswith(f"{harness.median_step(res['step_seconds'], steps):.4f} s{said}"), (text, steps)
    assert "Traceback" not in (Path(work) / "runs" / "build" / "worker.log").read_text()


def test_a_median_step_leaves_out_the_steps_that_compiled(monkeypatch):
    """Steps 2..n, without the steps trainer_state.json says compiled, where any step is left; the matrix's cell says
    how many it left out."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_gpu_matrix
    import harness

    times = [30.0, 9.0, 0.5, 0.7, 0.6, 8.0]
    assert harness.median_step(times) == 0.7  # steps 2..6
    assert harness.median_step(times, [1, 2, 6]) == 0.6  # steps 3..5
    assert harness.median_step(times, [1, 2, 3, 4, 5, 6]) == 0.7  # none left: steps 2..6 again
    assert harness.steps_compiling(times, [1, 2, 6]) == (2, 5)
    res = dict(step_seconds=times, train_peak_mib=100.0, compile=dict(compiling_steps=[1, 2, 6]))
    assert bench_gpu_matrix.cell(res, None, 4, None) == "0.6000 s (steps 2..6: 2 compiling left out), 100 MiB"
    res["compile"]["compiling_steps"] = [1, 2, 3, 4, 5, 6]
    assert bench_gpu_matrix.cell(res, None, 4, None) == "0.7000 s (steps 2..6: every timed step compiled), 100 MiB"
    assert bench_gpu_matrix.cell(dict(res, compile=None), None, 4, None) == "0.7000 s, 100 MiB"  # eager, trl


def test_bench_gpu_matrix_says_how_ours_ran_the_kl_forward_under_checkpointing(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_gpu_matrix

    kept = "on the prompts' cached keys/values"
    results = {
        ("qwen2-1.5b", "kto", "a"): dict(kl_forward=kept),
        ("qwen2-1.5b", "kto", "b"): dict(kl_forward=kept),
        ("qwen2-1.5b", "sigmoid", "a"): dict(kl_forward="none (loss without KL)"),
        ("qwen2-0.5b", "kto", "a"): dict(kl_forward=kept),  # not checkpointed
        ("qwen2-1.5b", "kto", "trl"): dict(step_seconds=[1.0]),  # trl's: none
    }
    assert bench_gpu_matrix.kl_forward_lines(results) == [
        f"ours' KL forward under gradient checkpointing, qwen2-1.5b: none (loss without KL); {kept}",
        "",
    ]
    assert bench_gpu_matrix.kl_forward_lines({}) == []


def test_bench_gpu_matrix_reports_what_the_budget_left_out_as_not_run(tmp_path, monkeypatch):
    """With a budget already spent no group starts, and every case of the report says so: no number stands in for
    one it did not measure."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import time

    import bench_gpu_matrix

    def never(left):
        raise AssertionError("a check started past the budget")

    checks = dict(step_one=never, graphs=never, layouts=never)
    known = []  # what is known after each step: the report is written again from it
    after = lambda results, checked: known.append((len(results), len(checked)))  # noqa: E731
    results, checked = bench_gpu_matrix.run_plan(tmp_path, "cpu", time.time() - 1, checks, after=after)
    assert not (tmp_path / "runs").exists()  # no worker ran
    # written after every step but the last (the caller then writes the whole report), knowing more each time
    assert len(known) == len(bench_gpu_matrix.plan("cpu")) - 1
    assert known == sorted(known) and sum(known[-1]) < len(results) + len(checked)
    assert checked == {name: {"failed": "not run within the budget"} for name in checks}
    text = bench_gpu_matrix.render(results, checked, "cpu", None, 1.0, ["--device", "cpu"])
    header, *rows = table_lines(text.split("## Training steps")[1])
    assert len(rows) == 2
    no_graphs = bench_gpu_matrix.not_on("cpu")["kto-pipeline CUDA graphs @ 4"]  # (a CPU's, not the budget's)
    for row in rows:
        assert row[4:9] == ["not run within the budget"] * 2 + [no_graphs] + ["not run within the budget"] * 2, row
        assert row[3] == "-" and row[-1] == "-", row
    _, *passes = table_lines(text.split("## Reference passes: needed tokens/s")[1])
    assert passes[0][2:] == ["not run within the budget"] * 6, passes  # the KTO row: its variants too
    assert passes[1][2:] == ["not run within the budget"] * 2 + ["-"] * 4, passes  # variants: KTO only
    not_run = "- failed: not run within the budget"
    assert not_run in text.split("## The default path's step-1 check")[1].split("##")[0]
    assert not_run in text.split("## CUDA graphs against the compiled run without them")[1]
    assert not_run in text.split("## Step 1 by layout")[1].split("##")[0]


def test_bench_gpu_matrix_cases_record_a_failure_and_go_on(tmp_path, monkeypatch):
    """A case that runs out of memory or fails is written with its reason and the next case runs; past the
    deadline a case is written as not run."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import time

    import bench_gpu_matrix
    import torch

    cases = bench_gpu_matrix.Cases(tmp_path, time.time() + 600, "cpu")

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    def broken():
        raise ValueError("a bad shape")

    cases.run("a", out_of_memory)
    cases.run("b", broken)
    cases.run("c", lambda: {"step_seconds": [1.0, 0.5]})
    cases.deadline = time.time() - 1
    cases.run("d", lambda: {"step_seconds": [1.0]})
    lines = [json.loads(line) for line in (tmp_path / "cases.jsonl").read_text().splitlines()]
    # a case is written as started, then its result (the driver keeps the last: a started one alone was stopped)
    assert [r["case"] for r in lines] == ["a", "a", "b", "b", "c", "c", "d"]
    assert all("started" in r for r in lines[0:6:2]) and "started" not in lines[-1]
    records = {r["case"]: r for r in lines}
    assert records["a"]["skipped"] == "out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
    assert records["b"]["skipped"] == "failed: ValueError: a bad shape"
    assert records["c"] == {"case": "c", "step_seconds": [1.0, 0.5]}
    assert records["d"] == {"case": "d", "skipped": "not run within the budget"}


def test_the_gpu_plan_runs_what_answers_the_goals_first_and_every_case_once(monkeypatch):
    """`make bench-gpu` on a GPU (8 minutes; what the budget leaves out is not run): first the ~1.5B shape's reference
    pass at the defaults and its compiled step at batch 64 (the MFU goals), then the pair loss against trl (ours
    compiled, trl's two settings), the default path's step-1 check, CUDA graphs after their check, the speed and memory
    goals' cases (KTO on Qwen2-0.5B: ours compiled, where its step's time goes at batch 8 under the profiler, trl's two
    settings), the layouts, the reference pass's variants (compiled last), then the rest; every case of every group
    exactly once. `--first speed` runs KTO's speed cases first, and still every case once."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_gpu_matrix as m

    steps = m.plan("cuda")
    reference, compiled, graphs = m.REFERENCE, "kto-pipeline compiled", "kto-pipeline CUDA graphs"
    speed = [
        ("ours", "qwen2-0.5b", "kto", [reference, f"{compiled} @ 8", f"{m.PROFILED} @ 8", f"{compiled} @ 64"]),
        ("trl", "qwen2-0.5b", "kto", m.group_cases("trl", "cuda")),
    ]
    assert steps[:10] == [
        ("ours", "qwen2-1.5b", "kto", [reference, f"{compiled} @ 64"]),
        ("ours", "qwen2-0.5b", "sigmoid", [reference, f"{compiled} @ 8", f"{compiled} @ 64"]),
        ("trl", "qwen2-0.5b", "sigmoid", m.group_cases("trl", "cuda")),
        ("check", "step_one"),
        ("check", "graphs"),
        ("ours", "qwen2-0.5b", "kto", [f"{graphs} @ 8", f"{graphs} @ 64"]),
        *speed,
        ("check", "layouts"),
        ("ours", "qwen2-0.5b", "kto", list(m.REFERENCE_VARIANTS)),
    ]
    assert list(m.REFERENCE_VARIANTS)[-1].endswith("--torch-compile")
    pairs = m.plan("cuda", first="speed")
    assert pairs[:2] == speed and pairs[2][:3] == ("ours", "qwen2-1.5b", "kto")
    wanted = {
        (tool, model, loss, case)
        for tool in m.TOOLS
        for model in m.MODELS["cuda"]
        for loss in m.LOSSES
        for case in m.group_cases(tool, "cuda")
    }
    variants = {("ours", "qwen2-0.5b", "kto", case) for case in [*m.REFERENCE_VARIANTS, f"{m.PROFILED} @ 8"]}
    for run in (steps, pairs):
        planned = [(s[0], *s[1:3], case) for s in run if s[0] != "check" for case in s[3]]
        assert len(planned) == len(set(planned))
        assert set(planned) == wanted | variants
        assert sorted(s[1] for s in run if s[0] == "check") == ["graphs", "layouts", "step_one"]
    # a CPU run (the code path's check) plans no CUDA graphs case: a CPU has none, and the check runs their mode
    on_cpu = [case for s in m.plan("cpu") if s[0] != "check" for case in s[3]]
    assert set(m.not_on("cpu")) == {f"{graphs} @ 4"} and f"{graphs} @ 4" not in on_cpu and m.not_on("cuda") == {}


def test_a_profiled_steps_gpu_time_counts_kernels_not_the_ranges_annotated_around_them(monkeypatch):
    """`profile_counts` on a GPU's events (made here: a CPU profiles none): the device's copies of annotated ranges
    (inductor's `## Call CompiledFxGraph ##` around a compiled call, the optimizer's step), which span the kernels
    they hold, count neither as kernel time nor as kernels; copies count as time, not as kernels run; the host's
    launches, CUDA graph launches, waits for the device and aten ops are counted by name."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_gpu_matrix

    def event(name, device, us=0.0, annotation=False):
        span = SimpleNamespace(elapsed_us=lambda: us)
        return SimpleNamespace(name=name, device_type=device, time_range=span, is_user_annotation=annotation)

    gpu, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [
        event("## Call CompiledFxGraph fabc ##", gpu, 900.0, annotation=True),
        event("Optimizer.step#AdamW.step", gpu, 300.0, annotation=True),
        event("triton_red_fused_mm_0", gpu, 400.0),
        event("triton_red_fused_mm_0", gpu, 200.0),
        event("sm90_xmma_gemm_bf16", gpu, 250.0),
        event("Memcpy DtoH (Device -> Pinned)", gpu, 50.0),
        *(event(name, cpu) for name in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernelEx", "cudaGraphLaunch")),
        *(event(name, cpu) for name in ("cudaStreamSynchronize", "cudaMemcpyAsync", "aten::mm", "aten::add_")),
    ]
    counts = bench_gpu_matrix.profile_counts(SimpleNamespace(events=lambda: events))
    assert counts["device_s"] == pytest.approx(900e-6)  # 400 + 200 + 250 + 50 us: no annotated range
    assert counts["kernels"] == pytest.approx(
        {"triton_red_fused_mm_0": 600e-6, "sm90_xmma_gemm_bf16": 250e-6, "Memcpy DtoH (Device -> Pinned)": 50e-6}
    )
    assert (counts["kernels_run"], counts["launches"], counts["graph_launches"]) == (3, 3, 1)
    assert (counts["syncs"], counts["ops"]) == (1, 2)


def test_flops_recompute_counts_what_checkpointing_runs_again(tmp_path, monkeypatch, capsys):
    """benchmarks/flops_recompute.py at the tiny preset: a KTO step executes more FLOPs with gradient checkpointing
    (the layers' forwards again) than without, over the same tokens (the KL completions on their prompts' cached
    keys/values either way), the depths' fit carried to the preset's depth reproduces a measured depth, and the MFU
    ceiling is said. The script's `main` runs in this process on its command line (parsed, the report printed as the
    script prints it): it counts FLOPs, not time or memory, so a fresh process would add nothing it checks, only the
    imports of training again (seconds of CPU)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import flops_recompute

    args = ("--preset", "tiny", "--max-length", "128", "--layers", "1", "2", "--work", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["flops_recompute.py", *args])
    flops_recompute.main()
    stdout = capsys.readouterr().out
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith(("1 layer", "2 layer")):
            ratio = [float(re.search(r"\(([\d.]+)\)", c).group(1)) for c in cells[2:4]]
            rows[cells[0]] = (*ratio, cells[4])
    assert set(rows) == {"1 layer(s), measured", "2 layer(s), measured", "2 layers, fitted"}, stdout
    for name, (without, with_checkpointing, _) in rows.items():
        assert 0 < without < with_checkpointing, name
    assert rows["2 layers, fitted"][:2] == rows["2 layer(s), measured"][:2]  # two depths: the fit goes through both
    without, with_checkpointing, needed = map(
        int, re.match(r"(\d+) / (\d+) \((\d+)\)", rows["2 layer(s), measured"][2]).groups()
    )
    assert needed <= without and without == with_checkpointing  # the KL forward on the cached prompts either way
    assert f"with checkpointing: {KL_ON_CACHED_PROMPTS}" in stdout
    assert re.search(r"an MFU of 40% needs \d+% of the peak on executed FLOPs without checkpointing, \d+% with", stdout)
