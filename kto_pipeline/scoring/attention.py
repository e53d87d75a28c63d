"""Attention over packed layouts: the tree mask of each layer type, and which kernel runs it.

A packed row (`packing.py`) holds several trees `prompt, continuation 1, continuation 2, ...` back to back. A 4-D
attention mask lets each token see exactly what it would see in its own unpadded sequence:

    token q sees token k  <=>  same tree, k at or before q, and k is in the prompt or in q's continuation

and each layer type cuts that by its own reach (`layer_reaches`): a sliding-window layer sees the keys with
position(q) - position(k) < window, a chunked layer those in q's chunk of positions. A model that mixes layer types
(Gemma 2 and 3, gpt-oss, OLMo 3) gets one mask per type, which its backbone hands each layer by its type. A causal
model's log-prob of a token depends only on the tokens it sees and their positions, so the values equal the padded
computation (one sequence a row) up to float rounding; the tests hold them to 1e-5.

How that mask reaches the attention is the *kernel* (`choose_kernel`), one of `KERNELS`:

- "by-tree" (the default on the CPU): attention runs sequence by sequence (`by_tree.py`), each run of one
  sequence's queries meeting only the keys it may see, so a row's width costs nothing and a sequence computes alike
  in every layout;
- "block-mask" (the default on accelerators): torch's FlexAttention under a `BlockMask` (`block_mask.py`), one fused
  kernel per layer that skips every (query block, key block) tile the mask leaves empty: a row's trees attend to
  themselves, not to the whole row;
- "dense": sdpa (or eager attention) under the whole (Q, K) mask, every query meeting every key of its row.

A kernel the model or device cannot take falls back to the next that it can, and says why once. `packable.py`
names the models that take no packed layout at all (they run padded).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from kto_pipeline.models import backbone_or_none, sliding_window, text_config
from kto_pipeline.scoring import ATTENTION_KERNELS as KERNELS  # what `--attention-kernel` takes
from kto_pipeline.scoring import block_mask as flex
from kto_pipeline.scoring import by_tree
from kto_pipeline.scoring.block_mask import BLOCK_MASK_ATTENTION, BLOCK_SIZE, KEY_TILE
from kto_pipeline.scoring.by_tree import TREE_ATTENTION, TREE_ATTENTION_EAGER
from kto_pipeline.scoring.head import CHUNK_LOGITS_BYTES
from kto_pipeline.scoring.packing import BRANCH_PAD, BRANCH_PROMPT, AttentionCosts, Layout


def choose_kernel(model, asked: str, device) -> tuple[str, str | None]:
    """The kernel `model`'s packed forwards on `device` run when `asked` (one of `KERNELS`) is asked for, and why it
    is not the one asked for (None when it is), for the caller to say once. "auto": by-tree on the CPU, block-mask
    elsewhere; a kernel the model (in its mode: training or not) or the device cannot take falls back (block-mask ->
    by-tree on the CPU, dense elsewhere; by-tree -> dense). The stages choose once, after loading (`plan.Plan`), and
    every forward runs the kernel chosen."""
    if asked not in KERNELS:
        raise ValueError(f"attention kernel {asked!r}: expected one of {', '.join(KERNELS)}")
    device = torch.device(device)
    kernel = asked if asked != "auto" else ("by-tree" if device.type == "cpu" else "block-mask")
    reasons = []
    if kernel == "block-mask" and (why := block_mask_unsupported(model, device)) is not None:
        reasons.append(f"no block mask ({why})")
        kernel = "by-tree" if device.type == "cpu" else "dense"
    if kernel == "by-tree" and (why := _by_tree_unsupported(model)) is not None:
        reasons.append(f"no attention by tree ({why})")
        kernel = "dense"
    return kernel, f"{'; '.join(reasons)}: the {kernel} kernel runs" if reasons else None


def _unwrapped(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def attention_costs(model, kernel: str, static: bool = False) -> AttentionCosts:
    """How `model`'s packed rows attend with `kernel` (`choose_kernel`) and what that costs them (`AttentionCosts`);
    `static`: its layouts padded to static shapes."""
    config = text_config(model)
    pair = 1.0 / (6 * config.hidden_size)
    if kernel == "by-tree":
        return AttentionCosts(
            pair, pair * TREE_CALL_FLOPS / (4 * _attention_width(config)), static=static, kernel=kernel
        )
    if kernel == "block-mask":
        return AttentionCosts(pair, block=BLOCK_SIZE, static=static, align=KEY_TILE, kernel=kernel)
    return AttentionCosts(pair, static=static, kernel=kernel)


# The reference pass's forwards are sized by tokens (`forward_tokens`). On an accelerator as many as
# FORWARD_MEMORY_SHARE of the memory free after loading holds, at most FORWARD_TOKENS_MAX (rounded down to a
# multiple of 1,024): each forward costs the device its launches whatever its tokens. On the CPU a forward costs
# nothing beyond its arithmetic, and small ones keep their activations in the allocator's reused blocks and the
# caches: SmolLM2-135M over 128 HH-RLHF rows (15,482 needed tokens, max_length 1024, 2 threads) took 46.8-46.9 s in
# forwards of 1,024 tokens, 49.4 s of 2,048, 51.2-52.9 s of 4,096 and 58.4-62.5 s in one of 16,384. Never below the
# longest sequence.
CPU_FORWARD_TOKENS = 1024
FORWARD_TOKENS_MAX = 65536
FORWARD_MEMORY_SHARE = 0.5


def forward_bytes_per_token(model, kernel: str) -> int:
    """An upper estimate of what one more token of a no-grad forward holds at its peak, in bytes: inside a layer the
    residual stream and the normed input (2 x hidden), then the larger of the attention's (queries, keys, values
    and output) and the MLP's (gate, up, and their product: 3 x intermediate, times the experts a token visits)
    tensors, in the weights' dtype, twice over for the allocator's transients; its ids, positions and layout
    indices (64 bytes); under the dense kernel its row of the mask (bool, and the additive copy sdpa may make in
    half precision), for rows up to MAX_ROW_TOKENS wide."""
    from kto_pipeline.scoring.packing import MAX_ROW_TOKENS

    config = text_config(model)
    hidden = config.hidden_size
    heads, kv_heads = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 4 * hidden)
    intermediate *= max(1, getattr(config, "num_experts_per_tok", 1) or 1)
    attention = 2 * heads * head_dim + 2 * kv_heads * head_dim
    element = next(_unwrapped(model).parameters()).element_size()
    per_token = 2 * (2 * hidden + max(attention, 3 * intermediate)) * element + 64
    return per_token + (3 * MAX_ROW_TOKENS if kernel == "dense" else 0)


def forward_tokens(model, device, kernel: str, longest: int) -> tuple[int, str]:
    """The token budget of one reference forward on `device`, and how it was chosen (for the log). On the CPU
    CPU_FORWARD_TOKENS; on a CUDA device FORWARD_MEMORY_SHARE of the memory free now, less the LM head's chunk of
    logits and its log-softmax (2 x CHUNK_LOGITS_BYTES, whatever the tokens), over `forward_bytes_per_token`, at
    most FORWARD_TOKENS_MAX; at least `longest` (a sequence always fits)."""
    device = torch.device(device)
    if device.type != "cuda":
        budget = max(CPU_FORWARD_TOKENS, longest)
        return budget, f"{device.type}: {CPU_FORWARD_TOKENS:,} tokens, or the longest sequence"
    free, _ = torch.cuda.mem_get_info(device)
    per_token = forward_bytes_per_token(model, kernel)
    fits = max(int(FORWARD_MEMORY_SHARE * free) - 2 * CHUNK_LOGITS_BYTES, 0) // per_token
    budget = max(min(fits, FORWARD_TOKENS_MAX) // 1024 * 1024, longest)
    why = f"{FORWARD_MEMORY_SHARE:.0%} of {free / 2**30:.1f} GiB free at ~{per_token / 1024:.1f} KiB a token"
    return budget, why


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
    to earlier padding, so no row of the mask is empty. Where `keys` is `queries`, each row's indices ascend (a
    row's columns in order, as every such caller passes them).

    A query sees the earlier keys of its own tree that are its prompt's or its own continuation's: whose (tree,
    branch) is its own or its prompt's."""
    t, b, p = (x.reshape(-1) for x in (layout.tree, layout.branch, layout.position_ids))
    span = int(layout.branches) + 2  # branch + 1: padding (-1) 0, the prompt (0) 1, continuations 2..branches + 1
    code = t * span + (b + 1)  # (tree, branch) as one integer
    prompt = t * span + (BRANCH_PROMPT + 1)  # the code of each token's tree's prompt
    if keys is queries:  # a forward's own tokens (the reference pass, training's first forward)
        visible = _seen_from_rows(code[queries], prompt[queries])
    else:  # other keys (a KL forward's, cached ones first): pair by pair
        ck = code[keys][:, None, :]
        visible = (ck == code[queries][:, :, None]) | (ck == prompt[queries][:, :, None])
        visible &= keys[:, None, :] <= queries[:, :, None]
    pq, pk = p[queries][:, :, None], p[keys][:, None, :]
    if window is not None:
        visible &= (pq - pk) < window
    if chunk is not None:
        visible &= (pq // chunk) == (pk // chunk)
    return visible[:, None]


def _seen_from_rows(codes: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
    """(N, Q, Q) bool, for tokens that are both the queries and the keys, each row in order: token i sees token j
    where j <= i and j's code is i's or i's prompt's (`codes`, `prompts`: (N, Q)).

    Made of rows copied out of a table as large as the mask, rather than compared pair by pair (a comparison into a
    bool tensor runs element by element on the CPU, a copy of rows does not; 11.3 -> 2.4-3.2 ms for a 16,384-token
    forward): table[n, c] holds the keys of row n whose code comes c-th in its sorted codes (at its first place),
    table[n, Q] none (a prompt with no token in the row: padding's); a lower triangle then keeps the earlier keys."""
    n, q = codes.shape
    sorted_codes = codes.sort(dim=1).values
    table = torch.zeros(n, q + 1, q, dtype=torch.bool, device=codes.device)
    table.scatter_(1, torch.searchsorted(sorted_codes, codes)[:, None, :], True)
    rows, base = table.reshape(n * (q + 1), q), torch.arange(n, device=codes.device)[:, None] * (q + 1)

    def holding(wanted: torch.Tensor) -> torch.Tensor:  # (N, Q, Q): the keys of each query's `wanted` code
        at = torch.searchsorted(sorted_codes, wanted)
        found = sorted_codes.gather(1, at.clamp(max=q - 1)) == wanted
        return rows.index_select(0, (base + torch.where(found, at, q)).reshape(-1)).reshape(n, q, q)

    visible = holding(codes)
    visible |= holding(prompts)
    return visible.__iand__(torch.ones(q, q, dtype=torch.bool, device=codes.device).tril())


# One sdpa call costs about as much on the CPU as 10 MFLOP of attention, whatever its size (the measurement is in
# benchmarks/RESULTS.md, "The price of an attention call"). `pack_rows` weighs it when it lays trees out.
TREE_CALL_FLOPS = 10e6


def _attention_width(config) -> int:
    """heads * head_dim: a (query, key) pair costs 4x this in FLOPs (scores and weighted values)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


def _by_tree_unsupported(model) -> str | None:
    """Why `model` cannot attend sequence by sequence (`tree_attention`), or None: it takes sdpa or eager models whose
    backbone passes extra keyword arguments (the runs) down to the attention. On the CPU attention's FLOPs are dear
    and a call is cheap, hence its default there; on a GPU a launch per tree and layer is not (never measured here).
    Under gradient checkpointing the backward recomputes each layer with the attention its forward used
    (`checkpointing_kwargs`)."""
    model = _unwrapped(model)
    impl = getattr(text_config(model), "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"{impl} attention, not sdpa or eager"
    attentions = [getattr(layer, "self_attn", None) for layer in getattr(backbone_or_none(model), "layers", None) or ()]
    if impl == "eager" and (not attentions or by_tree.eager_attention(attentions[0]) is None):
        return f"{type(model).__name__}'s eager attention is not transformers' eager_attention_forward"
    several_types = len(set(layer_reaches(model).values())) > 1  # `tree_attention` reads each layer's type
    if several_types and not (attentions and all(hasattr(a, "layer_idx") for a in attentions)):
        return f"{type(model).__name__}'s attention does not say which type of layer it is in"
    return _no_keywords_to_attention(model)


def _no_keywords_to_attention(model) -> str | None:
    """Why `model`'s backbone cannot hand a kernel its inputs (the runs, the block mask), or None: it must pass extra
    keyword arguments down to the attention."""
    body = backbone_or_none(model)
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
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):  # what transformers set on each layer
            module._gradient_checkpointing_func = checkpointed
            # the layer takes its key/value cache along into its checkpoint (transformers drops it otherwise).
            # Training's caches may: each is filed by the first forward, read by the KL forward and closed before
            # the backward (`keys_values.close_keys_values`), so a layer recomputed there files nothing twice
            module._can_checkpoint_with_cache = True


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


def attention_inputs(model, layout: Layout, queries: torch.Tensor, keys: torch.Tensor, kernel: str):
    """What a packed forward of the tokens `queries` (N, Q) attending to `keys` (N, K) hands its backbone for the
    `kernel` it runs: (the attention mask, extra keyword arguments). A model of several
    layer types whose reaches differ on these sequences gets a mask (and runs) per type, as a dict by type, which its
    backbone hands each layer by its type (`packing_unsupported` checks that it does); a reach that cuts nothing here
    (a window as long as the rows) shares the full mask."""
    longest = layout.input_ids.shape[1]  # no sequence is longer than its row (a shape: nothing read back)
    reaches = {kind: reach.within(longest) for kind, reach in layer_reaches(model).items()}
    dtype = _unwrapped(model).get_input_embeddings().weight.dtype
    additive = dtype if text_config(model)._attn_implementation == "eager" else None  # (eager attention adds masks)
    masks, runs = {}, {}
    for reach in dict.fromkeys(reaches.values()):
        visible = tree_mask(layout, queries, keys, reach.window, reach.chunk)
        if kernel == "by-tree":  # each run takes its part of `visible`: the dense mask itself goes unread
            masks[reach], runs[reach] = visible, by_tree.tree_blocks(layout, queries, keys, visible, additive)
        elif kernel == "block-mask":
            masks[reach] = flex.block_mask(layout, queries, keys, visible, reach.window, reach.chunk)
        else:
            masks[reach] = attention_mask_for(model, visible, dtype)
    if len(masks) == 1:
        mask, blocks = next(iter(masks.values())), next(iter(runs.values()), None)
    else:
        mask = {kind: masks[reach] for kind, reach in reaches.items()}
        blocks = {kind: runs[reach] for kind, reach in reaches.items()} if runs else None
    return mask, ({"tree_blocks": blocks} if kernel == "by-tree" else {})


def padded_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, kernel: str | None) -> dict:
    """The extra keyword arguments of a padded forward (right-padded rows, a sequence each) for `kernel`: by tree,
    each row's runs (`by_tree.tree_blocks`), so that a sequence attends over its own tokens alone, as it does packed.
    Under any other kernel, none: the model's own attention over the row's width, whose result can depend on the
    width (on an Intel Xeon with AMX: a sequence's log-probs 9.5e-7 apart in float32, docs/models.md); both stages
    pad a sequence to other widths, so a policy equal to its reference would not score exactly its cached values."""
    if kernel != "by-tree":
        return {}
    real = attention_mask.bool()
    rows, width = real.shape
    grid = torch.arange(rows * width, device=real.device).reshape(rows, width)
    layout = Layout(
        input_ids=input_ids,
        position_ids=(real.cumsum(1) - 1).clamp_(min=0),
        tree=torch.where(real, grid // width, -1),
        branch=torch.where(real, BRANCH_PROMPT, BRANCH_PAD),
        target=grid.new_zeros(0),
        predictor=grid.new_zeros(0),
        sequence=grid.new_zeros(0),
        num_trees=rows,
        branches=1,
        split=width,
    )
    return attention_inputs(model, layout, grid, grid, kernel)[1]


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


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, flex_attention_mask, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, by_tree.tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)  # masks built by transformers stay sdpa's
    AttentionInterface.register(TREE_ATTENTION_EAGER, functools.partial(by_tree.tree_attention, eager=True))
    AttentionMaskInterface.register(TREE_ATTENTION_EAGER, eager_mask)
    AttentionInterface.register(BLOCK_MASK_ATTENTION, flex.block_mask_attention)
    AttentionMaskInterface.register(BLOCK_MASK_ATTENTION, flex_attention_mask)


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
    values = [torch.full((), x, dtype=dtype, device=visible.device) for x in (0.0, fill)]
    return torch.where(visible, *values)  # (one pass over the mask: no zeros filled first, no negated copy)
