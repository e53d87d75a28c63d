"""Attention sequence by sequence: the "by-tree" kernel.

Under the dense mask every query of a row meets every key of the row, so a row of 8 trees of 120 tokens runs
8x the (query, key) pairs it needs. `tree_attention` (registered with transformers as TREE_ATTENTION) runs
transformers' own sdpa attention once per run of one sequence's tokens instead (a model that attends eagerly: its
family's eager attention function, soft-capping or sinks included, as TREE_ATTENTION_EAGER): a tree's prompt alone
(one causal call: sdpa's causal kernel, no mask), then each continuation meeting exactly the keys it may see (its
prompt, then itself). Only the needed pairs run (the causal kernel skips the masked half), and a sequence's
attention is the same computation however the trees are laid out, whichever continuation comes first: in the
reference pass's rows, or in training's, where the KL completions run apart on the prompts' cached keys. The
masked keys a dense call would also take change sdpa's result on the CPU under bf16 (about 4e-3 per value, up to
0.754 nats on a SmolLM2 completion's log-prob and 1.17 on a KL completion's: benchmarks/RESULTS-layouts.md), so
this path is what makes a policy equal to its reference score exactly its cached values. Where it runs
(`attention.choose_kernel`: by-tree) it always runs, gradient checkpointing included
(`attention.checkpointing_kwargs`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kto_pipeline.scoring.packing import BRANCH_PROMPT, Layout

TREE_ATTENTION = "kto_tree_sdpa"
TREE_ATTENTION_EAGER = "kto_tree_eager"  # the same, with the model's own eager attention (soft-capping, sinks)


@dataclass
class RowBlocks:
    """One row's queries as runs of one sequence's tokens, for `tree_attention`: built once per forward, read by
    every layer."""

    lengths: list[int]  # every run, in order (padding runs included)
    is_tree: list[bool]  # False: a run of padding, whose outputs are zeros (no real token attends to padding)
    keys: torch.Tensor  # the key columns of each sequence run, run after run
    widths: list[int]  # how many of `keys` belong to each sequence run
    masks: list[torch.Tensor | None]  # (1, 1, length, width) bool for each sequence run: its part of the row's mask;
    # None where that part is exactly causal (the run's queries are its keys): sdpa's causal kernel skips the
    # masked half instead of computing it. For eager attention (`additive`): every run's part, 0 / the dtype's minimum


def tree_blocks(
    layout: Layout,
    queries: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    additive: torch.dtype | None = None,
) -> list[RowBlocks]:
    """The `RowBlocks` of each row n of `queries` (N, Q) attending to `keys` (N, K) under the mask `visible`
    (N, 1, Q, K): runs of queries of one (tree, branch), each with the keys of its tree's prompt and, for a
    continuation, its own branch, in the keys' order. A prompt runs alone, never in one call with a continuation:
    which continuation follows a prompt depends on the layout (the reference pass lays a row's completion and its
    KL completion after its prompt, training a pair's two answers), and a sequence must compute alike in every
    layout, so that a policy equal to its reference scores exactly the cached values. `additive`: the runs' masks
    as eager attention adds them, in that dtype (0 where visible, the dtype's minimum elsewhere)."""
    t, b = layout.tree.reshape(-1), layout.branch.reshape(-1)
    tq, bq, tk, bk = t[queries], b[queries], t[keys], b[keys]
    out = []
    for n in range(queries.shape[0]):
        # one id per (tree, branch); padding (tree -1) gets negative ids
        ids, counts = torch.unique_consecutive(tq[n] * (int(b.max()) + 2) + bq[n] + 1, return_counts=True)
        lengths, is_tree, cols, masks, start = counts.tolist(), [], [], [], 0
        for length in lengths:
            tree, branch = int(tq[n, start]), int(bq[n, start])
            is_tree.append(tree >= 0)
            if tree >= 0:
                own = (tk[n] == tree) & ((bk[n] == BRANCH_PROMPT) | (bk[n] == branch))
                cols.append(own.nonzero()[:, 0])
                mask = visible[n : n + 1, :, start : start + length].index_select(3, cols[-1])
                if additive is not None:
                    masks.append(torch.zeros(mask.shape, dtype=additive, device=mask.device))
                    masks[-1].masked_fill_(~mask, torch.finfo(additive).min)
                elif length == len(cols[-1]) and bool(mask[0, 0].equal(_lower_triangle(length, mask.device))):
                    masks.append(None)  # exactly causal
                else:
                    masks.append(mask)
            start += length
        every = torch.cat(cols) if cols else tk.new_zeros(0)
        out.append(RowBlocks(lengths, is_tree, every, [len(c) for c in cols], masks))
    return out


def _lower_triangle(n: int, device) -> torch.Tensor:
    # made anew each time (n^2 bytes, once a forward): a cached one would outlive the step that made it, and
    # `estimate-memory`'s check that a real step allocates what its simulation does would see it once only
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def tree_attention(module, query, key, value, attention_mask, tree_blocks=None, eager=False, **kwargs):
    """transformers' sdpa attention (`eager`: the model's own eager attention), tree by tree when the forward brings
    `tree_blocks` (a `RowBlocks` per row). query (N, H, Q, D), key/value (N, Hkv, K, D), attention_mask
    (N, 1, Q, K); returns (N, Q, H, D).

    Each row's trees' keys and values are gathered with one index and split (one gather to undo in the
    backward, not one per tree), and the outputs are concatenated in the queries' order."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attend = eager_attention(module) if eager else sdpa_attention_forward
    if tree_blocks is None:
        return attend(module, query, key, value, attention_mask, **kwargs)
    if isinstance(tree_blocks, dict):  # layers of several types: this layer's runs
        tree_blocks = tree_blocks[layer_type(module)]
    rows = []
    for n, row in enumerate(tree_blocks):
        keys = iter(key[n : n + 1].index_select(2, row.keys).split(row.widths, dim=2))
        values = iter(value[n : n + 1].index_select(2, row.keys).split(row.widths, dim=2))
        masks, outputs = iter(row.masks), []
        for q, is_tree in zip(query[n : n + 1].split(row.lengths, dim=2), row.is_tree, strict=True):
            if is_tree:
                outputs.append(attend(module, q, next(keys), next(values), next(masks), **kwargs)[0])
            else:
                outputs.append(query.new_zeros(1, q.shape[2], query.shape[1], value.shape[-1]))
        rows.append(torch.cat(outputs, dim=1))
    return torch.cat(rows), None


def eager_attention(module):
    """The eager attention function of the modeling file `module` (an attention layer) comes from, or None: what
    transformers runs for it under `attn_implementation="eager"` (with the family's soft-capping or sinks)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def layer_type(module) -> str:
    """The type (`layer_types`) of the layer whose attention `module` is."""
    return module.config.layer_types[module.layer_idx]
