"""Why step 1 is not exactly zero under bf16: the same sequences scored in different layouts.

At step 1 the policy is the reference, so its rewards are the difference of two computations of the same log-probs:
the reference pass's (packed trees, several per row, each KL completion beside its completion) and training's (the
step's batch packed its own way, the KL completions on the prompts' cached keys/values). This script re-scores each
cache of bench_precision.py (the demo's first pairs) in its own regime, in these layouts, against the cache:

    stage 1 as run       score_shard on all trees, batched as precompute did (must equal the cache: checks the harness)
    stage 1, tree alone  score_shard with one tree per forward
    padded, alone        every sequence alone, unpadded (the padded path, batch 1)
    stage 2, batch       training's forward (PolicyScorer over the Collator's layout) on the step-1 batch
    stage 2, row alone   training's forward on one row at a time

each also with attention forced onto the dense mask (one masked sdpa call per row, as on a GPU).

    .venv/bin/python benchmarks/bench_precision.py      # once: writes the caches under benchmarks/.work/precision
    .venv/bin/python benchmarks/bench_layouts.py        # writes benchmarks/RESULTS-layouts.md
"""

import argparse
import itertools
import time
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
from harness import HERE, WORK_DIR, provenance, table_head

CACHES = WORK_DIR / "precision" / "runs" / "caches"


@contextmanager
def dense_attention(model, on: bool):
    """Within the block (`on`), packed forwards of `model` attend on the dense mask (`--attention-kernel dense`)."""
    from kto_pipeline.scoring.attention import request_attention_kernel

    if on:
        request_attention_kernel(model, "dense", "cpu")
    try:
        yield
    finally:
        request_attention_kernel(model, "auto", "cpu")


def stage1(model, rows, pad_id, batch_size, max_tokens, packed=True) -> list[tuple[float, float]]:
    """Sequence log-probs (completion, KL) as the reference pass scores them; `packed=False`: the padded path."""
    from kto_pipeline.cache import token_sum
    from kto_pipeline.scoring.logprobs import score_shard

    trees = [(r["prompt_ids"], [r["completion_ids"], r["kl_completion_ids"]]) for r in rows]
    out = score_shard(model, trees, pad_id, batch_size, max_tokens, "cpu", packed=packed)
    return [(token_sum(c), token_sum(k)) for c, k in out]


def stage2(model, rows, pad_id, batch_size) -> list[tuple[float, float]]:
    from kto_pipeline.objectives.kto import Collator
    from kto_pipeline.scoring.attention import attention_costs
    from kto_pipeline.stages.train.batches import PolicyScorer

    scorer, collate = PolicyScorer(model), Collator(pad_id, packed=True, attention=attention_costs(model, "cpu"))
    out = []
    for start in range(0, len(rows), batch_size):
        scores = scorer(collate(rows[start : start + batch_size]), with_stats=False)  # with grad, as training
        out += list(zip(scores.completions.logps.tolist(), scores.kl.logps.tolist(), strict=True))
    return out


def compare(values, rows) -> str:
    """Table cells: max and mean |diff| against the cache of the completions' log-probs, then the KL completions'."""
    out = []
    for i, key in enumerate(("ref_logp", "ref_kl_logp")):
        diff = np.abs(np.array([v[i] for v in values]) - np.array([r[key] for r in rows]))
        out += [f"{diff.max():.3g}", f"{diff.mean():.3g}"]
    return " | ".join(out)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from kto_pipeline import PrecomputeConfig
    from kto_pipeline.cache import open_cache

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", default=str(CACHES), help="bench_precision.py's caches directory")
    parser.add_argument("--names", nargs="+", default=["float32", "autocast"], help="caches to re-score")
    parser.add_argument("--batch", type=int, default=4, help="training's batch (bench_precision's step 1)")
    parser.add_argument("--results", default=str(HERE / "RESULTS-layouts.md"))
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = [
        "# One sequence, several layouts: sequence log-probs against the cache (SmolLM2-135M-Instruct, 8 rows)",
        "",
        *provenance("`python benchmarks/bench_layouts.py`", None),
        "- what: each cache of benchmarks/bench_precision.py re-scored in its own regime in several layouts (see the "
        "script's docstring); max and mean |diff| of sequence log-probs (nats) against the cached values.",
        '- "attention": as the package runs (sequence by sequence on this CPU), or forced onto the dense mask (one '
        "masked sdpa call per row, as on a GPU). The caches were written sequence by sequence.",
        "",
        *table_head("| cache (regime) | layout | attention | completions: max abs diff | mean | KL: max | mean | s |"),
    ]
    print("\n".join(lines))
    defaults = PrecomputeConfig(model="", dataset="", output="")  # what precompute batched the caches by
    for name in args.names:
        cache = open_cache(Path(args.caches) / name)
        rows = cache.table.to_pylist()
        model = AutoModelForCausalLM.from_pretrained(cache.manifest.reference_model, dtype=torch.float32).eval()
        weights, autocast = cache.manifest.precision
        regime = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
        pad_id = cache.manifest["tokenizer"]["pad_token_id"]
        score, train = partial(stage1, model, rows, pad_id), partial(stage2, model, rows, pad_id)
        layouts = [
            ("stage 1 as run", partial(score, defaults.batch_size, defaults.max_tokens_per_batch)),
            ("stage 1, tree alone", partial(score, 1, defaults.max_tokens_per_batch)),
            ("padded, alone", partial(score, 1, 1 << 30, packed=False)),
            (f"stage 2, batch {args.batch}", partial(train, args.batch)),
            ("stage 2, row alone", partial(train, 1)),
        ]
        for dense, (label, run) in itertools.product((False, True), layouts):
            if dense and label.startswith("padded"):
                continue
            start = time.perf_counter()
            with regime, dense_attention(model, dense):
                cells = compare(run(), rows)
            seconds = time.perf_counter() - start
            how = "dense mask (forced)" if dense else "as the package runs"
            lines.append(f"| {name} ({weights}, autocast {autocast}) | {label} | {how} | {cells} | {seconds:.0f} |")
            print(lines[-1], flush=True)
    Path(args.results).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
