"""Attention over packed layouts: the tree mask, attention tree by tree, and which models can take them.

A packed row (`packing.py`) holds several trees `prompt, continuation 1, continuation 2, ...` back to back. A 4-D
attention mask lets each token see exactly what it would see in its own unpadded sequence:

    token q sees token k  <=>  same tree, k at or before q, and k is in the prompt or in q's continuation

and each layer type cuts that by its own reach (`layer_reaches`): a sliding-window layer sees the keys with
position(q) - position(k) < window, a chunked layer those in q's chunk of positions. A model that mixes layer types
(Gemma 2 and 3, gpt-oss, OLMo 3) gets one mask per type, which its backbone hands each layer by its type. A causal
model's log-prob of a token depends only on the tokens it sees and their positions, so the values equal the padded
computation (one sequence a row) up to float rounding; the tests hold them to 1e-5.

How that mask reaches the attention is the *kernel* (`attention_kernel`), one of `KERNELS`:

- "by-tree" (the default on the CPU): attention runs sequence by sequence (`tree_attention`), each run of one
  sequence's queries meeting only the keys it may see, so a row's width costs nothing and a sequence computes alike
  in every layout;
- "block-mask" (the default on accelerators): torch's FlexAttention under a `BlockMask` (`block_mask`), one fused
  kernel per layer that skips every (query block, key block) tile the mask leaves empty: a row's trees attend to
  themselves, not to the whole row;
- "dense": sdpa (or eager attention) under the whole (Q, K) mask, every query meeting every key of its row.

A kernel the model or device cannot take falls back to the next that it can, and says why once. `packing_unsupported`
names the models that take no packed layout at all (they run padded).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from kto_pipeline.models import backbone_of, decoder_body, sliding_window, text_config
from kto_pipeline.scoring import ATTENTION_KERNELS as KERNELS  # what `--attention-kernel` takes
from kto_pipeline.scoring.packing import BRANCH_PROMPT, AttentionCosts, Layout

logger = logging.getLogger(__name__)

BLOCK_SIZE = 128  # FlexAttention's tile: (query, key) blocks of 128 x 128 pairs
KEY_TILE = 16  # the keys its forward kernel sums at a time on a CUDA GPU; every segment starts at a multiple
# The forward's options there: its keys in tiles of KEY_TILE (the default's 64 or 128 would take 5x or 12x the
# alignment padding on HH-RLHF's lengths), and the same kernel for short queries (torch would run its split-key
# decoding kernel, which sums a row's keys in another order, below 128 queries).
KERNEL_OPTIONS = {"fwd_BLOCK_N": KEY_TILE, "FORCE_USE_FLEX_ATTENTION": True}
_KERNEL_ATTRIBUTE = "kto_attention_kernel"  # the kernel asked for, kept on the model (`request_attention_kernel`)
_STATIC_ATTRIBUTE = "kto_static_shapes"  # packed layouts padded to static shapes (`request_static_shapes`)


def request_static_shapes(model, static: bool) -> None:
    """Ask `model`'s packed layouts to take static shapes (`packing.static_width`, `static_rows`): its
    `attention_costs` say so to the packing."""
    setattr(_unwrapped(model), _STATIC_ATTRIBUTE, bool(static))


def request_attention_kernel(model, kernel: str, device) -> tuple[str, str | None]:
    """Ask `model`'s packed forwards to attend with `kernel` (one of `KERNELS`). Returns the kernel they will run on
    `device` and why it is not the one asked for (None when it is): the caller says it, the forwards then do not
    say it again. Forwards read the request back through `attention_kernel`."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    setattr(_unwrapped(model), _KERNEL_ATTRIBUTE, kernel)
    chosen, why = _choose(model, device)
    if why is not None:
        _TOLD.add(why)
    return chosen, why


