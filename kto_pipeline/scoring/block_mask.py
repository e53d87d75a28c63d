"""FlexAttention under a block mask: the "block-mask" kernel.


On an accelerator a launch per tree and layer is dear, and one dense masked kernel computes every (query, key)
pair of a row: a row of 8 trees of ~500 tokens computes 8x the pairs it needs. FlexAttention takes the mask as
tiles of BLOCK_SIZE x BLOCK_SIZE pairs: tiles the mask leaves empty are skipped, the others call `mask_mod`. The
forward is torch.compile'd on accelerators (a fused Triton kernel); on the CPU FlexAttention runs its unfused
reference implementation, forward only (torch has no FlexAttention backward on the CPU), which is what the tests
compare with the other kernels.

Step 1 exact: the fused forward sums each query's keys tile by tile (KEY_TILE keys at a time, in the order of
their columns), and a sum's rounding follows where its terms fall in the tiles. On one H100 a sequence's log-prob
moved by up to 0.09 nats when its tree moved 100 columns along its row, and not at all when it moved 128
(benchmarks/RESULTS-gpu.md, "Step 1 by layout"). So every segment of a tree (prompt, each continuation) starts
at a multiple of KEY_TILE in every layout (`AttentionCosts.align`): a sequence's keys then fall on the tiles alike
in the reference pass's rows, training's and a pair's; a tile that holds none of a query's keys changes nothing
(its masked scores add exact zeros). For the same reason no tile is taken as "full" (run without `mask_mod`):
the kernel runs full tiles after the partial ones, and which tiles are full depends on the neighbours a layout
gives a tree, which would reorder a query's sum.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kto_pipeline.scoring.packing import BRANCH_PROMPT, Layout

BLOCK_SIZE = 128  # FlexAttention's tile: (query, key) blocks of 128 x 128 pairs
KEY_TILE = 16  # the keys its forward kernel sums at a time on a CUDA GPU; every segment starts at a multiple
# The forward's options there: its keys in tiles of KEY_TILE (the default's 64 or 128 would take 5x or 12x the
# alignment padding on HH-RLHF's lengths), and the same kernel for short queries (torch would run its split-key
# decoding kernel, which sums a row's keys in another order, below 128 queries).
KERNEL_OPTIONS = {"fwd_BLOCK_N": KEY_TILE, "FORCE_USE_FLEX_ATTENTION": True}
BLOCK_MASK_ATTENTION = "kto_block_mask_flex"


def block_mask(
    layout: Layout,
    queries: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    window: int | None,
    chunk: int | None = None,
):
    """`visible` (N, 1, Q, K) as FlexAttention's `BlockMask`: for each block of BLOCK_SIZE queries, the key blocks
    that hold a visible pair, in column order, all of them run with `mask_mod` (none as full: see above), and
    `mask_mod`: the rule of `tree_mask`, read from per-token vectors (tree, branch, position, flat index) instead of
    the (Q, K) matrix."""
    from torch.nn.attention.flex_attention import BlockMask

    n, _, q_len, k_len = visible.shape
    counts = block_counts(visible)  # (N, QB, KB)
    qb, kb = counts.shape[1:]
    t, b, p = (x.reshape(-1) for x in (layout.tree, layout.branch, layout.position_ids))

    def padded(x, width, fill):  # (N, L) -> (N, width): FlexAttention may read indices up to its tiles' edges
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)

    # the tiles' padding: trees, branches and flat indices that match nothing (never visible)
    qw, kw = qb * BLOCK_SIZE, kb * BLOCK_SIZE
    tq, bq, iq, pq = (
        padded(t[queries], qw, -2),
        padded(b[queries], qw, -2),
        padded(queries, qw, -1),
        padded(p[queries], qw, 0),
    )
    tk, bk, ik, pk = padded(t[keys], kw, -3), padded(b[keys], kw, -3), padded(keys, kw, 1 << 62), padded(p[keys], kw, 0)

    def mask_mod(batch, head, q, k):
        ok = (tq[batch, q] == tk[batch, k]) & (ik[batch, k] <= iq[batch, q])
        ok = ok & ((bk[batch, k] == BRANCH_PROMPT) | (bk[batch, k] == bq[batch, q]))
        if window is not None:
            ok = ok & (pq[batch, q] - pk[batch, k] < window)
        if chunk is not None:
            ok = ok & (pq[batch, q] // chunk == pk[batch, k] // chunk)
        return ok

    selected = counts > 0  # (N, QB, KB): the blocks to run, first and in column order (a stable sort)
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)
    num_blocks = selected.sum(-1, dtype=torch.int32)[:, None]
    return BlockMask.from_kv_blocks(
        num_blocks, order.to(torch.int32)[:, None], BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=(q_len, k_len)
    )


def block_counts(visible: torch.Tensor) -> torch.Tensor:
    """(N, 1, Q, K) bool -> (N, QB, KB): the visible pairs in each BLOCK_SIZE x BLOCK_SIZE tile (edges zero-padded)."""
    n, _, q_len, k_len = visible.shape
    qb, kb = -(-q_len // BLOCK_SIZE), -(-k_len // BLOCK_SIZE)
    tiles = visible.new_zeros(n, qb * BLOCK_SIZE, kb * BLOCK_SIZE)
    tiles[:, :q_len, :k_len] = visible[:, 0]
    return tiles.view(n, qb, BLOCK_SIZE, kb, BLOCK_SIZE).sum((2, 4), dtype=torch.int32)


@dataclass
class AttentionPairs:
    """(query, key) pairs of a forward: `needed` (the mask's visible pairs), what the dense mask computes (every pair
    of every row) and what the block mask computes (its non-empty tiles, BLOCK_SIZE^2 pairs each)."""

    needed: int = 0
    dense: int = 0
    block_mask: int = 0

    def add(self, visible: torch.Tensor) -> AttentionPairs:
        self.needed += int(visible.sum())
        self.dense += visible.numel()
        self.block_mask += int((block_counts(visible) > 0).sum()) * BLOCK_SIZE * BLOCK_SIZE
        return self


def block_mask_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """FlexAttention under the `BlockMask` a packed forward brings (`block_mask`). query (N, H, Q, D), key/value
    (N, Hkv, K, D); returns (N, Q, H, D), as transformers' attention functions."""
    from torch.nn.attention.flex_attention import AuxRequest

    if dropout:
        raise ValueError("FlexAttention takes no attention dropout")
    sinks = kwargs.get("s_aux")  # gpt-oss: a logit per head that joins every softmax's sum and carries no value
    score_mod = None
    if softcap is not None:

        def score_mod(score, batch, head, q, k):
            return softcap * torch.tanh(score / softcap)

    out = _flex(query)(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        kernel_options=KERNEL_OPTIONS if query.device.type == "cuda" else None,  # (Triton's kernel; measured there)
        **({} if sinks is None else {"return_aux": AuxRequest(lse=True)}),
    )
    if sinks is not None:  # out's weights sum to 1 over the keys; with the sink they sum to sigmoid(lse - sink)
        out, aux = out
        out = (out * torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1))[..., None]).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _flex(query):
    """FlexAttention: compiled on accelerators (one fused kernel; shapes vary by batch, so dynamic), as it is on the
    CPU, and `_FusedFlexMemory` on fake tensors (`estimate-memory`'s simulation)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nn.attention.flex_attention import flex_attention

    if isinstance(query, FakeTensor):
        return _FusedFlexMemory.run
    if query.device.type == "cpu":
        return flex_attention
    return _compiled_flex()


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


class _FusedFlexMemory(torch.autograd.Function):
    """What the fused FlexAttention kernel allocates, for the memory simulation's fake tensors (torch runs no
    FlexAttention on fake CPU tensors that need gradients): the output and its float32 log-sum-exp, kept with the
    inputs for the backward (torch's FlexAttention autograd saves exactly these), and one gradient per input."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    @staticmethod
    def run(query, key, value, return_aux=None, **kwargs):
        out = _FusedFlexMemory.apply(query, key, value)
        if return_aux is None:
            return out
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=query.new_empty(query.shape[:-1], dtype=torch.float32))
