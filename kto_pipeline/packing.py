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
padding of narrow rows against the attention of wide ones (the mask is dense: every query meets
every key of its row).

The layout also splits into two forwards: training runs the prompts and completions with gradients,
keeps their keys/values (a `DynamicCache`), and then runs only the KL completions, without gradients,
against those cached keys/values.
"""

from __future__ import annotations

import heapq
import inspect
from dataclasses import dataclass

import torch

BRANCH_PROMPT, BRANCH_PAD = 0, -1


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


def pack_rows(sizes: list[int], max_trees: int | None = None, attention_cost: float = 0.0) -> list[list[int]]:
    """Trees (of `sizes[i]` tokens) into rows: the number of rows that costs least, trees balanced across them.

    A row's tokens all run, padding included, and under a dense mask each attends to the whole row, so a
    layout of R rows of width W costs about R * W * (1 + attention_cost * W) token-forwards: few wide rows
    pad less, many narrow rows attend less. For each R, trees go largest first to the emptiest row (which
    keeps the rows' widths within one tree of each other). At most `max_trees` trees a row."""
    if not sizes:
        return []
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    fewest = 1 if max_trees is None else -(-len(sizes) // max_trees)
    candidates, r = [], float(fewest)
    while int(r) < len(sizes):  # row counts tried: every one up to 16, then 6% apart
        candidates.append(int(r))
        r = max(r + 1, r * 1.06)
    best, best_cost = [], float("inf")
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
        cost = num_rows * width * (1 + attention_cost * width)
        if cost < best_cost:
            best, best_cost = rows, cost
    return best


def text_config(model):
    """The config of a causal LM's text part (multimodal configs nest it)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def attention_cost(model) -> float:
    """Attention's cost per (query, key) pair relative to the rest of a token's forward, for `pack_rows`:
    4 * hidden * layers FLOPs against 2 * ~12 * hidden^2 * layers for the weights, i.e. 1 / (6 * hidden)."""
    config = text_config(model)
    return 1.0 / (6 * config.hidden_size)


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