def attention_kernel(model, device) -> str:
    """The kernel the packed forwards of `model` on `device` run: "by-tree", "block-mask" or "dense" (see the module
    docstring). "auto" (the default): by-tree on the CPU, block-mask elsewhere; a kernel the model or the device
    cannot take falls back (block-mask -> by-tree on the CPU, dense elsewhere; by-tree -> dense), with the reason
    logged once."""
    kernel, why = _choose(model, torch.device(device))
    if why is not None and why not in _TOLD:
        _TOLD.add(why)
        logger.warning("attention: %s", why)
    return kernel


_TOLD: set[str] = set()


def _choose(model, device) -> tuple[str, str | None]:
    device = torch.device(device)
    asked = getattr(_unwrapped(model), _KERNEL_ATTRIBUTE, "auto")
    kernel = asked if asked != "auto" else ("by-tree" if device.type == "cpu" else "block-mask")
    reasons = []
    if kernel == "block-mask" and (why := block_mask_unsupported(model, device)) is not None:
        reasons.append(f"no block mask ({why})")
        kernel = "by-tree" if device.type == "cpu" else "dense"
    if kernel == "by-tree" and (why := _by_tree_unsupported(model)) is not None:
        reasons.append(f"no attention by tree ({why})")
        kernel = "dense"
    return kernel, f"{'; '.join(reasons)}: the {kernel} kernel runs" if reasons else None


def _backbone(model):
    """`model`'s body before the head (`models.backbone_of`), or None where it exposes none."""
    try:
        return backbone_of(model)
    except ValueError:
        return None


