"""Attention over packed layouts: the tree mask, attention tree by tree, and which models can take them.

A packed row (`packing.py`) holds several trees `prompt, continuation 1, continuation 2, ...` back to back. A 4-D
attention mask lets each token see exactly what it would see in its own unpadded sequence:

    token q sees token k  <=>  same tree, k at or before q, and k is in the prompt or in q's continuation

(and, for sliding-window models, position(q) - position(k) < window). A causal model's log-prob of a token depends
only on the tokens it sees and their positions, so the values equal the padded computation (one sequence a row) up
to float rounding; the tests hold them to 1e-5.

Under the dense mask every query of a row meets every key of the row. On the CPU attention runs sequence by
sequence instead (`tree_attention`), each run of one sequence's queries meeting only the keys it may see, so a row's
width costs nothing and a sequence computes alike in every layout. `packing_unsupported` names the models that
take no packed layout at all (they run padded).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from kto_pipeline.models import text_config
from kto_pipeline.scoring.packing import BRANCH_PROMPT, AttentionCosts, Layout


def attention_costs(model, device) -> AttentionCosts:
    """The `AttentionCosts` of a model's packed rows on `device`."""
    config = text_config(model)
    pair = 1.0 / (6 * config.hidden_size)
    if not tree_blocks_on(model, device):
        return AttentionCosts(pair)
    return AttentionCosts(pair, pair * TREE_CALL_FLOPS / (4 * _attention_width(config)))


def tree_mask(layout: Layout, queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """(N, 1, Q, K) bool: may query token `queries[n, i]` attend to key token `keys[n, j]`?

    Tokens are named by flat index (row * width + column): a forward may take a layout's rows as they are,
    or gather tokens of several rows into one (training's KL forward, which has no padding). Padding attends
    to earlier padding, so no row of the mask is empty."""
    t, b, p = (x.reshape(-1) for x in (layout.tree, layout.branch, layout.position_ids))
    tq, tk = t[queries][:, :, None], t[keys][:, None, :]
    bq, bk = b[queries][:, :, None], b[keys][:, None, :]
    visible = (tq == tk) & (keys[:, None, :] <= queries[:, :, None]) & ((bk == BRANCH_PROMPT) | (bk == bq))
    if window is not None:
        visible &= (p[queries][:, :, None] - p[keys][:, None, :]) < window
    return visible[:, None]


# ------------------------------------------------------------------------------ attention sequence by sequence
#
# Under the dense mask every query of a row meets every key of the row, so a row of 8 trees of 120 tokens runs
# 8x the (query, key) pairs it needs. `tree_attention` (registered with transformers as TREE_ATTENTION) runs
# transformers' own sdpa attention once per run of one sequence's tokens instead: a tree's prompt with its first
# continuation (one causal call: sdpa's causal kernel, no mask), then each further continuation meeting exactly
# the keys it may see (its prompt, then itself). Only the needed pairs run (the causal kernel skips the masked
# half), and a sequence's attention is the same computation however the trees are laid out: in the
# reference pass's rows, or in training's, where the KL completions run apart on the prompts' cached keys. The
# masked keys a dense call would also take change sdpa's result on the CPU under bf16 (about 4e-3 per value,
# 0.66 nats on a SmolLM2 sequence log-prob: benchmarks/RESULTS-precision.md), so this path is what makes a
# policy equal to its reference score exactly its cached values. Where it is available (`tree_blocks_on`) it
# always runs, gradient checkpointing included (`checkpointing_kwargs`).

TREE_ATTENTION = "kto_tree_sdpa"


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
    # masked half instead of computing it


def tree_blocks(layout: Layout, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> list[RowBlocks]:
    """The `RowBlocks` of each row n of `queries` (N, Q) attending to `keys` (N, K) under the mask `visible`
    (N, 1, Q, K): runs of queries of one (tree, branch), each with the keys of its tree's prompt and, for a
    continuation, its own branch, in the keys' order. A prompt runs in one call with the continuation that
    follows it (its first): the prompt's queries see only the prompt there too, and a tree costs one call
    fewer."""
    t, b = layout.tree.reshape(-1), layout.branch.reshape(-1)
    tq, bq, tk, bk = t[queries], b[queries], t[keys], b[keys]
    out = []
    for n in range(queries.shape[0]):
        # one id per (tree, branch), the prompt counted as its first continuation; padding (tree -1) gets
        # negative ids
        first = torch.where(bq[n] == BRANCH_PROMPT, BRANCH_PROMPT + 1, bq[n])
        ids, counts = torch.unique_consecutive(tq[n] * (int(b.max()) + 2) + first + 1, return_counts=True)
        lengths, is_tree, cols, masks, start = counts.tolist(), [], [], [], 0
        for length in lengths:
            tree, branch = int(tq[n, start]), int(bq[n, start + length - 1])  # a prompt's run ends in its branch
            is_tree.append(tree >= 0)
            if tree >= 0:
                own = (tk[n] == tree) & ((bk[n] == BRANCH_PROMPT) | (bk[n] == branch))
                cols.append(own.nonzero()[:, 0])
                mask = visible[n : n + 1, :, start : start + length].index_select(3, cols[-1])
                causal = length == len(cols[-1]) and bool(mask[0, 0].equal(_lower_triangle(length, mask.device)))
                masks.append(None if causal else mask)
            start += length
        every = torch.cat(cols) if cols else tk.new_zeros(0)
        out.append(RowBlocks(lengths, is_tree, every, [len(c) for c in cols], masks))
    return out


@functools.lru_cache(maxsize=64)
def _lower_triangle(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


# One sdpa call costs about as much on the CPU as 10 MFLOP of attention, whatever its size (the measurement is in
# benchmarks/RESULTS.md, "The price of an attention call"). `pack_rows` weighs it when it lays trees out.
TREE_CALL_FLOPS = 10e6


def sequence_blocks(
    model, layout: Layout, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
) -> list[RowBlocks] | None:
    """The blocks a forward hands to `tree_attention`, or None where it attends on the dense mask: the model or
    device cannot go sequence by sequence (`tree_blocks_on`)."""
    if not tree_blocks_on(model, queries.device):
        return None
    return tree_blocks(layout, queries, keys, visible)


def _attention_width(config) -> int:
    """heads * head_dim: a (query, key) pair costs 4x this in FLOPs (scores and weighted values)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


def tree_attention(module, query, key, value, attention_mask, tree_blocks=None, **kwargs):
    """transformers' sdpa attention, tree by tree when the forward brings `tree_blocks` (a `RowBlocks` per row).
    query (N, H, Q, D), key/value (N, Hkv, K, D), attention_mask (N, 1, Q, K) bool; returns (N, Q, H, D).

    Each row's trees' keys and values are gathered with one index and split (one gather to undo in the
    backward, not one per tree), and the outputs are concatenated in the queries' order."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tree_blocks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    for n, row in enumerate(tree_blocks):
        keys = iter(key[n : n + 1].index_select(2, row.keys).split(row.widths, dim=2))
        values = iter(value[n : n + 1].index_select(2, row.keys).split(row.widths, dim=2))
        masks, outputs = iter(row.masks), []
        for q, is_tree in zip(query[n : n + 1].split(row.lengths, dim=2), row.is_tree, strict=True):
            if is_tree:
                outputs.append(sdpa_attention_forward(module, q, next(keys), next(values), next(masks), **kwargs)[0])
            else:
                outputs.append(query.new_zeros(1, q.shape[2], query.shape[1], value.shape[-1]))
        rows.append(torch.cat(outputs, dim=1))
    return torch.cat(rows), None


def _register_tree_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)  # masks built by transformers stay sdpa's


def tree_blocks_on(model, device) -> bool:
    """Whether packed forwards of this model on `device` run attention sequence by sequence: sdpa models whose
    backbone passes extra keyword arguments down to the attention, on the CPU. There, attention's FLOPs are dear and a
    call is cheap; on a GPU one dense masked kernel beats a launch per tree and layer (not measured yet: the
    dense path stays there). Under gradient checkpointing the backward recomputes each layer with the attention
    its forward used (`checkpointing_kwargs`)."""
    if torch.device(device).type != "cpu":
        return False
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    if getattr(text_config(model), "_attn_implementation", None) != "sdpa":
        return False
    body = getattr(model, "base_model", None)
    return body is not None and _takes_any_keyword(type(body))


@functools.cache
def _takes_any_keyword(cls) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.forward).parameters.values())


