"""Packed batches: sequences side by side in one row, prompts shared by their continuations, no padding.

Both stages score a row's completion and its KL completion, two continuations of one prompt. Run as
two padded sequences, the prompt is computed twice and the padding wastes the rest. Here a batch is a
`Layout`: each row of the tensor holds several *trees* `prompt, continuation 1, continuation 2, ...`
back to back. Every continuation restarts its position ids where its prompt ends, and a 4-D attention
mask lets each token see exactly what it would see in its own unpadded sequence:

    token q sees token k  <=>  same tree, k at or before q, and k is in the prompt or in q's continuation

(and, for sliding-window models, position(q) - position(k) < window). A causal model's log-prob of a
token depends only on the tokens it sees and their positions, so the values equal the unshared,
padded computation up to float rounding; the tests hold them to 1e-5.

Trees are spread over rows (`pack_rows`), as many rows as balance the
padding of narrow rows against the attention of wide ones: under the dense mask every query meets
every key of its row. On the CPU, where it pays (real models), attention runs tree by tree instead
(`tree_attention`), each tree's queries meeting only its own keys, so a row's width costs nothing and a
batch packs into as few rows as the mask's memory allows, without padding.

The layout also splits into two forwards: training runs the prompts and completions with gradients,
keeps their keys/values (a `DynamicCache`), and then runs only the KL completions, without gradients,
against those cached keys/values.
"""

from __future__ import annotations

import functools
import heapq
import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch

BRANCH_PROMPT, BRANCH_PAD = 0, -1
MAX_ROW_TOKENS = 8192


