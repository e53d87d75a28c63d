"""What packing buys a family of mixed sliding-window and full layers: the reference pass and training steps, packed
(each layer with the mask of its own type) against padded (each sequence on its own row), on one machine.

    python benchmarks/bench_families.py              # gemma3_text and olmo3 shapes, 64 HH-RLHF pairs (minutes)
    python benchmarks/bench_families.py --pairs 16   # the code path (seconds)

Each family is a random model of its transformers config (tests/families.py's layer pattern: three sliding-window
layers, then a full one; here 8 layers, hidden 256, a window of 128 tokens) on the bundled HH-RLHF pairs, rows cut to
512 tokens of the char tokenizer (longer than the window). Padded, the path these families took before they packed,
is forced by `packing_unsupported`. Per family and layout: the tokens the forwards ran (padding included) against the
tokens needed (each prompt once), the reference pass's seconds, the median KTO step (batch 16), and how far apart the
two layouts' cached log-probs lie: packed must not change them.
"""

from __future__ import annotations

import argparse
import runpy
import time
from pathlib import Path
from unittest import mock

import harness

FAMILIES = ("gemma3_text", "olmo3")
SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4, head_dim=64)
SHAPE |= dict(num_key_value_heads=2, max_position_embeddings=4096, sliding_window=128)
SHAPE |= dict(layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2)
BATCH, STEPS, MAX_LENGTH = 16, 4, 512
RESULTS = Path(__file__).resolve().parent / "RESULTS-layouts.md"
HEADING = "## Mixed-window families: packed against padded"


def run_layout(model: Path, data: Path, work: Path, padded: bool) -> dict:
    """One layout's reference pass and training run; padded: as if `packing_unsupported` refused the model."""
    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.cache import open_cache

    why = "padded for the comparison" if padded else None
    with mock.patch("kto_pipeline.scoring.plan.packing_unsupported", lambda model: why):  # both stages' plan
        paths = dict(model=str(model), dataset=str(data), output=str(work / "cache"))
        directory = precompute(PrecomputeConfig(**paths, overwrite=True, max_length=MAX_LENGTH))
        res = train(harness.ours_train_config(directory, work / "run", batch=BATCH, steps=STEPS, learning_rate=1e-6))
    cache = open_cache(directory)
    assert cache.manifest["reference_pass"]["prefix_shared"] is not padded, cache.manifest["reference_pass"]
    timing, tokens = cache.manifest.timing, harness.ours_train_tokens(work / "run")
    logps = cache.table.column("ref_token_logps").to_pylist() + cache.table.column("ref_kl_token_logps").to_pylist()
    return dict(
        pass_seconds=timing["reference_pass_seconds"],
        pass_tokens=(timing["tokens_executed"], timing["tokens_needed"]),
        step=harness.median_step(res.step_seconds),
        step_tokens=(tokens["tokens_executed"], tokens["tokens_needed"]),
        logps=[x for row in logps for x in row],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=64, help="HH-RLHF pairs (each gives 2 KTO rows)")
    parser.add_argument("--work", default="/tmp/kto-bench-families")
    parser.add_argument("--results", default=str(RESULTS), help="the file whose section this rewrites ('-': print)")
    args = parser.parse_args()
    from kto_pipeline.demo.hh_rlhf import bundled_path, convert_file

    started, work = time.perf_counter(), Path(args.work)
    data = work / "pairs.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    convert_file(bundled_path(), {str(data): (0, args.pairs)})
    # the tests' builder of each family's layer pattern, from its file
    save_family = runpy.run_path(str(Path(__file__).resolve().parent.parent / "tests" / "families.py"))["save_family"]
    rows, notes = [], []
    for family in FAMILIES:
        model = save_family(family, work / family / "model", **SHAPE)
        runs = {x: run_layout(model, data, work / family / x, x == "padded") for x in ("packed", "padded")}
        for layout, r in runs.items():
            (pe, pn), (se, sn) = r["pass_tokens"], r["step_tokens"]
            cells = f"{pe:,} / {pn:,}", f"{r['pass_seconds']:.1f}", f"{se:,} / {sn:,}", f"{r['step']:.3f}"
            rows.append((family, layout, *cells))
        packed, padded = runs["packed"], runs["padded"]
        apart = max(abs(a - b) / (1 + abs(b)) for a, b in zip(packed["logps"], padded["logps"], strict=True))
        notes.append(
            f"- {family}: packed ran the reference pass {padded['pass_seconds'] / packed['pass_seconds']:.2f}x as fast "
            f"and a step {padded['step'] / packed['step']:.2f}x; cached log-probs packed against padded: at most "
            f"{apart:.1e} apart (relative to 1 + |logp|)"
        )
    command = "python benchmarks/bench_families.py" + (f" --pairs {args.pairs}" if args.pairs != 64 else "")
    versions = ("kto-pipeline", "transformers", "torch")
    head = "| family | layout | reference pass: tokens run / needed | s | step: tokens run / needed | step s |"
    body = [
        HEADING,
        "",
        *harness.provenance(command, time.perf_counter() - started, *versions),
        "",
        f"{args.pairs} HH-RLHF pairs ({2 * args.pairs} KTO rows), max_length {MAX_LENGTH}, KTO batch {BATCH}, {STEPS} "
        "steps, float32, the CPU's default kernel (by-tree); the median step leaves out the first.",
        "",
        *harness.table(head, rows),
        "",
        *notes,
    ]
    harness.publish("\n".join(body) + "\n", None if args.results == "-" else args.results, HEADING)


if __name__ == "__main__":
    main()