@contextmanager
def _attention_implementation(config, implementation: str):
    saved = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = saved


def checkpointing_kwargs(model) -> dict:
    """`gradient_checkpointing_kwargs` for `model.gradient_checkpointing_enable`: non-reentrant checkpoints whose
    recomputation in the backward attends as the forward did. The forward may run inside `attention_by_tree`
    (sequence by sequence), which has exited by the time the backward recomputes the layer: without this, the
    recomputation would attend on the dense mask and save other tensors than the forward."""
    config = text_config(model)

    def context_fn():  # called in each checkpointed forward
        return nullcontext(), _attention_implementation(config, config._attn_implementation)

    return {"use_reentrant": False, "context_fn": context_fn}


@contextmanager
def attention_by_tree(model, on: bool):
    """Within the block, `model` (an sdpa model) attends with `tree_attention`; restored on exit."""
    config = text_config(model)
    if not on:
        yield
        return
    _register_tree_attention()
    config._attn_implementation = TREE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def packing_unsupported(model) -> str | None:
    """Why this model cannot run packed layouts (so the padded path runs instead), or None if it can.

    The 4-D mask is handed to the attention as is, which transformers' `sdpa` and `eager` attention
    take; flash-attention kernels take no arbitrary mask. Models that mix full and sliding-window layers
    would need one mask per layer type; models without position ids (ALiBi) would see wrong distances."""
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    config = text_config(model)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} takes no custom 4-D mask"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        return f"layers of several attention types ({', '.join(sorted(set(layer_types)))})"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "rope") == "alibi":
        return "ALiBi attention biases ignore position ids"
    body = getattr(model, "base_model", None)
    if body is None or "position_ids" not in inspect.signature(body.forward).parameters:
        return f"{type(model).__name__}'s backbone takes no position ids"
    return None


def attention_mask_for(model, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bool mask as the attention implementation takes it: additive float for both.

    sdpa: 0 / -inf in the dtype attention computes in (autocast's, under autocast), the mask sdpa itself would
    make from a bool one. Made once per forward, every layer reads this one tensor; a bool mask is converted by
    each layer's sdpa call, a copy per layer that the backward keeps (24 x 16 MiB for Qwen2-0.5B at 8 x 1024).
    eager: the dtype's minimum, as transformers' own masks."""
    fill = torch.finfo(dtype).min
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        device_type = visible.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        fill = float("-inf")
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, fill)
