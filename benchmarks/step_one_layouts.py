"""Where a GPU's step-1 difference comes from: the same sequences scored in layouts that differ in one thing at a time.

    python benchmarks/step_one_layouts.py                              # a CUDA GPU: Qwen2-0.5B shapes (`make bench-gpu`
                                                                       # runs it after the cases of its goals)
    python benchmarks/step_one_layouts.py --device cpu --preset tiny   # the code path (seconds)

At step 1 the policy is the reference, so its rewards are exactly 0 where both stages compute each sequence bit for
bit alike; on one H100 they were not (RESULTS-gpu.md). Here 4 trees (prompt, completion, KL completion; HH-RLHF's
lengths, random tokens) are scored, float32 weights under bf16 autocast, by the reference pass's function
(`score_layout`) in layouts that differ from a first one in one thing each (`LAYOUTS`), and by training's
(`score_policy`; on a CPU the block mask's without gradients: it has no backward there). A cell: the largest
difference from the first layout in the trees' scored tokens' last hidden states / their 8 sequences' log-probs
(nats); "0 / 0" is bit for bit. A column: the attention kernel, then the block mask and by tree again with every
matrix product in calls of 512 rows, as a CPU computes in half precision: whether that takes a GPU's products out of
the differences. It says which of these a fix has to hold fixed.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import gpu_harness
import harness
import torch

HEADING = "## Step 1 on a GPU: which difference between layouts moves a sequence's log-prob"
TREES, SHIFT_ALIGNED, SHIFT_UNALIGNED, WIDER, HEAD_SHIFT = 4, 128, 100, 512, 100
SHIFT_TILE = 16  # the block mask's forward key tile (attention.KEY_TILE)
KERNELS = ("block-mask", "by-tree", "dense")
BLOCKED = ("block-mask", "by-tree")  # again, every product in calls of a fixed number of rows (`products.linear`)
LAYOUTS = (
    ("the first layout again", "nothing (is the kernel deterministic?)"),
    (f"moved {SHIFT_ALIGNED} tokens along the row", "their rows in the matrix products (attention's tiles as before)"),
    (f"moved {SHIFT_UNALIGNED} tokens along the row", "the same, and where attention's 128-token tiles fall"),
    (f"moved {SHIFT_TILE} tokens along the row", f"where 128-token tiles fall, not {SHIFT_TILE}-token ones"),
    (f"a row {WIDER} tokens wider", "the matrix products' shapes"),
    (f"the LM head alone, {HEAD_SHIFT} rows before them", "the head's chunks' shapes"),
    ("training's first forward: the 4 trees' completions", "everything step 1's rewards compare"),
    ("training's KL forward, on the cached prompts", "everything step 1's KL compares"),
    ("the same two, segments as the stages lay them out", "step 1 as it runs (block mask: on its key tiles)"),
)


def trees_of(preset: dict) -> list[tuple[list[int], list[list[int]]]]:
    """4 trees with HH-RLHF's lengths scaled to max_length (each KL completion another row's completion), then the
    fillers of `run`'s layouts (`sizes`); random token ids, seeded."""
    real, max_length = gpu_harness.hh_rlhf_lengths(), preset["max_length"]
    scale = max_length / max(p + c for p, c in real)
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, preset["vocab"]) for _ in range(max(n, 1))]

    picked = [real[rng.randrange(len(real))] for _ in range(TREES + 1)]
    lengths = [(round(p * scale), round(c * scale)) for p, c in picked]
    trees = [(ids(p), [ids(c), ids(lengths[i + 1][1])]) for i, (p, c) in enumerate(lengths[:TREES])]
    sizes = (SHIFT_ALIGNED, SHIFT_UNALIGNED, SHIFT_ALIGNED - SHIFT_UNALIGNED, WIDER, SHIFT_TILE, 128 - SHIFT_TILE)
    fillers = [(ids(n // 2), [ids(n // 4), ids(n - n // 2 - n // 4)]) for n in sizes]
    return trees + fillers


def run(model_dir: Path, preset: dict, device: str, kernels: tuple[str, ...]) -> dict:
    """kernel -> [(hidden diff or None, log-prob diff) per LAYOUTS], or the reason it did not run."""
    from kto_pipeline.models import backbone_of, load_model
    from kto_pipeline.runtime.precision import Regime
    from kto_pipeline.scoring.attention import attention_costs, choose_kernel
    from kto_pipeline.scoring.head import head_logps
    from kto_pipeline.scoring.logprobs import score_layout, score_policy
    from kto_pipeline.scoring.packing import layout_trees
    from kto_pipeline.scoring.products import ROW_BLOCK_DEVICES, row_block, rows_alike

    model = load_model(str(model_dir), torch.float32).to(device)
    trees, first = trees_of(preset), list(range(TREES))
    a, b, c, wide, d, e = range(TREES, TREES + 6)  # the fillers' indices: 128, 100, 28, 512, 16 and 112 tokens
    rows = dict(first=[[*first, a]], aligned=[[a, *first]], unaligned=[[b, *first, c]], tile=[[d, *first, e]])
    rows["wider"] = [[*first, a, wide]]
    hidden: list[torch.Tensor] = []
    backbone_of(model).register_forward_hook(lambda module, args, out: hidden.append(out.last_hidden_state))
    ours = torch.arange(2 * TREES)  # the 4 trees' sequences (completion, KL completion): numbered first

    def scored(layout, attention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the trees' scored tokens' hidden states, their sequences' log-probs, the head's inputs)."""
        hidden.clear()
        with torch.no_grad():
            logps = score_layout(model, layout.to(device), attention, with_stats=False).logps[ours]
        mine = (layout.sequence < 2 * TREES).to(device)
        predictor = layout.predictor.to(device)[mine]
        targets = layout.input_ids.to(device).reshape(-1)[layout.target.to(device)[mine]]
        return hidden[0].reshape(-1, hidden[0].shape[-1])[predictor].float(), logps.float(), targets

    def diff(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x - y).abs().max())

    results = {}
    for kernel, blocked in [*((k, False) for k in kernels), *((k, True) for k in BLOCKED if k in kernels)]:
        chosen, why = choose_kernel(model.eval(), kernel, device)  # (for the reference pass)
        attention = attention_costs(model, chosen)
        column = f"{chosen}, products in blocks of {row_block(torch.bfloat16, device)} rows" if blocked else chosen
        if why is not None:
            results[column] = f"not run: {why}"
            continue
        if blocked:  # from here on (the model's linear layers stay blocked)
            ROW_BLOCK_DEVICES.add(device)
            rows_alike(model, Regime("float32", "bfloat16"), torch.device(device))
        cells = []
        with torch.autocast(device, dtype=torch.bfloat16):
            model.eval()
            base_hidden, base, targets = scored(layout_trees(trees, rows["first"]), attention)
            for name in ("first", "aligned", "unaligned", "tile", "wider"):
                h, logps, _ = scored(layout_trees(trees, rows[name]), attention)
                cells.append((diff(h, base_hidden), diff(logps, base)))
            with torch.no_grad():  # the head alone: HEAD_SHIFT other rows first, then the same hidden states
                before = torch.randn(HEAD_SHIFT, base_hidden.shape[1], device=device, dtype=base_hidden.dtype)
                other = torch.randint(3, preset["vocab"], (HEAD_SHIFT,), device=device)
                shifted = head_logps(model, torch.cat([before, base_hidden]), torch.cat([other, targets]), None, False)
                alone = head_logps(model, base_hidden, targets, None, False)
            cells.append((None, diff(shifted[0][HEAD_SHIFT:].float(), alone[0].float())))
            # training's forwards, with gradients where the kernel has a backward (FlexAttention has none on a CPU);
            # then with the segments aligned as the stages align them, against the reference pass's rows laid out alike
            grad = not (chosen == "block-mask" and device == "cpu")
            for stage_align, as_staged in ((1, False), (attention.align, True)):
                if as_staged:
                    model.eval()
                    base = scored(layout_trees(trees, rows["first"], align=stage_align), attention)[1]
                model.train(grad)
                layout = layout_trees(trees[:TREES], [first], split_last=True, align=stage_align).to(device)
                with torch.set_grad_enabled(grad):
                    policy = score_policy(model, layout, attention, with_stats=False)
                if grad and as_staged:  # and its backward runs (the kernel's gradient under the same mask)
                    policy.completions.logps.float().sum().backward()
                    model.zero_grad(set_to_none=True)
                got = (policy.completions.logps, policy.kl.logps)
                parts = [diff(logps.detach().float(), base[i::2]) for i, logps in enumerate(got)]
                cells += [(None, max(parts))] if as_staged else [(None, parts[0]), (None, parts[1])]
        results[column] = cells
    return results


def table_lines(results: dict) -> list[str]:
    """The table of `run`'s results (a kernel that did not run: a line saying why)."""
    kernels = [k for k in results if not isinstance(results[k], str)]
    header = "| layout (against the first) | what differs | " + " | ".join(kernels) + " |"
    cells = {k: [f"{'-' if h is None else f'{h:.2g}'} / {logp:.2g}" for h, logp in results[k]] for k in kernels}
    rows = [(name, what, *(cells[k][i] for k in kernels)) for i, (name, what) in enumerate(LAYOUTS)]
    return [*harness.table(header, rows), *(f"- {k}: {why}" for k, why in results.items() if isinstance(why, str))]


def settings(preset_name: str) -> str:
    return (
        f"- `{preset_name}` shapes, random weights, float32 weights under bf16 autocast (both stages' regime); {TREES} "
        "trees with HH-RLHF's lengths, random tokens; a cell: the largest |difference| from the first layout in the "
        "scored tokens' last hidden states / in the 8 sequences' log-probs (nats); 0 / 0 is bit for bit"
    )


def render(results: dict, preset_name: str, device_name: str, seconds: float, argv: list[str]) -> str:
    command = "`python benchmarks/step_one_layouts.py" + "".join(f" {a}" for a in argv) + "`"
    lines = [HEADING, "", *harness.provenance(command, seconds, "torch", "transformers"), f"- device: {device_name}"]
    return "\n".join([*lines, settings(preset_name), "", *table_lines(results)]) + "\n"


def main() -> None:
    parser = harness.script_parser(__doc__, work=str(harness.WORK_DIR / "step-one-layouts"), results="Markdown file")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--preset", default="qwen2-0.5b", choices=sorted(harness.GPU_PRESETS))
    parser.add_argument("--model", help="a model directory of the preset's shape (default: built in --work)")
    kernels_help = f"the attention kernels to measure, comma-separated (default: {','.join(KERNELS)})"
    parser.add_argument("--kernels", default=",".join(KERNELS), help=kernels_help)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    started, preset, model = time.perf_counter(), harness.GPU_PRESETS[args.preset], args.model
    if model is None:
        model = Path(args.work) / f"{args.preset}-model"
        harness.random_qwen2(model, preset, device=args.device)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else harness.cpu_name()
    results = run(Path(model), preset, args.device, tuple(args.kernels.split(",")))
    if args.mode == "worker":  # (the GPU matrix's check)
        return harness.print_result(dict(results=results, device_name=device_name))
    report = render(results, args.preset, device_name, time.perf_counter() - started, sys.argv[1:])
    harness.publish(report, args.results, HEADING)


if __name__ == "__main__":
    main()