def _unwrapped(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def attention_costs(model, device) -> AttentionCosts:
    """The `AttentionCosts` of a model's packed rows on `device`, for the kernel they run there."""
    config = text_config(model)
    pair, static = 1.0 / (6 * config.hidden_size), getattr(_unwrapped(model), _STATIC_ATTRIBUTE, False)
    kernel = attention_kernel(model, device)
    if kernel == "by-tree":
        return AttentionCosts(pair, pair * TREE_CALL_FLOPS / (4 * _attention_width(config)), static=static)
    if kernel == "block-mask":
        return AttentionCosts(pair, block=BLOCK_SIZE, static=static, align=KEY_TILE)
    return AttentionCosts(pair, static=static)


@dataclass(frozen=True)
class Reach:
    """Which keys of its own sequence a layer's query sees, beyond causality: the last `window` positions
    (sliding-window attention), or those of its `chunk` of positions (chunked attention, Llama 4); None: all."""

    window: int | None = None
    chunk: int | None = None

    def within(self, length: int) -> Reach:
        """This reach for sequences of at most `length` tokens: a window or chunk that long cuts nothing."""
        return Reach(*(None if x is None or x >= length else x for x in (self.window, self.chunk)))


def layer_reaches(model) -> dict[str, Reach]:
    """Each layer type of `model` (its config's `layer_types`, in order of first use) -> the `Reach` of those layers.
    A model without layer types has one, "full_attention", windowed where all its layers are (Mistral:
    `models.sliding_window`)."""
    config = text_config(model)
    types = getattr(config, "layer_types", None)
    if not types:
        return {"full_attention": Reach(window=sliding_window(model))}
    window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    reaches = {"sliding_attention": Reach(window=window), "chunked_attention": Reach(chunk=chunk)}
    return {kind: reaches.get(kind, Reach()) for kind in dict.fromkeys(types)}


def tree_mask(
    layout: Layout, queries: torch.Tensor, keys: torch.Tensor, window: int | None, chunk: int | None = None
) -> torch.Tensor:
    """(N, 1, Q, K) bool: may query token `queries[n, i]` attend to key token `keys[n, j]`, in a layer that sees
    the last `window` positions, or its `chunk` of positions (None: no limit)?

    Tokens are named by flat index (row * width + column): a forward may take a layout's rows as they are,
    or gather tokens of several rows into one (training's KL forward, which has no padding). Padding attends
    to earlier padding, so no row of the mask is empty."""
    t, b, p = (x.reshape(-1) for x in (layout.tree, layout.branch, layout.position_ids))
    tq, tk = t[queries][:, :, None], t[keys][:, None, :]
    bq, bk = b[queries][:, :, None], b[keys][:, None, :]
    visible = (tq == tk) & (keys[:, None, :] <= queries[:, :, None]) & ((bk == BRANCH_PROMPT) | (bk == bq))
    pq, pk = p[queries][:, :, None], p[keys][:, None, :]
    if window is not None:
        visible &= (pq - pk) < window
    if chunk is not None:
        visible &= (pq // chunk) == (pk // chunk)
    return visible[:, None]


# ------------------------------------------------------------------------------ attention sequence by sequence
#
# Under the dense mask every query of a row meets every key of the row, so a row of 8 trees of 120 tokens runs
# 8x the (query, key) pairs it needs. `tree_attention` (registered with transformers as TREE_ATTENTION) runs
# transformers' own sdpa attention once per run of one sequence's tokens instead: a tree's prompt alone (one causal
# call: sdpa's causal kernel, no mask), then each continuation meeting exactly the keys it may see (its prompt,
# then itself). Only the needed pairs run (the causal kernel skips the masked half), and a sequence's attention is
# the same computation however the trees are laid out, whichever continuation comes first: in the
# reference pass's rows, or in training's, where the KL completions run apart on the prompts' cached keys. The
# masked keys a dense call would also take change sdpa's result on the CPU under bf16 (about 4e-3 per value, up to
# 0.754 nats on a SmolLM2 completion's log-prob and 1.17 on a KL completion's: benchmarks/RESULTS-layouts.md), so
# this path is what makes a policy equal to its reference score exactly its cached values. Where it runs
# (`attention_kernel`: by-tree) it always runs, gradient checkpointing included (`checkpointing_kwargs`).

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


# One sdpa call costs about as much on the CPU as 10 MFLOP of attention, whatever its size (the measurement is in
# benchmarks/RESULTS.md, "The price of an attention call"). `pack_rows` weighs it when it lays trees out.
TREE_CALL_FLOPS = 10e6


def _attention_width(config) -> int:
    """heads * head_dim: a (query, key) pair costs 4x this in FLOPs (scores and weighted values)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


def tree_attention(module, query, key, value, attention_mask, tree_blocks=None, eager=False, **kwargs):
    """transformers' sdpa attention (`eager`: the model's own eager attention), tree by tree when the forward brings
    `tree_blocks` (a `RowBlocks` per row). query (N, H, Q, D), key/value (N, Hkv, K, D), attention_mask
    (N, 1, Q, K); returns (N, Q, H, D).

    Each row's trees' keys and values are gathered with one index and split (one gather to undo in the
    backward, not one per tree), and the outputs are concatenated in the queries' order."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attend = _eager_attention(module) if eager else sdpa_attention_forward
    if tree_blocks is None:
        return attend(module, query, key, value, attention_mask, **kwargs)
    if isinstance(tree_blocks, dict):  # layers of several types: this layer's runs
        tree_blocks = tree_blocks[_layer_type(module)]
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


def _eager_attention(module):
    """The eager attention function of the modeling file `module` (an attention layer) comes from, or None: what
    transformers runs for it under `attn_implementation="eager"` (with the family's soft-capping or sinks)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _layer_type(module) -> str:
    """The type (`layer_types`) of the layer whose attention `module` is."""
    return module.config.layer_types[module.layer_idx]


def _by_tree_unsupported(model) -> str | None:
    """Why `model` cannot attend sequence by sequence (`tree_attention`), or None: it takes sdpa models whose backbone
    passes extra keyword arguments (the runs) down to the attention. On the CPU attention's FLOPs are dear and a
    call is cheap, hence its default there; on a GPU a launch per tree and layer is not (never measured here).
    Under gradient checkpointing the backward recomputes each layer with the attention its forward used
    (`checkpointing_kwargs`)."""
    model = _unwrapped(model)
    impl = getattr(text_config(model), "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"{impl} attention, not sdpa or eager"
    layers = getattr(_backbone(model), "layers", None) or ()
    attention = getattr(layers[0], "self_attn", None) if len(layers) else None
    if impl == "eager" and (attention is None or _eager_attention(attention) is None):
        return f"{type(model).__name__}'s eager attention is not transformers' eager_attention_forward"
    if len(set(layer_reaches(model).values())) > 1:  # the runs of each layer's type: `tree_attention` reads its type
        body = _backbone(model)
        layers = getattr(body, "layers", None) or ()
        if not all(hasattr(getattr(layer, "self_attn", None), "layer_idx") for layer in layers) or not layers:
            return f"{type(model).__name__}'s attention does not say which type of layer it is in"
    return _no_keywords_to_attention(model)


def _no_keywords_to_attention(model) -> str | None:
    """Why `model`'s backbone cannot hand a kernel its inputs (the runs, the block mask), or None: it must pass extra
    keyword arguments down to the attention."""
    body = _backbone(model)
    if body is None or not _takes_any_keyword(type(body)):
        return f"{type(model).__name__}'s backbone passes no keyword arguments to its attention"
    return None


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
    recomputation in the backward attends as the forward did. The forward may run inside `attending_with`
    (sequence by sequence), which has exited by the time the backward recomputes the layer: without this, the
    recomputation would attend on the dense mask and save other tensors than the forward."""
    config = text_config(model)

    def context_fn():  # called in each checkpointed forward
        return nullcontext(), _attention_implementation(config, config._attn_implementation)

    return {"use_reentrant": False, "context_fn": context_fn}


def enable_checkpointing(model) -> None:
    """Gradient checkpointing for `model`'s layers, each recomputation attending as its forward did
    (`checkpointing_kwargs`). A compiled layer traces its attention into its graph (a graph per implementation,
    which its recomputation replays) and torch.compile refuses a `context_fn` that is not selective checkpointing's:
    while compiling, the layers checkpoint without it; eagerly (no compile, or a compiled layer's eager fallback)
    with it."""
    kwargs = checkpointing_kwargs(model)

    def checkpointed(function, *args, **more):
        if torch.compiler.is_compiling():
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **more)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs, **more)

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with_cache = checkpoints_take_caches()
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):  # what transformers set on each layer
            module._gradient_checkpointing_func = checkpointed
            module._can_checkpoint_with_cache = with_cache