@dataclass
class Layout:
    """A batch of trees laid out in rows. Every per-token tensor is (R, W); flat index = row * W + column."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    tree: torch.Tensor  # which tree (numbered across the batch) each token belongs to; -1 on padding
    branch: torch.Tensor  # 0 = prompt, j + 1 = continuation j; -1 on padding
    # one entry per scored token (every continuation token), in order of (tree, continuation, token):
    target: torch.Tensor  # (N,) flat index of the scored token
    predictor: torch.Tensor  # (N,) flat index of the token whose hidden state predicts it
    sequence: torch.Tensor  # (N,) tree * branches + continuation: which sequence the token belongs to
    num_trees: int
    branches: int  # continuations per tree
    split: int  # with `layout_trees(split_last=True)`, the column where the last continuations start; else width

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def tokens(self) -> int:
        """Real (non-padding) tokens: what a forward over the layout needs."""
        return int((self.branch != BRANCH_PAD).sum())

    def to(self, device) -> Layout:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return Layout(**moved)


def pack_rows(sizes: list[int], max_trees: int | None = None, costs: AttentionCosts | None = None) -> list[list[int]]:
    """Trees (of `sizes[i]` tokens) into rows: the number of rows that costs least, trees balanced across them.

    A row's tokens all run, padding included: R rows of width W cost R * W token-forwards, plus attention (see
    `AttentionCosts`): under the dense mask every token attends to the whole row, costs.pair * R * W^2, so few
    wide rows pad less and many narrow rows attend less; tree by tree, each tree attends to itself whatever the
    row, at a price per tree. For each R, trees go largest first to the emptiest row (which keeps the rows'
    widths within one tree of each other). At most `max_trees` trees a row, and rows of about MAX_ROW_TOKENS at
    most (the row's (W, W) mask takes W^2 bytes however attention runs)."""
    costs = costs or AttentionCosts()
    if not sizes:
        return []
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    fewest = 1 if max_trees is None else -(-len(sizes) // max_trees)
    fewest = min(len(sizes), max(fewest, -(-sum(sizes) // MAX_ROW_TOKENS)))
    candidates, r = [], float(fewest)
    while int(r) < len(sizes):  # row counts tried: every one up to 16, then 6% apart
        candidates.append(int(r))
        r = max(r + 1, r * 1.06)
    best, best_cost = [], float("inf")
    by_tree = float("inf")  # attention tree by tree: the same for every row count
    if costs.tree_call is not None:
        by_tree = costs.pair * sum(n * n for n in sizes) + len(sizes) * costs.tree_call
    for num_rows in [*candidates, len(sizes)]:
        if num_rows * sizes[order[0]] >= best_cost:  # more rows cannot be cheaper: each is at least this wide
            break
        rows: list[list[int]] = [[] for _ in range(num_rows)]
        heap = [(0, r) for r in range(num_rows)]  # (fill, row): the emptiest row on top
        for i in order:
            fill, r = heapq.heappop(heap)
            rows[r].append(i)
            if max_trees is None or len(rows[r]) < max_trees:
                heapq.heappush(heap, (fill + sizes[i], r))
        width = max(sum(sizes[i] for i in row) for row in rows)
        cost = num_rows * width + min(costs.pair * num_rows * width * width, by_tree)
        if cost < best_cost:
            best, best_cost = rows, cost
    return best


def text_config(model):
    """The config of a causal LM's text part (multimodal configs nest it)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


@dataclass(frozen=True)
class AttentionCosts:
    """What attention costs a packed row, in token-forwards (a token's FLOPs through the weights), for `pack_rows`.

    pair: per (query, key) pair the dense mask runs: 4 * hidden * layers FLOPs against 2 * ~12 * hidden^2 *
        layers for the weights, i.e. 1 / (6 * hidden);
    tree_call: per tree when attention runs tree by tree (`tree_attention`), the price of its calls
        (TREE_CALL_FLOPS a layer); None where it cannot run that way."""

    pair: float = 0.0
    tree_call: float | None = None


def attention_costs(model, device) -> AttentionCosts:
    """The `AttentionCosts` of a model's packed rows on `device`."""
    config = text_config(model)
    pair = 1.0 / (6 * config.hidden_size)
    if not tree_blocks_on(model, device):
        return AttentionCosts(pair)
    return AttentionCosts(pair, pair * TREE_CALL_FLOPS / (4 * _attention_width(config)))


def layout_trees(
    trees: list[tuple[list[int], list[list[int]]]],
    rows: list[list[int]] | None = None,
    pad_id: int = 0,
    split_last: bool = False,
) -> Layout:
    """Lay out `(prompt, [continuation, ...])` trees, every tree with the same number of continuations.

    `rows` says which trees share each tensor row (default: all in one row); rows are right-padded to
    the longest. With `split_last`, every row holds its prompts and other continuations in columns
    [0, split) and its last continuations in [split, width), so that the two parts can run as two
    forwards (training: completions with grad, then the KL completions on the cached prompts).
    A prompt must have at least one token: it predicts the first continuation token."""
    branches = len(trees[0][1])
    rows = [list(range(len(trees)))] if rows is None else rows
    if any(not trees[t][0] for row in rows for t in row):
        raise ValueError("a tree has an empty prompt: nothing predicts its first token")
    if any(len(trees[t][1]) != branches for row in rows for t in row):
        raise ValueError("every tree needs the same number of continuations")

    def tokens(row: list[int], last: bool) -> int:
        return sum(len(trees[t][1][-1]) if last else len(trees[t][0]) + sum(map(len, trees[t][1][:-1])) for t in row)

    if split_last:
        split = max(tokens(row, last=False) for row in rows)
        width = split + max(tokens(row, last=True) for row in rows)
    else:
        split = width = max(tokens(row, False) + tokens(row, True) for row in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    pos = torch.zeros(shape, dtype=torch.long)
    tree_of = torch.full(shape, -1, dtype=torch.long)
    branch_of = torch.full(shape, BRANCH_PAD, dtype=torch.long)
    scored: list[tuple[int, int, int]] = []  # (sequence, target, predictor) as flat indices
    for r, row in enumerate(rows):
        base, cols = r * width, [0, split]  # next free column of each part
        for t in row:
            prompt, continuations = trees[t]
            for b, segment in enumerate([prompt, *continuations]):
                part = 1 if split_last and b == branches else 0
                col, n = cols[part], len(segment)
                cols[part] += n
                start_pos = 0 if b == 0 else len(prompt)
                ids[r, col : col + n] = torch.tensor(segment, dtype=torch.long)
                pos[r, col : col + n] = torch.arange(start_pos, start_pos + n)
                tree_of[r, col : col + n] = t
                branch_of[r, col : col + n] = b
                if b == 0:
                    last_prompt = base + col + n - 1
                else:
                    for j in range(n):
                        predictor = last_prompt if j == 0 else base + col + j - 1
                        scored.append((t * branches + b - 1, base + col + j, predictor))
    scored.sort()  # by sequence, then position: each sequence's tokens in order
    sequence, target, predictor = (torch.tensor(c, dtype=torch.long) for c in zip(*scored, strict=True))
    return Layout(ids, pos, tree_of, branch_of, target, predictor, sequence, len(trees), branches, split)


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


# ------------------------------------------------------------------------------ attention tree by tree
#
# Under the dense mask every query of a row meets every key of the row, so a row of 8 trees of 120 tokens runs
# 8x the (query, key) pairs it needs. `tree_attention` (registered with transformers as TREE_ATTENTION) runs
# transformers' own sdpa attention once per tree instead, on that tree's queries and keys and its part of the
# mask: the same values, only the needed pairs. It is a speed-up and never a condition of correctness: the dense
# mask is still handed over, and a call that brings no blocks runs plain sdpa on it. Gradient checkpointing never
# goes tree by tree (see `tree_blocks_on`).

TREE_ATTENTION = "kto_tree_sdpa"


@dataclass
class RowBlocks:
    """One row's queries as runs of one tree's tokens, for `tree_attention`: built once per forward, read by
    every layer."""

    lengths: list[int]  # every run, in order (padding runs included)
    is_tree: list[bool]  # False: a run of padding, whose outputs are zeros (no real token attends to padding)
    keys: torch.Tensor  # the key columns of each tree run's tree, run after run
    widths: list[int]  # how many of `keys` belong to each tree run
    masks: list[torch.Tensor]  # (1, 1, length, width) bool for each tree run: its part of the row's mask

    def pairs(self) -> int:
        """The (query, key) pairs attention runs tree by tree."""
        tree_lengths = [n for n, is_tree in zip(self.lengths, self.is_tree, strict=True) if is_tree]
        return sum(q * k for q, k in zip(tree_lengths, self.widths, strict=True))


def tree_blocks(layout: Layout, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> list[RowBlocks]:
    """The `RowBlocks` of each row n of `queries` (N, Q) attending to `keys` (N, K) under the mask `visible`
    (N, 1, Q, K)."""
    t = layout.tree.reshape(-1)
    tq, tk = t[queries], t[keys]
    out = []
    for n in range(queries.shape[0]):
        trees, counts = torch.unique_consecutive(tq[n], return_counts=True)
        lengths, is_tree, cols, masks, start = counts.tolist(), [], [], [], 0
        for tree, length in zip(trees.tolist(), lengths, strict=True):
            is_tree.append(tree >= 0)
            if tree >= 0:
                cols.append((tk[n] == tree).nonzero()[:, 0])
                masks.append(visible[n : n + 1, :, start : start + length].index_select(3, cols[-1]))
            start += length
        every = torch.cat(cols) if cols else tk.new_zeros(0)
        out.append(RowBlocks(lengths, is_tree, every, [len(c) for c in cols], masks))
    return out


# One sdpa call costs about 0.1 ms on the CPU whatever its size, about what 10 MFLOP of attention take there
# (measured 2026-11-22 on the 2-core benchmark machine with transformers' sdpa_attention_forward: ~0.1 ms for
# 10-40 token blocks, dense masked rows of 320-2000 tokens at ~100 GFLOP/s).
TREE_CALL_FLOPS = 10e6


def tree_attention_pays(model, queries: torch.Tensor, keys: torch.Tensor, blocks: list[RowBlocks]) -> bool:
    """Whether attending tree by tree saves more than its calls cost: the (query, key) pairs the dense mask runs
    beyond the trees' own, at 4 * heads * head_dim FLOPs each, against TREE_CALL_FLOPS per tree (per layer both).
    Real models' rows of several trees: yes by far; the tests' tiny models: no. `pack_rows` weighs the same."""
    dense = queries.shape[0] * queries.shape[1] * keys.shape[1]
    saved = (dense - sum(row.pairs() for row in blocks)) * 4 * _attention_width(text_config(model))
    return saved > sum(len(row.widths) for row in blocks) * TREE_CALL_FLOPS


def paying_tree_blocks(
    model, layout: Layout, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
) -> list[RowBlocks] | None:
    """The blocks a forward hands to `tree_attention`, or None where it attends on the dense mask: the model or
    device cannot go tree by tree (`tree_blocks_on`), or going tree by tree would not pay (`tree_attention_pays`)."""
    if not tree_blocks_on(model, queries.device):
        return None
    blocks = tree_blocks(layout, queries, keys, visible)
    return blocks if tree_attention_pays(model, queries, keys, blocks) else None


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
    """Whether packed forwards of this model on `device` run attention tree by tree: sdpa models whose backbone
    passes extra keyword arguments down to the attention, on the CPU. There, attention's FLOPs are dear and a
    call is cheap; on a GPU one dense masked kernel beats a launch per tree and layer (not measured yet: the
    dense path stays there). Not under gradient checkpointing: its backward recomputes each layer outside the
    forward and must save the same tensors as the forward did."""
    if torch.device(device).type != "cpu":
        return False
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    if checkpointing(model):
        return False
    if getattr(text_config(model), "_attn_implementation", None) != "sdpa":
        return False
    body = getattr(model, "base_model", None)
    return body is not None and _takes_any_keyword(type(body))


@functools.cache
def _takes_any_keyword(cls) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.forward).parameters.values())


def checkpointing(model) -> bool:
    """Whether the model recomputes its layers in the backward (gradient checkpointing) and so keeps no keys/values."""
    on = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x; older: the next
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


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


# ------------------------------------------------------------------------------------ model support


def sliding_window(model) -> int | None:
    """The attention window of a model whose layers all use one (Mistral-style), else None."""
    config = text_config(model)
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


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
    """The bool mask as the attention implementation takes it: bool for sdpa, additive float for eager."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)
