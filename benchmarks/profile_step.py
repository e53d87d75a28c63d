"""Ops dispatched and values read back from tensors per optimizer step, kto-pipeline against trl.KTOTrainer with
precomputed reference log-probs; and the host's work per needed token, by phase (`--host`: `host_worker`).

    python benchmarks/profile_step.py            # writes its section of RESULTS.md (part of `make bench`)
    python benchmarks/profile_step.py --quick    # batches of 4 and 8 rows, printed only: checks the code path
    python benchmarks/profile_step.py --host     # only the host's work per needed token, by phase

On an accelerator every op the host dispatches is at least one kernel launch, so a step's op count bounds how fast a
small step can go, whatever the GPU; every value read back from a device tensor is a wait for the device. Each
measurement runs in a fresh process (`profile_step.py worker NAME`): a 2-step and a 6-step training call under
torch.profiler, every event counted (aten ops, autograd nodes, ranges); their difference over 4 steps is one steady
step, without loading, set-up, the reference pass and the first steps. Data: the first 96 rows of
`bench_scale.row_stream`, prompts cut at 60 characters and completions at 50; model: the tiny Llama of
`kto_pipeline.demo.tiny` (2 layers, hidden 64); max_length 128; float32; batch 8 and 64 rows.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack, contextmanager
from itertools import islice
from pathlib import Path
from unittest import mock

import harness
from bench_scale import row_stream

HEADING = "## Ops per optimizer step: what the host dispatches"
ROWS, MAX_LENGTH, STEPS = 96, 128, (2, 6)
# worker name part: (label, ours' --attention-kernel, --torch-compile); trl.KTOTrainer precomputed, ours as the CPU
# runs it, and with one attention call a layer (the accelerator path's launches), eager and compiled
VARIANTS = {
    "trl": ("trl.KTOTrainer, precomputed", None, False),
    "ours-auto": ("kto-pipeline, CPU default (attention by tree)", "auto", False),
    "ours-dense": ("kto-pipeline, `--attention-kernel dense`", "dense", False),
    "ours-compiled": ("kto-pipeline, `--attention-kernel dense --torch-compile`", "dense", True),
}
# the compiled step again with twice the layers: what a layer adds to a step, and what lies outside the layers
DEEPER = {"ours-compiled4": ("ours-compiled", 4)}


def assets(work: Path, name: str, data: str, rows: int, **shape) -> tuple[Path, Path]:
    """A tiny Llama of kto_pipeline.demo.tiny (`shape`: build_tiny_model's settings) and the first `rows` rows of
    `bench_scale.row_stream`, cut short (the character tokenizer: a token a character) so that every row fits."""
    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model

    model = work / name
    if not (model / "config.json").exists():
        tok = build_char_tokenizer()
        build_tiny_model(tok, **shape).save_pretrained(model)
        tok.save_pretrained(model)
    rows = [dict(r, prompt=r["prompt"][:60], completion=r["completion"][:50]) for r in islice(row_stream(), rows)]
    return model, harness.write_jsonl(work / data, rows)


def runner(kind: str, variant: str, batch: int, work: Path):
    """`run(count, out)` for `counted`: kind "ops", `count` training steps of `variant` from scratch (the cache, for
    ours, made once); "ref", its reference pass over the first `count` rows, `batch` rows a pass (ours: twice as many
    sequences, a row's completion and KL completion; trl: `precompute_ref_batch_size`)."""
    variant, layers = DEEPER.get(variant, (variant, 2))
    model, data = assets(work, f"model-{layers}", "data.jsonl", ROWS, num_layers=layers)
    _, kernel, compiled = VARIANTS[variant]
    trl = dict(batch=batch, max_length=MAX_LENGTH, precompute=True, **harness.TRL_RUN)
    if kind == "ref":
        lines = data.read_text().splitlines(keepends=True)
        files = {rows: work / f"data-{rows}.jsonl" for rows in (ROWS // 2, ROWS)}  # the row counts `counted` passes
        for rows, path in files.items():
            path.write_text("".join(lines[:rows]))
        # ours: `batch` rows a forward, as an accelerator's token budget holds them (the CPU's default holds fewer)
        ours = dict(max_length=MAX_LENGTH, attention_kernel=kernel, torch_compile=compiled, batch_size=2 * batch)
        ours |= dict(model=str(model), max_tokens_per_batch=2 * batch * MAX_LENGTH)

        def run(rows: int, out: Path) -> None:
            if variant == "trl":  # trl 1.16 precomputes in the trainer's constructor
                harness.trl_trainer(model, files[rows], out, max_steps=1, precompute_ref_batch_size=batch, **trl)
            else:
                from kto_pipeline import PrecomputeConfig, precompute

                precompute(PrecomputeConfig(dataset=str(files[rows]), output=str(out), **ours))

        return run
    cache = work / f"cache-{layers}"
    if variant != "trl" and not (cache / "manifest.json").exists():
        from kto_pipeline import PrecomputeConfig, precompute

        precompute(PrecomputeConfig(model=str(model), dataset=str(data), output=str(cache), max_length=MAX_LENGTH))

    def run(steps: int, out: Path) -> None:
        if variant == "trl":
            harness.trl_trainer(model, data, out, max_steps=steps, learning_rate=1e-5, **trl).train()
        else:
            from kto_pipeline import train

            settings = dict(attention_kernel=kernel, torch_compile=compiled, save_steps=0)
            train(harness.ours_train_config(cache, out, batch=batch, steps=steps, learning_rate=1e-5, **settings))

    return run


# what reads a tensor's values back to the host: on an accelerator, each read of a device tensor waits for the device
# to finish what was queued before it (the host cannot launch ahead)
TENSOR_READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def reads_counted():
    """Counts the values read back from tensors (`TENSOR_READS`) while it is open: a list of one count."""
    import torch

    count = [0]

    def counting(original):
        def read(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)

        return read

    with mock.patch.multiple(torch.Tensor, **{name: counting(getattr(torch.Tensor, name)) for name in TENSOR_READS}):
        yield count


def counted(run, counts: tuple[int, int]) -> dict:
    """Ops (every profiler event; aten ops alone) and values read back from tensors of `run(counts[1], out)` minus
    `run(counts[0], out)`, per unit counted; `out` a fresh temporary directory."""
    from torch.profiler import ProfilerActivity, profile

    def once(count: int) -> None:
        with tempfile.TemporaryDirectory() as out:
            run(count, Path(out))

    once(counts[1])  # imports, caches, and every shape the runs meet compiled (with --torch-compile) before counting
    totals = []
    for count in counts:
        with profile(activities=[ProfilerActivity.CPU]) as prof, reads_counted() as reads:
            once(count)
        events = prof.key_averages()
        aten = sum(e.count for e in events if e.key.startswith("aten::"))
        totals.append((sum(e.count for e in events), aten, reads[0]))
    per = ((many - few) / (counts[1] - counts[0]) for few, many in zip(*totals, strict=True))
    return dict(zip(("ops", "aten", "reads"), per, strict=True))


# ------------------------------------------------------------------ the host's work per token, by phase

HOST_HEADING = "## The host's work per needed token: the reference pass and a training step"
HOST_ROWS, HOST_BATCH, HOST_STEPS = 2400, 64, (3, 9)
HOST_FORWARD_TOKENS = 16384
HOST_PASSES = 3  # timed passes, their median reported (one pass alone swings by up to 1.5x here)
# (phase, module or class, function): the time spent in each function is its phase's, less that of the phases run
# inside it (the mask inside the forward); the pass's packing and laying out run ahead of the forwards, in a thread
PHASES = (
    ("pack", "kto_pipeline.scoring.logprobs", "pack_trees"),
    ("collate", "kto_pipeline.scoring.logprobs", "layout_trees"),
    ("collate", "kto_pipeline.scoring.packing:Layout", "to"),
    ("mask", "kto_pipeline.scoring.logprobs", "attention_inputs"),
    ("forward", "kto_pipeline.scoring.logprobs:ReferenceScorer", "forward"),
    ("extract", "kto_pipeline.scoring.logprobs", "_file"),
    ("write", "kto_pipeline.stages.precompute.shards", "_columns"),
    ("write", "kto_pipeline.stages.precompute.shards", "write_shard"),
)
HOST_GOALS = {"reference pass": 2.5, "training step, compiled": 5.0}  # µs per needed token


@contextmanager
def phases_timed():
    """{phase: seconds} of PHASES while open, each function's time less that of the timed calls inside it."""
    import importlib
    import threading

    seconds, local = dict.fromkeys(dict.fromkeys(p for p, _, _ in PHASES), 0.0), threading.local()

    def timing(phase: str, original):
        def timed(*args, **kwargs):
            stack = local.__dict__.setdefault("stack", [])
            stack.append(0.0)  # the time of the timed calls inside this one
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                seconds[phase] += elapsed - stack.pop()
                if stack:
                    stack[-1] += elapsed

        return timed

    with ExitStack() as patches:
        for phase, where, name in PHASES:
            module, _, cls = where.partition(":")
            owner = getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)
            patches.enter_context(mock.patch.object(owner, name, timing(phase, getattr(owner, name))))
        yield seconds


def host_worker(work: Path) -> dict:
    """The reference pass's µs per needed token by phase, then a compiled training step's at HOST_BATCH rows on its
    cache: the median of steps HOST_STEPS[0] + 1 to HOST_STEPS[1] of a HOST_STEPS[1]-step call (their wall times, as
    train records them), after a HOST_STEPS[0]-step call that compiles; per needed token (a row's prompt, completion
    and KL completion)."""
    from kto_pipeline import train

    measured, cache = reference_phases(work)

    def steps(count: int) -> list[float]:
        with tempfile.TemporaryDirectory() as out:
            settings = dict(learning_rate=1e-5, save_steps=0, attention_kernel="dense", torch_compile=True)
            config = harness.ours_train_config(cache, Path(out), batch=HOST_BATCH, steps=count, **settings)
            return train(config).step_seconds

    steps(HOST_STEPS[0])  # compiles
    step = statistics.median(steps(HOST_STEPS[1])[HOST_STEPS[0] :])
    per_row = measured["ref_needed"] / measured["ref_rows"]
    return measured | dict(step_all=step * 1e6 / (HOST_BATCH * per_row), step_seconds=step)


def reference_phases(work: Path) -> tuple[dict, Path]:
    """The reference pass's µs per needed token by phase (`PHASES`: their mean over HOST_PASSES precomputes, after
    one that warms every cache) and in all (the median pass's); and in one more pass under torch.profiler, its
    kernels' (every aten op's self time: what a device would compute) and its wall time, whose rest is the host's
    (Python, torch's dispatch, numpy; the profiler's own overhead too: an upper bound). Returns them and the median
    pass's cache."""
    from torch.profiler import ProfilerActivity, profile

    from kto_pipeline import PrecomputeConfig, precompute
    from kto_pipeline.cache import open_cache

    # a micro Llama (its arithmetic small beside the host's work) and HOST_ROWS short rows
    shape = dict(hidden_size=8, num_layers=1, num_attention_heads=1, num_key_value_heads=1)
    model, data = assets(work, "micro-model", "host-data.jsonl", HOST_ROWS, **shape)
    # forwards of 16,384 tokens, an accelerator's smallest default (the CPU's default is smaller: arithmetic-bound)
    settings = dict(model=str(model), dataset=str(data), max_length=MAX_LENGTH, attention_kernel="dense")
    settings |= dict(max_tokens_per_batch=HOST_FORWARD_TOKENS, overwrite=True)

    def run(output: str) -> tuple[dict, Path]:  # a pass: its manifest's timing, its cache
        cache = precompute(PrecomputeConfig(**settings, output=str(work / output)))
        return open_cache(cache).manifest.timing, cache

    run("host-warm")
    with phases_timed() as seconds:  # HOST_PASSES passes, the phases summed
        passes = [run(f"host-cache-{n}") for n in range(HOST_PASSES)]
    timed, cache = sorted(passes, key=lambda p: p[0]["reference_pass_seconds"])[len(passes) // 2]
    needed = timed["tokens_needed"]
    measured = {f"ref_{p}": s * 1e6 / (needed * HOST_PASSES) for p, s in seconds.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = run("host-profiled")[0]["reference_pass_seconds"]
    kernels = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")) / 1e6
    measured |= dict(ref_kernels=kernels * 1e6 / needed, ref_profiled=profiled * 1e6 / needed)
    measured |= dict(ref_all=timed["reference_pass_seconds"] * 1e6 / needed, ref_forwards=timed["forwards"])
    return measured | dict(ref_needed=needed, ref_rows=timed["rows_scored"]), cache


def render_host(m: dict, seconds: float) -> str:
    phases = dict.fromkeys(p for p, _, _ in PHASES)
    ref, step, host = m["ref_all"], m["step_all"], m["ref_profiled"] - m["ref_kernels"]
    ref_goal, step_goal = HOST_GOALS["reference pass"], HOST_GOALS["training step, compiled"]
    profiled = [("wall time", f"{m['ref_profiled']:.2f}"), ("torch's kernels", f"{m['ref_kernels']:.2f}")]
    lines = [
        HOST_HEADING,
        "",
        *harness.provenance("`python benchmarks/profile_step.py --host` (and part of the full run)", seconds),
        f"- a micro Llama (1 layer, hidden 8, one attention head, the character tokenizer), whose weights' arithmetic "
        "is negligible, so that what is left is mostly the host's work; one thread; the dense kernel; "
        f"{m['ref_rows']:,} short unpaired rows ({m['ref_needed']:,} needed tokens: each prompt once, its completion "
        f"and KL completion), max_length {MAX_LENGTH}, forwards of {HOST_FORWARD_TOKENS:,} tokens "
        f"(`--max-tokens-per-batch {HOST_FORWARD_TOKENS}`, an accelerator's smallest default; {m['ref_forwards']} of "
        f"them); the median of {HOST_PASSES} passes (after one that warms every cache), each phase their mean.",
        "- each phase: the time spent in its functions (`PHASES` in the script), less that of the phases inside "
        "them; packing and laying out run ahead of the forwards in a thread, so the phases may add up to more than "
        "the pass's wall time.",
        "",
        *harness.table("| reference pass phase | µs per needed token |", [(p, f"{m[f'ref_{p}']:.2f}") for p in phases]),
        harness.md_row("phases, summed", f"{sum(m[f'ref_{p}'] for p in phases):.2f}"),
        harness.md_row("**the pass, wall time**", f"**{ref:.2f}**"),
        "",
        "The same pass under torch.profiler, split into torch's kernels (every aten op's own time: what a device "
        "would compute) and the rest (the host's work, with the profiler's own overhead: an upper bound):",
        "",
        *harness.table("| the pass under the profiler | µs per needed token |", profiled),
        harness.md_row("**the host's work** (the rest)", f"**{host:.2f}**"),
        "",
        "What a device would compute (the kernels) is here mostly attention under the dense mask, whose work grows "
        "with the row's width and the heads whatever the hidden size: a micro model makes the weights' arithmetic "
        "negligible, not attention's.",
        "",
        f"A compiled training step (`--attention-kernel dense --torch-compile`) at {HOST_BATCH} rows, the same model "
        f"and cache: the median of steps {HOST_STEPS[0] + 1}-{HOST_STEPS[1]} of a {HOST_STEPS[1]}-step call (after "
        f"a {HOST_STEPS[0]}-step call that compiles), over its rows' needed tokens: {m['step_seconds'] * 1e3:.1f} ms "
        "a step.",
        "",
        *harness.goals_table(
            (f"reference pass <= {ref_goal} µs per needed token", f"{ref:.2f}", ref <= ref_goal),
            ("the same, its host's work (the kernels aside)", f"{host:.2f}", host <= ref_goal),
            (f"training step, compiled, <= {step_goal} µs", f"{step:.2f}", step <= step_goal),
        ),
        "",
        f"torch's kernels (the dense mask and attention over rows as wide as a tree, in one thread) take "
        f"{m['ref_kernels']:.2f} µs per needed token of the pass, the host {host:.2f}.",
        "",
    ]
    return "\n".join(lines)


def worker(name: str, work: Path, steps: tuple[int, int] = STEPS) -> dict:
    """`ops_<variant>_<rows>`: ops per steady step (a `steps[1]`-step minus a `steps[0]`-step call);
    `ref_<variant>_<rows>`: ops per row of the reference pass (over 96 rows minus over 48), `rows` rows a pass."""
    if name == "host":
        return host_worker(work)
    kind, variant, batch = name.split("_")
    return counted(runner(kind, variant, int(batch), work), (ROWS // 2, ROWS) if kind == "ref" else steps)


def ops_table(m: dict, kind: str, batches: tuple[int, ...], unit: str) -> list[str]:
    """Each variant's ops per `unit` at each batch, against trl's, and the largest batch's against the smallest."""
    head = " | ".join(f"ops per {unit}, {b} rows | vs trl" for b in batches)
    lines = harness.table_head(f"| tool | {head} | {batches[-1]} rows / {batches[0]} |")
    trl = [m[f"{kind}_trl_{b}"]["ops"] for b in batches]
    for variant, (label, _, _) in VARIANTS.items():
        runs = [m[f"{kind}_{variant}_{b}"] for b in batches]
        cells = [f"{r['ops']:,.0f} ({r['aten']:,.0f}) | {r['ops'] / t:.2f}x" for r, t in zip(runs, trl, strict=True)]
        lines.append(harness.md_row(label, *cells, f"{runs[-1]['ops'] / runs[0]['ops']:.2f}x"))
    return lines


def render(m: dict, batches: tuple[int, ...], seconds: float, quick: bool) -> str:
    # the compiled step with 2 layers and with 4: ops a layer adds to a step, and the ops outside the layers
    ((deeper, (variant, layers)),), few = DEEPER.items(), 2
    per_layer = []
    for b in batches:
        small, big = m[f"ops_{variant}_{b}"]["ops"], m[f"ops_{deeper}_{b}"]["ops"]
        layer = (big - small) / (layers - few)
        per_layer.append((b, f"{small:,.0f}", f"{big:,.0f}", f"{layer:,.0f}", f"{small - few * layer:,.0f}"))
    reads = [(label, *(f"{m[f'ops_{v}_{b}']['reads']:g}" for b in batches)) for v, (label, _, _) in VARIANTS.items()]
    lines = [
        HEADING,
        "",
        *harness.provenance(f"`python benchmarks/profile_step.py{' --quick' if quick else ''}`", seconds, "trl"),
        f"- each cell: a {STEPS[1]}-step minus a {STEPS[0]}-step training call in one fresh process under "
        "torch.profiler, per step: every profiler event (aten ops, autograd nodes, ranges; aten ops alone in "
        f"brackets). Tiny Llama, {ROWS} short unpaired rows, max_length {MAX_LENGTH}, float32, sequential batches.",
        "",
        *ops_table(m, "ops", batches, "step"),
        "",
        "Values read back from tensors a step, the same way (`.item()`, `.tolist()`, `int()`, `float()`, `bool()` of a "
        "tensor, counted in the same runs; every step logs, as in the runs above): on an accelerator, each read of a "
        "device tensor waits for the device, and the host launches nothing ahead of it. Ours: the step's metrics (one "
        "copy to the host, which also finds a non-finite loss) and the grad norm where the step logs it; the tree "
        "attention's reads are its trees' sizes, on the CPU, where it runs. A read of a CPU tensor waits for nothing: "
        f"the data loader's seed, drawn once an epoch, is 0.5 a step at 64 rows ({ROWS} rows, 2 batches an epoch).",
        "",
        *harness.table("| tool | " + " | ".join(f"values read a step, {b} rows" for b in batches) + " |", reads),
        "",
        f"Where the compiled step's ops are: the same run with {layers} layers instead of {few} "
        f"({VARIANTS[variant][0].split(', ', 1)[1]}); a layer's ops (its compiled graphs called in the forward, the "
        "KL forward and the backward, and their calls' own ops) = the difference / "
        f"{layers - few}; outside the layers = the {few}-layer step minus {few} layers' ops (the embedding, the LM "
        "head's chunks, the loss, the optimizer). CUDA graphs (`--torch-compile-mode reduce-overhead`) would replay "
        "each layer call as one graph: never measured, on no GPU yet. By arithmetic, not measured: at a layer's ops "
        "here, Qwen2-0.5B's 24 layers would dispatch 24 times as many a compiled step, where CUDA graphs would replay "
        "24 x 3 graphs (forward, KL forward, backward).",
        "",
        *harness.table("| rows | step, 2 layers | step, 4 layers | a layer | outside the layers |", per_layer),
        "",
        f"The reference pass, the same way: a pass over the first {ROWS} rows minus one over the first {ROWS // 2}, "
        "per row; N rows a forward pass (trl: `precompute_ref_batch_size` N, a forward for the completions and one "
        "for the KL completions; ours: `--batch-size` 2N sequences, packed, `--max-tokens-per-batch` 2N x max_length "
        "so that they fit one forward, as an accelerator's budget holds them).",
        "",
        *ops_table(m, "ref", batches, "row"),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = harness.script_parser(__doc__, results="file to write the section into", default=None)
    parser.add_argument("--quick", action="store_true", help="batches of 4 and 8 rows, printed only")
    parser.add_argument("--host", action="store_true", help="only the host's work per needed token")
    args = parser.parse_args()
    work = Path(args.work) / "ops"
    if args.mode == "worker":
        harness.print_result(worker(args.name, work))
        return
    started = time.perf_counter()
    shutil.rmtree(work, ignore_errors=True)  # measured from scratch: a new cache
    work.mkdir(parents=True)
    batches = (4, 8) if args.quick else (8, 64)
    results = None if args.quick else harness.default_results(args.results, True)
    env = {"OMP_NUM_THREADS": "1"}
    if not args.host:
        names = [f"ops_{v}_{b}" for v in [*VARIANTS, *DEEPER] for b in batches]
        names += [f"ref_{v}_{b}" for v in VARIANTS for b in batches]
        measured = {name: harness.run_worker(Path(__file__), name, Path(args.work), env=env) for name in names}
        harness.publish(render(measured, batches, time.perf_counter() - started, args.quick), results, HEADING)
    if not args.quick:
        started = time.perf_counter()
        host = harness.run_worker(Path(__file__), "host", Path(args.work), env=env)
        harness.publish(render_host(host, time.perf_counter() - started), results, HOST_HEADING)


if __name__ == "__main__":
    main()