def checkpoints_take_caches() -> bool:
    """Whether transformers lets a checkpointed layer take its key/value cache along (`_can_checkpoint_with_cache`,
    else it drops the cache). Training's caches may: each is filed by the first forward, read by the KL forward and
    closed before the backward (`runtime.compiled.close_keys_values`), so a layer recomputed there files nothing
    twice and reads nothing."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return False
    return hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")


@contextmanager
def attending_with(model, kernel: str):
    """Within the block, `model` attends with the implementation of `kernel` ("dense": its own); restored on exit."""
    config = text_config(model)
    tree = TREE_ATTENTION_EAGER if config._attn_implementation == "eager" else TREE_ATTENTION
    implementation = {"by-tree": tree, "block-mask": BLOCK_MASK_ATTENTION}.get(kernel)
    if implementation is None:
        yield
        return
    _register_attention()
    with _attention_implementation(config, implementation):
        yield


def attention_inputs(model, layout: Layout, queries: torch.Tensor, keys: torch.Tensor):
    """What a packed forward of the tokens `queries` (N, Q) attending to `keys` (N, K) hands its backbone for the
    kernel it runs (`attention_kernel`): (kernel, the attention mask, extra keyword arguments). A model of several
    layer types whose reaches differ on these sequences gets a mask (and runs) per type, as a dict by type, which its
    backbone hands each layer by its type (`packing_unsupported` checks that it does); a reach that cuts nothing here
    (a window longer than every sequence) shares the full mask."""
    kernel = attention_kernel(model, queries.device)
    longest = int(layout.position_ids.max()) + 1
    reaches = {kind: reach.within(longest) for kind, reach in layer_reaches(model).items()}
    dtype = _unwrapped(model).get_input_embeddings().weight.dtype
    masks, runs = {}, {}
    for reach in dict.fromkeys(reaches.values()):
        visible = tree_mask(layout, queries, keys, reach.window, reach.chunk)
        if kernel == "by-tree":  # each run takes its part of `visible`: the dense mask itself goes unread
            additive = dtype if text_config(model)._attn_implementation == "eager" else None
            masks[reach], runs[reach] = visible, tree_blocks(layout, queries, keys, visible, additive)
        elif kernel == "block-mask":
            masks[reach] = block_mask(layout, queries, keys, visible, reach.window, reach.chunk)
        else:
            masks[reach] = attention_mask_for(model, visible, dtype)
    if len(masks) == 1:
        mask, blocks = next(iter(masks.values())), next(iter(runs.values()), None)
    else:
        mask = {kind: masks[reach] for kind, reach in reaches.items()}
        blocks = {kind: runs[reach] for kind, reach in reaches.items()} if runs else None
    return kernel, mask, ({"tree_blocks": blocks} if kernel == "by-tree" else {})


# ------------------------------------------------------------------------------ FlexAttention under a block mask
#
# On an accelerator a launch per tree and layer is dear, and one dense masked kernel computes every (query, key)
# pair of a row: a row of 8 trees of ~500 tokens computes 8x the pairs it needs. FlexAttention takes the mask as
# tiles of BLOCK_SIZE x BLOCK_SIZE pairs: tiles the mask leaves empty are skipped, the others call `mask_mod`. The
# forward is torch.compile'd on accelerators (a fused Triton kernel); on the CPU FlexAttention runs its unfused
# reference implementation, forward only (torch has no FlexAttention backward on the CPU), which is what the tests
# compare with the other kernels.
#
# Step 1 exact: the fused forward sums each query's keys tile by tile (KEY_TILE keys at a time, in the order of
# their columns), and a sum's rounding follows where its terms fall in the tiles. On one H100 a sequence's log-prob
# moved by up to 0.09 nats when its tree moved 100 columns along its row, and not at all when it moved 128
# (benchmarks/RESULTS-gpu.md, "Step 1 by layout"). So every segment of a tree (prompt, each continuation) starts
# at a multiple of KEY_TILE in every layout (`AttentionCosts.align`): a sequence's keys then fall on the tiles alike
# in the reference pass's rows, training's and a pair's; a tile that holds none of a query's keys changes nothing
# (its masked scores add exact zeros). For the same reason no tile is taken as "full" (run without `mask_mod`):
# the kernel runs full tiles after the partial ones, and which tiles are full depends on the neighbours a layout
# gives a tree, which would reorder a query's sum.

BLOCK_MASK_ATTENTION = "kto_block_mask_flex"


def block_mask_unsupported(model, device) -> str | None:
    """Why `model` on `device` cannot attend with FlexAttention under a block mask, or None."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FlexAttention"
    model = _unwrapped(model)
    if not getattr(model, "_supports_flex_attn", False):
        return f"{type(model).__name__} does not take transformers' flex_attention"
    if (why := _no_keywords_to_attention(model)) is not None:
        return why
    if model.training and getattr(text_config(model), "attention_dropout", 0.0):
        return "FlexAttention takes no attention dropout"
    if torch.device(device).type == "cpu" and model.training:
        return f"torch {torch.__version__} has no FlexAttention backward on the CPU"
    return None


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


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, flex_attention_mask, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)  # masks built by transformers stay sdpa's
    AttentionInterface.register(TREE_ATTENTION_EAGER, functools.partial(tree_attention, eager=True))
    AttentionMaskInterface.register(TREE_ATTENTION_EAGER, eager_mask)
    AttentionInterface.register(BLOCK_MASK_ATTENTION, block_mask_attention)
    AttentionMaskInterface.register(BLOCK_MASK_ATTENTION, flex_attention_mask)


