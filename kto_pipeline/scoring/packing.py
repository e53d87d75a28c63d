"""Packed batches: sequences side by side in one row, prompts shared by their continuations, no padding.

Both stages score a row's completion and its KL completion, two continuations of one prompt. Run as
two padded sequences, the prompt is computed twice and the padding wastes the rest. Here a batch is a
`Layout`: each row of the tensor holds several *trees* `prompt, continuation 1, continuation 2, ...`
back to back. Every continuation restarts its position ids where its prompt ends, and a 4-D attention
mask (`attention.tree_mask`) lets each token see exactly what it would see in its own unpadded sequence.

Trees are spread over rows (`pack_rows`), as many rows as balance the padding of narrow rows against the
attention of wide ones: under the dense mask every query meets every key of its row. Where attention runs
tree by tree (`by_tree.tree_attention`) or under a block mask (`block_mask.block_mask`), a row's width costs
(almost) nothing and a batch packs into as few rows as the mask's memory allows, without padding.

The layout also splits into two forwards: training runs the prompts and completions with gradients,
keeps their keys/values (a `DynamicCache`), and then runs only the KL completions, without gradients,
against those cached keys/values.

The reference pass groups trees into forward passes (`pack_trees`); models that take no packed layout run
each sequence on its own, padded and length-sorted (`pack_batches`).

Under a block mask (an accelerator's default) every segment of a tree (its prompt, each continuation) starts at a
multiple of the kernel's key tile (`AttentionCosts.align`, `layout_trees(align=)`), the columns between them padding:
the kernel sums a query's keys tile by tile, so a sequence's keys must fall on the tiles alike in every layout (the
reference pass's rows, training's, a pair's) for a policy equal to its reference to score exactly its cached values.

Static shapes (`--static-shapes`): every layout padded to a shape from a small set, rows a power of two and widths
`static_width` (4 sizes a doubling), so that compiled layers see a handful of shapes and each can run as one
static graph; `pack_rows` counts that padding in its cost, and the token counters count it as run.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

BRANCH_PROMPT, BRANCH_PAD = 0, -1
MAX_ROW_TOKENS = 8192
STATIC_MIN_WIDTH = 64  # the smallest static width; then 4 sizes a doubling (80, 96, 112, 128, 160, ...)


def static_width(n: int) -> int:
    """The smallest static width at least `n`: 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, ... (a quarter of
    the power of two below apart): at most 25% padding, each a multiple of 16."""
    if n <= STATIC_MIN_WIDTH:
        return STATIC_MIN_WIDTH
    base = 1 << ((n - 1).bit_length() - 1)  # the power of two below n (base < n <= 2 * base)
    step = base // 4
    return base + -(-(n - base) // step) * step


def aligned(n: int, align: int) -> int:
    """`n` rounded up to a multiple of `align`."""
    return -(-n // align) * align


def tree_tokens(lengths, costs: AttentionCosts | None) -> int:
    """The columns a tree of segments (`lengths`: its prompt, then its continuations) takes in a packed row, each
    segment starting at a multiple of `costs.align`: what `pack_rows` balances."""
    align = costs.align if costs is not None else 1
    return sum(aligned(n, align) for n in lengths)


def static_rows(n: int) -> int:
    """The smallest power of two at least `n` (and 1)."""
    return 1 << max(n - 1, 0).bit_length()


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`; from the host to a GPU through pinned memory, the copy queued without waiting for it (the
    host goes on to the next batch; torch keeps the pinned block until the copy has run)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


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
    align: int = 1  # every segment starts at a column that is a multiple of this (`layout_trees(align=)`)

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def tokens(self) -> int:
        """Real (non-padding) tokens: what a forward over the layout needs."""
        return int((self.branch != BRANCH_PAD).sum())

    def to(self, device) -> Layout:
        moved = {k: (to_device(v, device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return Layout(**moved)

    def prompt_order(self) -> list[int]:
        """The trees in the order the layout holds their prompts (row by row, left to right): the order a forward
        over the whole layout meets their images in."""
        starts = (self.branch == 0) & (self.position_ids == 0)
        return self.tree[starts].tolist()


@dataclass(frozen=True)
class AttentionCosts:
    """How a model's packed rows attend (`kernel`), decided once a run, and what that costs a row in token-forwards
    (a token's FLOPs through the weights), for `pack_rows`; the forwards run the kernel it names.

    pair: per (query, key) pair the dense mask runs: 4 * hidden * layers FLOPs against 2 * ~12 * hidden^2 *
        layers for the weights, i.e. 1 / (6 * hidden);
    tree_call: per tree when attention runs tree by tree (`tree_attention`), the price of its calls
        (TREE_CALL_FLOPS a layer); None where it does not run that way;
    block: the tile size when attention runs under a block mask (`block_mask.block_mask`): the pairs of every tile
        a row's trees touch run, whatever the row's width; None where it does not run that way;
    static: layouts padded to static shapes (`static_rows` x `static_width`): a row count and width cost what
        they are padded to;
    align: every segment of a tree starts at a multiple of this (the block mask's key tile; 1: back to back), which
        callers count in the sizes they pack (`tree_tokens`);
    kernel: the attention kernel that runs the rows (`attention.choose_kernel`): what the forwards hand the model."""

    pair: float = 0.0
    tree_call: float | None = None
    block: int | None = None
    static: bool = False
    align: int = 1
    kernel: str = "dense"


def pack_rows(
    sizes: list[int],
    max_trees: int | None = None,
    costs: AttentionCosts | None = None,
    max_width: int = MAX_ROW_TOKENS,
) -> list[list[int]]:
    """Trees (of `sizes[i]` tokens) into rows: the number of rows that costs least, trees balanced across them.

    A row's tokens all run, padding included: R rows of width W cost R * W token-forwards, plus attention (see
    `AttentionCosts`): under the dense mask every token attends to the whole row, costs.pair * R * W^2, so few
    wide rows pad less and many narrow rows attend less; tree by tree, each tree attends to itself whatever the
    row, at a price per tree; under a block mask, the tiles its trees touch (`block_pairs`). For each R, trees are
    dealt largest first to the rows in serpentine order (rows 0..R-1, then R-1..0, ...), which keeps the rows' widths
    within one tree of each other, in a few array operations whatever the number of trees. At most `max_trees`
    trees a row, and rows of `max_width` tokens at most (default MAX_ROW_TOKENS: the row's (W, W) mask takes W^2 bytes
    however attention runs; a tree wider than that gets a row of its own)."""
    costs = costs or AttentionCosts()
    if not len(sizes):
        return []
    sizes = np.asarray(sizes, dtype=np.int64)
    n = len(sizes)
    order = np.argsort(-sizes, kind="stable")  # largest first
    dealt = sizes[order]
    fewest = 1 if max_trees is None else -(-n // max_trees)  # (serpentine rows hold ceil(n / R) trees at most)
    fewest = min(n, max(fewest, -(-int(sizes.sum()) // max_width)))
    candidates, r = [], float(fewest)
    while int(r) < n:  # row counts tried: every one up to 16, then 6% apart (static: powers of two)
        candidates.append(static_rows(int(r)) if costs.static else int(r))
        r = max(r + 1, r * 1.06)
    if costs.static:
        candidates = sorted({c for c in candidates if c < n})
    best, best_cost = np.zeros(n, dtype=np.int64), float("inf")
    by_tree = float("inf")  # attention tree by tree: the same for every row count
    if costs.tree_call is not None:
        by_tree = costs.pair * float(np.square(sizes.astype(np.float64)).sum()) + n * costs.tree_call
    for num_rows in [*candidates, n]:
        if num_rows * int(dealt[0]) >= best_cost:  # more rows cannot be cheaper: each is at least this wide
            break
        row = _serpentine(n, num_rows)
        width = int(np.bincount(row, weights=dealt, minlength=num_rows).max())
        last = num_rows == n  # one tree a row: always taken
        if costs.static:
            num_rows, width = static_rows(num_rows), static_width(width)
        if width > max_width and not last:  # too wide: more rows
            continue
        if costs.block is not None:
            cost = num_rows * width + costs.pair * _tiles(row, dealt, costs.block) * costs.block**2
        else:
            cost = num_rows * width + min(costs.pair * num_rows * width * width, by_tree)
        if cost < best_cost:
            best, best_cost = row, cost
    by_row = np.argsort(best, kind="stable")  # each row's trees in the order dealt
    bounds = np.cumsum(np.bincount(best))[:-1]
    return [part.tolist() for part in np.split(order[by_row], bounds)]


def _serpentine(n: int, num_rows: int) -> np.ndarray:
    """The row of each of `n` trees dealt to `num_rows` rows in serpentine order: 0..R-1, R-1..0, 0..R-1, ..."""
    k = np.arange(n)
    column, lap = k % num_rows, k // num_rows
    return np.where(lap % 2 == 0, column, num_rows - 1 - column)


def _tiles(row: np.ndarray, sizes: np.ndarray, block: int) -> int:
    """The causal tiles a block mask computes over trees laid end to end in their rows (`row[i]`: tree i's row; a
    row's trees in the order given), see `block_pairs`."""
    by_row = np.argsort(row, kind="stable")
    row, sizes = row[by_row], sizes[by_row]
    ends = np.cumsum(sizes)
    first_of_row = np.r_[True, row[1:] != row[:-1]]
    row_start = np.maximum.accumulate(np.where(first_of_row, ends - sizes, 0))  # where each tree's row begins
    start = ends - sizes - row_start
    first, end = start // block, (start + sizes - 1) // block
    span = end - first + 1
    shared = ~first_of_row & (first == np.r_[-1, end[:-1]])  # the diagonal tile where the previous tree ends
    return int((span * (span + 1) // 2).sum() - shared.sum())


def block_pairs(rows: list[list[int]], sizes: list[int], block: int) -> int:
    """The (query, key) pairs a block mask computes over `rows` of trees laid end to end (`sizes[i]` tokens): every
    causal tile (query block, key block) that one tree spans both sides of, block^2 pairs each. A tree spanning m
    blocks touches m (m + 1) / 2 tiles; a tree that starts in the block where the previous one ends shares that
    diagonal tile with it."""
    trees = [t for row in rows for t in row]
    row = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    return _tiles(row, np.asarray(sizes, dtype=np.int64)[trees], block) * block * block


def layout_trees(
    trees: list[tuple[list[int], list[list[int]]]],
    rows: list[list[int]] | None = None,
    pad_id: int = 0,
    split_last: bool = False,
    static: bool = False,
    align: int = 1,
) -> Layout:
    """Lay out `(prompt, [continuation, ...])` trees, every tree with the same number of continuations.

    `rows` says which trees share each tensor row (default: all in one row); rows are right-padded to
    the longest. With `split_last`, every row holds its prompts and other continuations in columns
    [0, split) and its last continuations in [split, width), so that the two parts can run as two
    forwards (training: completions with grad, then the KL completions on the cached prompts). With `static`, the
    row count is padded to a power of two with empty rows, the width (and the split) to a `static_width`. With
    `align`, every segment (prompt, continuation) starts at a column that is a multiple of it, and so does the split.
    A prompt must have at least one token: it predicts the first continuation token."""
    branches = len(trees[0][1])
    rows = [list(range(len(trees)))] if rows is None else rows
    if any(not trees[t][0] for row in rows for t in row):
        raise ValueError("a tree has an empty prompt: nothing predicts its first token")
    if any(len(trees[t][1]) != branches for row in rows for t in row):
        raise ValueError("every tree needs the same number of continuations")

    # every segment (a tree's prompt, then its continuations), in the order the rows hold them, as arrays: built in
    # numpy and handed to torch once a field, a fixed number of array operations whatever the trees
    placed = np.fromiter(chain.from_iterable(rows), np.int64, count=sum(map(len, rows)))  # trees, row by row
    per_tree = branches + 1
    lengths = np.array([[len(trees[t][0]), *map(len, trees[t][1])] for t in placed.tolist()], dtype=np.int64)
    seg_tree, seg_branch = np.repeat(placed, per_tree), np.tile(np.arange(per_tree), len(placed))
    seg_row = np.repeat(np.repeat(np.arange(len(rows)), [len(row) for row in rows]), per_tree)
    seg_len = lengths.reshape(-1)
    seg_part = ((seg_branch == branches) & split_last).astype(np.int64)  # part 1: the last continuations
    # a segment's column within its row's part: the aligned lengths of the segments before it there
    room = -(-seg_len // align) * align
    group = np.argsort(seg_row * 2 + seg_part, kind="stable")
    ends = np.cumsum(room[group])
    first = np.r_[True, np.diff((seg_row * 2 + seg_part)[group]) != 0]
    seg_col = np.empty_like(seg_len)
    seg_col[group] = ends - room[group] - np.maximum.accumulate(np.where(first, ends - room[group], 0))
    fill = seg_col + seg_len
    split, last = (int(fill[seg_part == part].max(initial=0)) for part in (0, 1))
    if split_last:
        split = aligned(static_width(split) if static else split, align)
        width = split + aligned(last, align)
        width = static_width(width) if static else width
    else:
        split = width = static_width(split) if static else split
    if static:
        rows = rows + [[] for _ in range(static_rows(len(rows)) - len(rows))]
    shape = (len(rows), width)
    seg_start = seg_row * width + seg_part * split + seg_col  # flat index of each segment's first token
    total = int(seg_len.sum())
    within = np.arange(total) - np.repeat(np.cumsum(seg_len) - seg_len, seg_len)  # each token's place in its segment
    where = np.repeat(seg_start, seg_len) + within
    segments = chain.from_iterable((trees[t][0], *trees[t][1]) for t in placed.tolist())
    ids = np.full(shape, pad_id, dtype=np.int64)
    pos = np.zeros(shape, dtype=np.int64)
    tree_of = np.full(shape, -1, dtype=np.int64)
    branch_of = np.full(shape, BRANCH_PAD, dtype=np.int64)
    ids.reshape(-1)[where] = np.fromiter(chain.from_iterable(segments), np.int64, count=total)
    pos.reshape(-1)[where] = (
        np.repeat(np.where(seg_branch == 0, 0, np.repeat(lengths[:, 0], per_tree)), seg_len) + within
    )
    tree_of.reshape(-1)[where] = np.repeat(seg_tree, seg_len)
    branch_of.reshape(-1)[where] = np.repeat(seg_branch, seg_len)
    # per scored token (every continuation token), by sequence, then position: its flat index, the flat index of the
    # token that predicts it (the previous one; for a continuation's first, its prompt's last), its sequence
    seg_sequence = seg_tree * branches + seg_branch - 1
    scored = np.nonzero((seg_branch > 0) & (seg_len > 0))[0]
    scored = scored[np.argsort(seg_sequence[scored], kind="stable")]
    n = seg_len[scored]
    starts = np.cumsum(n) - n
    target = np.repeat(seg_start[scored], n) + (np.arange(int(n.sum())) - np.repeat(starts, n))
    prompt = scored - seg_branch[scored]  # (a tree's segments are consecutive: its prompt comes first)
    predictor = target - 1
    predictor[starts] = seg_start[prompt] + seg_len[prompt] - 1
    sequence = np.repeat(seg_sequence[scored], n)
    sequence, target, predictor = (torch.from_numpy(x) for x in (sequence, target, predictor))
    ids, pos, tree_of, branch_of = (torch.from_numpy(x) for x in (ids, pos, tree_of, branch_of))
    return Layout(ids, pos, tree_of, branch_of, target, predictor, sequence, len(trees), branches, split, align)


def last_continuations(layout: Layout) -> torch.Tensor:
    """Flat indices of a `split_last` layout's last continuations (training's KL completions), row after row, as
    training's KL forward runs them gathered into one row: each row's columns from the split to its last such token,
    rounded up to `layout.align` (the padding that keeps each segment aligned comes along; none where align is 1)."""
    rows, width = layout.branch.shape
    columns = torch.arange(width - layout.split, device=layout.branch.device)
    last = layout.branch[:, layout.split :] == layout.branches
    used = ((columns + 1) * last).amax(1) if width > layout.split else columns.new_zeros(rows)
    used = -(-used // layout.align) * layout.align
    grid = torch.arange(rows * width, device=layout.branch.device).reshape(rows, width)[:, layout.split :]
    return grid[columns[None] < used[:, None]]


Tree = tuple[list[int], list[list[int]]]  # (prompt, [completion, KL completion]), already truncated


@dataclass
class ScoredSequence:
    row: int  # tree (row) in the shard
    kind: int  # 0: completion, 1: KL completion
    prompt_len: int
    ids: list[int]  # prompt + (KL) completion, already truncated


def pack_batches(seqs: list[ScoredSequence], batch_size: int | None, max_tokens: int) -> list[list[ScoredSequence]]:
    """Longest first, then fill each batch while rows <= batch_size (None: any) and padded tokens <= max_tokens."""
    batch_size = batch_size or len(seqs)
    batches: list[list[ScoredSequence]] = []
    current: list[ScoredSequence] = []
    for seq in sorted(seqs, key=lambda s: len(s.ids), reverse=True):
        width = len(current[0].ids) if current else len(seq.ids)
        if current and (len(current) >= batch_size or width * (len(current) + 1) > max_tokens):
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    return batches


def pack_trees(
    sizes: list[int], batch_size: int | None, max_tokens: int, costs: AttentionCosts | None = None
) -> list[list[list[int]]]:
    """Group trees (prompt + completion + KL completion, `sizes[i]` tokens) into forward passes of rows.

    Rows by `pack_rows` (several trees a row, none wider than max_tokens; `costs`: what attention costs); then rows
    into passes while rows x width <= max_tokens (static shapes: as padded) and trees <= batch_size / 2 (batch_size
    counts sequences, two per tree; None: no limit; a tree always fits alone). Returns passes -> rows -> trees."""
    passes: list[list[list[int]]] = []
    current: list[list[int]] = []
    width = trees = 0
    static = costs is not None and costs.static

    def size(rows: int, width: int) -> int:  # the tokens a pass of `rows` rows as wide as `width` runs
        return static_rows(rows) * static_width(width) if static else rows * width

    most_trees = None if batch_size is None else max(batch_size // 2, 1)
    for row in pack_rows(sizes, most_trees, costs, max_width=min(max_tokens, MAX_ROW_TOKENS)):
        row_width = sum(sizes[i] for i in row)
        new_width = max(width, row_width)
        too_many = most_trees is not None and trees + len(row) > most_trees
        if current and (size(len(current) + 1, new_width) > max_tokens or too_many):
            passes.append(current)
            current, width, trees = [], 0, 0
            new_width = row_width
        current.append(row)
        width, trees = new_width, trees + len(row)
    if current:
        passes.append(current)
    return passes


Tree = tuple[list[int], list[list[int]]]  # (prompt, [completion, KL completion]), already truncated
