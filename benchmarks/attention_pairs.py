"""The (query, key) pairs attention computes in the real case's batches: the dense mask against the block mask.

    python benchmarks/attention_pairs.py CACHE [--batch 8] [--steps 8] [--reference-batch 16]

On an accelerator, a packed row runs under the dense mask (every query meets every key of its row) or, with the
block-mask kernel, only over the BLOCK_SIZE x BLOCK_SIZE tiles its trees touch. Each kernel packs the rows its own way
(`packing.pack_rows` with that kernel's `AttentionCosts`), as a run on that device would; the pairs are counted on
the forwards that run: training's two (prompts and completions, then the KL completions on the cached prompts,
`logprobs.policy_attention`) for each of the first `steps` batches in order, and the reference pass's (one forward a
pass, `packing.pack_trees`). `needed` = the mask's visible pairs of that kernel's layout; block-mask pairs count
every tile it runs whole (block-size rounding included). Only counts: nothing runs on a model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def count_pairs(cache_dir: Path, batch: int, steps: int, reference_batch: int, max_tokens: int) -> dict:
    """{"train": [per batch: {kernel: AttentionPairs}], "reference": {kernel: AttentionPairs}} for the cache's rows."""
    import torch
    from transformers import AutoConfig

    from kto_pipeline.cache import open_cache
    from kto_pipeline.objectives.items import batch_layout
    from kto_pipeline.objectives.kto import CacheRows, Collator
    from kto_pipeline.scoring.attention import BLOCK_SIZE, AttentionPairs, tree_mask
    from kto_pipeline.scoring.logprobs import policy_attention
    from kto_pipeline.scoring.packing import AttentionCosts, layout_trees, pack_trees

    cache = open_cache(cache_dir)
    config = AutoConfig.from_pretrained(cache.manifest.reference_model)
    pair = 1.0 / (6 * config.get_text_config().hidden_size)
    costs = {"dense": AttentionCosts(pair), "block-mask": AttentionCosts(pair, block=BLOCK_SIZE)}
    rows = CacheRows(cache, cache.manifest.max_length)
    pad = cache.manifest.tokenizer.get("pad_token_id") or 0
    train = []
    for step in range(min(steps, len(rows) // batch)):
        members = [rows[i] for i in range(step * batch, (step + 1) * batch)]
        counted = {}
        for kernel, cost in costs.items():
            layout = batch_layout(Collator(pad, True, cost)(members))
            counted[kernel] = AttentionPairs()
            for queries, keys in policy_attention(layout, pair):
                counted[kernel].add(tree_mask(layout, queries, keys, None))
        train.append(counted)
    trees = [(r["prompt_ids"], [r["completion_ids"], r["kl_completion_ids"]]) for r in rows]
    sizes = [len(p) + len(c) + len(k) for p, (c, k) in trees]
    reference = {}
    for kernel, cost in costs.items():
        reference[kernel] = AttentionPairs()
        for passed in pack_trees(sizes, reference_batch, max_tokens, cost):
            members = [t for row in passed for t in row]
            local = {t: i for i, t in enumerate(members)}
            layout = layout_trees([trees[t] for t in members], [[local[t] for t in row] for row in passed], pad)
            tokens = torch.arange(layout.input_ids.numel()).reshape(layout.input_ids.shape)
            reference[kernel].add(tree_mask(layout, tokens, tokens, None))
    return {"train": train, "reference": reference}


def table(counts: dict) -> list[str]:
    """Markdown rows: one per training batch, then the training total and the reference pass."""

    def mega(n: int) -> str:
        return f"{n / 1e6:.2f}"

    def row(what: str, pairs: dict) -> str:
        dense, block = pairs["dense"], pairs["block-mask"]
        return (
            f"| {what} | {mega(dense.needed)} | {mega(dense.dense)} | {mega(block.needed)} | {mega(block.block_mask)} "
            f"| {dense.dense / max(block.block_mask, 1):.2f}x |"
        )

    lines = [
        "| forwards | needed (dense layout) | dense mask | needed (block-mask layout) | block mask "
        "(whole tiles) | dense / block |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    total = {}
    for i, pairs in enumerate(counts["train"], 1):
        lines.append(row(f"training batch {i}", pairs))
        for kernel, p in pairs.items():
            t = total.setdefault(kernel, type(p)())
            t.needed, t.dense, t.block_mask = t.needed + p.needed, t.dense + p.dense, t.block_mask + p.block_mask
    if total:
        lines.append(row(f"**training, {len(counts['train'])} batches**", total))
    lines.append(row("**reference pass**", counts["reference"]))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache", type=Path)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reference-batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--json", action="store_true", help="print the counts as JSON instead of a table")
    args = parser.parse_args()
    counts = count_pairs(args.cache, args.batch, args.steps, args.reference_batch, args.max_tokens)
    if args.json:
        print(json.dumps(_plain(counts), indent=2))
    else:
        print("(million (query, key) pairs per forward set)")
        print("\n".join(table(counts)))


def _plain(counts: dict) -> dict:
    return {
        "train": [{k: vars(p) for k, p in pairs.items()} for pairs in counts["train"]],
        "reference": {k: vars(p) for k, p in counts["reference"].items()},
    }


if __name__ == "__main__":
    main()