def packing_unsupported(model) -> str | None:
    """Why this model cannot run packed layouts (so the padded path runs instead), or None if it can.

    The 4-D mask is handed to the attention as is, which transformers' `sdpa` and `eager` attention
    take; flash-attention kernels take no arbitrary mask. Models that mix layer types (full, sliding-window,
    chunked) take a mask per type where their backbone hands each layer the mask of its type; models without
    position ids (ALiBi) would see wrong distances."""
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    config = text_config(model)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} takes no custom 4-D mask"
    layer_types = getattr(config, "layer_types", None)
    if (stateful := stateful_layers(model, layer_types)) is not None:
        return f"layers that carry state along the sequence ({stateful}): packed sequences would leak into each other"
    body = _backbone(model)
    if len(set(layer_reaches(model).values())) > 1 and (body is None or not _takes_masks_by_type(type(body))):
        types = ", ".join(sorted(set(layer_types)))
        return f"layers of several attention types ({types}), and the backbone takes one mask for all of them"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "rope") == "alibi":
        return "ALiBi attention biases ignore position ids"
    if body is None or "position_ids" not in inspect.signature(body.forward).parameters:
        return f"{type(model).__name__}'s backbone takes no position ids"
    if (layer := _scaled_by_column(body)) is not None:
        return (
            f"{layer} scales its queries by their column in the row (attn_temperature_tuning), "
            "which packing moves: packed sequences would be scaled otherwise"
        )
    return None


@functools.cache
def _takes_masks_by_type(backbone_class) -> bool:
    """Whether a backbone's forward takes its attention mask as a dict by layer type, handing each layer its own
    (transformers' models of several layer types: `if not isinstance(causal_mask_mapping := attention_mask, dict)`)."""
    try:
        source = inspect.getsource(backbone_class.forward)
    except (OSError, TypeError):
        return False
    return re.search(r"isinstance\((\w+\s*:=\s*)?attention_mask,\s*dict\)", source) is not None


def _scaled_by_column(body) -> str | None:
    """The first attention layer of `body` that scales its queries by the token's column in the row rather than its
    position (Llama 4's layers without rope, under `attn_temperature_tuning`), or None."""
    for module in body.modules():
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            return f"{type(module).__name__} {module.layer_idx}"
    return None


# what the reference pass records (`unshared_because`) where its packed layout failed the packing check (a sequence
# scored packed differed from it scored alone): training then pads its batches too (`packing_leaked`)
PACKING_LEAKED = "a packed layout changed sequences' log-probs"


def packing_leaked(manifest) -> str | None:
    """Why the cache's reference pass found that packing leaks between sequences, or None."""
    why = manifest.get("reference_pass", {}).get("unshared_because") or ""
    return why if why.startswith(PACKING_LEAKED) else None


ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# what a layer that carries state from token to token (an SSM, a convolution, linear attention) is named or holds
_STATEFUL_NAMES = ("Mamba", "Mixer", "DeltaNet", "ShortConv", "Recurrent", "Rwkv", "SSM", "LinearAttention")


def stateful_layers(model, layer_types=None) -> str | None:
    """What in `model`'s decoder layers carries state along the sequence, or None: layer types other than attention
    (`conv`, `linear_attention`, `hybrid`, `mamba`), and modules that hold a convolution over the sequence or are
    named for a state-space or recurrent mixer. Such a layer lets one sequence of a packed row reach the next."""
    found = sorted(set(layer_types or ()) - ATTENTION_LAYER_TYPES)
    try:
        layers = getattr(decoder_body(model), "layers", None) or [model]
    except ValueError:  # no backbone: the whole model
        layers = [model]
    classes = set()
    for layer in layers:
        for module in layer.modules():
            name = type(module).__name__
            if isinstance(module, torch.nn.Conv1d) or any(part in name for part in _STATEFUL_NAMES):
                classes.add(name)
    found += sorted(classes - {"Conv1d"}) or sorted(classes)
    return ", ".join(found) if found else None


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
