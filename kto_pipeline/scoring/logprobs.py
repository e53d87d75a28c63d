"""Per-token log-probs of completion tokens, without ever building `(batch, seq, vocab)` logits.

Both stages score sequences with the functions in this module: the reference pass (stage 1, under
`inference_mode`) and the policy (stage 2, with gradients). Using one function is what makes the
invariant "policy == reference  =>  rewards == 0" hold exactly.

The LM head's part, chunked so that no `(batch, seq, vocab)` logits are ever built, is `head.py`.

Three ways to run the backbone: `score_sequences` (one padded sequence per row: the fallback, and the
tests' reference), `score_layout` (packed trees, each prompt once: the reference pass) and
`score_policy` (packed trees in two forwards, completions with grad, then KL completions on the
prompts' cached keys/values: training). Layouts and masks are built in `packing.py`.
"""

from __future__ import annotations

import functools
from contextlib import closing
from typing import NamedTuple

import numpy as np
import torch

from kto_pipeline.models import backbone_of, checkpointing, keeps_keys_values, scorable
from kto_pipeline.runtime.prefetch import ahead
from kto_pipeline.scoring.attention import attending_with, attention_inputs, padded_inputs
from kto_pipeline.scoring.head import DEFAULT_CHUNK_SIZE, head_logps
from kto_pipeline.scoring.image_features import join_images, token_inputs
from kto_pipeline.scoring.keys_values import close_keys_values, keys_values_cache
from kto_pipeline.scoring.packing import (
    AttentionCosts,
    Layout,
    ScoredSequence,
    Tree,
    last_continuations,
    layout_trees,
    pack_batches,
    pack_trees,
    to_device,
    tree_tokens,
)


class Scores(NamedTuple):
    """Scores of a batch of sequences, token by token: one entry per scored (completion) token, ordered by
    sequence, then position.

    A named tuple (as `PolicyScores`), because they are the scoring modules' outputs: the hooks of a sharding
    engine find the tensors of an output in tuples and dicts (DeepSpeed ZeRO-3 attaches its backward hooks to
    them; a dataclass hides them, and it warns that its hooks may not be triggered)."""

    logps: torch.Tensor  # (S,) sum over each sequence's completion tokens: the sequence log-prob KTO uses
    token_logps: torch.Tensor  # (N,) log-prob of each completion token
    sequence: torch.Tensor  # (N,) which sequence each token belongs to
    mean_logits: torch.Tensor  # (N,) no grad; zeros with with_stats=False
    entropy: torch.Tensor  # (N,) no grad; zeros with with_stats=False
    aux_loss: torch.Tensor | None = None  # MoE load-balancing loss, when router logits were requested

    def per_sequence(self) -> list[torch.Tensor]:
        """token_logps split by sequence (sequences with no scored token get an empty tensor)."""
        counts = torch.bincount(self.sequence, minlength=self.logps.shape[0]).tolist()
        return list(torch.split(self.token_logps, counts))


def pad_sequences(
    seqs: list[list[int]], prompt_lens: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, completion_mask), each (B, T): what `score_sequences` takes.
    Both stages batch with it, so the reference and the policy see identical inputs."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    comp = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        comp[i, p : len(s)] = 1
    return ids, attn, comp


def _load_balancing_loss(model, router_logits, attention_mask):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    return load_balancing_loss_func(router_logits, num_experts, config.num_experts_per_tok, attention_mask)


def score_sequences(
    model,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor,  # (B, T)
    completion_mask: torch.Tensor,  # (B, T), 1 on completion tokens
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    with_stats: bool = True,
    output_router_logits: bool = False,
    images: dict[str, torch.Tensor] | None = None,
    kernel: str | None = None,
) -> Scores:
    """Score the completion tokens of a padded batch, one sequence per row: the padded path, for models
    that cannot run packed layouts (see `packable.packing_unsupported`) and as the tests' reference.

    `with_stats=False` skips the metric-only mean logits and entropy (left as zeros).
    `output_router_logits=True` (mixture-of-experts models) also returns the load-balancing loss.
    `images` (a vision-language model): the rows' image tensors, in row order.
    `kernel` (the run's plan): "by-tree" attends each row over its own tokens alone, so that a sequence computes
    alike whatever it is padded to (`attention.padded_inputs`); any other (or None): the model's own attention."""
    model = scorable(model)
    extra = {"output_router_logits": True} if output_router_logits else {}
    extra |= padded_inputs(model, input_ids, attention_mask, kernel)
    tokens = token_inputs(model, input_ids, images)
    with attending_with(model, "by-tree" if "tree_blocks" in extra else "dense"):  # (else: the model's own)
        outputs = backbone_of(model)(**tokens, attention_mask=attention_mask, use_cache=False, **extra)
    hidden = outputs.last_hidden_state[:, :-1]  # (B, T-1, H): position t predicts token t+1
    mask = completion_mask[:, 1:].bool()
    logps, mean_logits, entropy = head_logps(model, hidden[mask], input_ids[:, 1:][mask], chunk_size, with_stats)
    sequence = mask.nonzero()[:, 0]  # row-major: by sequence, then position
    aux_loss = _load_balancing_loss(model, outputs.router_logits, attention_mask) if output_router_logits else None
    return _scores(logps, sequence, input_ids.shape[0], mean_logits, entropy, aux_loss)


def sequence_sums(values: torch.Tensor, sequence: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """The sums of token values (N,) by their sequence (N,), (num_sequences,) in the values' dtype: accumulated in
    float64 and rounded once, as `cache.token_sum` sums the cached reference values. A sequence's sum then does not
    depend on the order of the additions (a GPU's index_add adds in any order; float32 sums in another order than
    the reference's differ in their last bits), so a policy equal to the reference gives rewards of exactly 0. Kept
    connected to the graph where no token is scored."""
    wide = torch.float32 if values.device.type == "mps" else torch.float64  # (Apple's GPUs have no float64)
    return values.new_zeros(num_sequences, dtype=wide).index_add(0, sequence, values.to(wide)).to(values.dtype)


def _scores(logps, sequence, num_sequences, mean_logits, entropy, aux_loss=None) -> Scores:
    totals = sequence_sums(logps, sequence, num_sequences)
    return Scores(totals, logps, sequence, mean_logits, entropy, aux_loss)


def _forward(model, layout: Layout, kernel: str, queries: torch.Tensor, keys=None, cache=None, images=None, **extra):
    """The backbone's outputs for the tokens `queries` (N, Q), flat indices into the layout, which attend (tree
    mask, run by `kernel`) to the tokens `keys` (N, K): themselves (default), or, with a `cache`, the cached tokens
    then themselves. `images`: those of the prompts among the queries, in their order (`token_inputs`)."""
    keys = queries if keys is None else keys
    mask, more = attention_inputs(model, layout, queries, keys, kernel)
    backbone = backbone_of(model)
    # a given cache is used whatever `use_cache` says; transformers warns of `use_cache` under checkpointing
    use_cache = cache is not None and not (checkpointing(model) and torch.is_grad_enabled())
    with attending_with(model, kernel):
        return backbone(
            **token_inputs(model, layout.input_ids.reshape(-1)[queries], images),
            position_ids=layout.position_ids.reshape(-1)[queries],
            attention_mask=mask,
            **{_cache_keyword(type(backbone)): cache},
            use_cache=use_cache,
            **extra,
            **more,
        )


@functools.cache
def _cache_keyword(backbone_class) -> str:
    """The name a backbone's forward takes its key/value cache by: `cache` (transformers >= 5.24, where
    `past_key_values` is deprecated and warns), else `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(backbone_class.forward).parameters else "past_key_values"


def _score_branch(model, layout: Layout, hidden, where, branch: int, chunk_size: int | None, with_stats: bool, **extra):
    """Scores of continuation `branch` (1-based) of every tree, from the hidden states `hidden[where[flat index]]`;
    sequences are numbered by tree."""
    sel = ((layout.sequence % layout.branches) == branch - 1).nonzero()[:, 0]
    targets = layout.input_ids.reshape(-1)[layout.target[sel]]
    logps, mean_logits, entropy = head_logps(
        model, hidden[where[layout.predictor[sel]]], targets, chunk_size, with_stats
    )
    return _scores(logps, layout.sequence[sel] // layout.branches, layout.num_trees, mean_logits, entropy, **extra)


def score_layout(
    model,
    layout: Layout,
    attention: AttentionCosts,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    with_stats: bool = True,
    output_router_logits: bool = False,
    images: dict[str, torch.Tensor] | None = None,
) -> Scores:
    """Score every continuation of a packed layout in one forward over its rows: each prompt runs once.
    The reference pass scores `(prompt, [completion, KL completion])` trees with it, without gradients; a pair
    loss trains on `(prompt, [chosen, rejected])` trees with it, with gradients.
    Sequences are numbered tree * branches + continuation. `attention`: how the rows attend (the run's kernel, for
    which the layout was made). `images`: the prompts' images, `Layout.prompt_order`."""
    model = scorable(model)
    rows, width = layout.input_ids.shape
    tokens = torch.arange(rows * width, device=layout.input_ids.device).reshape(rows, width)
    extra = {"output_router_logits": True} if output_router_logits else {}
    outputs = _forward(model, layout, attention.kernel, tokens, images=images, **extra)
    hidden = outputs.last_hidden_state.reshape(rows * width, -1)
    targets = layout.input_ids.reshape(-1)[layout.target]
    logps, mean_logits, entropy = head_logps(model, hidden[layout.predictor], targets, chunk_size, with_stats)
    aux_loss = None
    if output_router_logits:  # padding excluded, as in the padded path
        aux_loss = _load_balancing_loss(model, outputs.router_logits, (layout.branch >= 0).long())
    return _scores(logps, layout.sequence, layout.num_trees * layout.branches, mean_logits, entropy, aux_loss)


class PolicyScores(NamedTuple):
    """What the policy's forward returns (`score_policy`, `PolicyScorer`): a named tuple, as `Scores`."""

    completions: Scores  # with gradients
    kl: Scores | None  # without gradients; None when not asked for
    tokens_executed: int  # tokens the forwards ran
    kl_on_cached_prompt: bool  # whether the KL forward ran on the prompts' cached keys/values


def score_policy(
    model,
    layout: Layout,
    attention: AttentionCosts,
    with_kl: bool = True,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    with_stats: bool = True,
    output_router_logits: bool = False,
    gather_kl: bool | None = None,
    images: dict[str, torch.Tensor] | None = None,
) -> PolicyScores:
    """Training's forwards over a `layout_trees(split_last=True)` layout of `(prompt, [completion, KL])` trees.

    1. the rows' prompts and completions (columns before `layout.split`), with gradients; their keys/values
       are kept;
    2. (`with_kl`) the KL completions alone, without gradients, attending to the cached keys/values of their
       prompts (detached; `keys_values_cache`): K tokens instead of P + K. They run either in their rows (columns from
       `layout.split`, padded to the row with the most) or gathered from every row into one unpadded row
       that attends to all rows' caches laid end to end; `gather_kl` forces one way, by default whichever
       costs less. The cache is closed then (`close_keys_values`): under gradient checkpointing the layers take it
       along, and the backward's recomputation hands it the same keys/values again. A model that keeps no
       keys/values while training (`keeps_keys_values`: compiled layers under static shapes; checkpointed layers
       whose keys/values are large, or where transformers drops their cache) runs the whole layout again without
       gradients instead.

    `attention`: how the rows attend (the run's kernel, for which the layout was made). `images`: the prompts'
    images in the layout's order (`Layout.prompt_order`); the KL forward needs none."""
    model = scorable(model)
    assert layout.branches == 2, "(prompt, [completion, KL completion]) trees"
    rows, width, split, device = *layout.input_ids.shape, layout.split, layout.input_ids.device
    grid = torch.arange(rows * width, device=device).reshape(rows, width)
    main = grid[:, :split]  # (R, S) flat indices
    cache = keys_values_cache(model) if with_kl and keeps_keys_values(model) else None
    extra = {"output_router_logits": True} if output_router_logits else {}
    kernel = attention.kernel
    outputs = _forward(model, layout, kernel, main, cache=cache, images=images, **extra)
    aux_loss = None
    if output_router_logits:  # padding excluded, as in the padded path
        aux_loss = _load_balancing_loss(model, outputs.router_logits, (layout.branch[:, :split] >= 0).long())
    main_hidden = outputs.last_hidden_state.reshape(rows * split, -1)
    kl_tokens = last_continuations(layout)  # row by row, in order (with the padding that aligns them)
    # flat index -> row of cat(main hidden states, KL hidden states)
    where = torch.full((rows * width,), -1, dtype=torch.long, device=device)
    where[main.reshape(-1)] = torch.arange(rows * split, device=device)
    where[kl_tokens] = rows * split + torch.arange(len(kl_tokens), device=device)
    completions = _score_branch(model, layout, main_hidden, where, 1, chunk_size, with_stats, aux_loss=aux_loss)
    executed = rows * split
    if not with_kl:
        return PolicyScores(completions, None, executed, False)
    on_cache = cache is not None and cache.get_seq_length() == split
    with torch.no_grad():
        # The KL completions run either as they lie, each row's after its own prompts (padded to the row with the
        # most), or gathered from all rows into one unpadded row that attends to all rows' cached tokens (the
        # mask is dense): whichever costs less (see packing.pack_rows).
        n_kl = len(kl_tokens)
        gathered = kl_gathered(layout, n_kl, attention.pair) if gather_kl is None else gather_kl
        if on_cache and gathered:
            for layer in cache.layers:  # (R, heads, S, d) -> (1, heads, R * S, d), detached: read, never trained
                layer.keys, layer.values = (
                    x.detach().transpose(0, 1).reshape(x.shape[1], rows * split, x.shape[3])[None]
                    for x in (layer.keys, layer.values)
                )
            keys = torch.cat([main.reshape(-1), kl_tokens])[None]
            kl_hidden = _forward(model, layout, kernel, kl_tokens[None], keys, cache=cache).last_hidden_state[0]
            hidden = torch.cat([main_hidden.detach(), kl_hidden])
            executed += n_kl
        elif on_cache:
            for layer in cache.layers:  # detached: read, never trained
                layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
            kl_hidden = _forward(model, layout, kernel, grid[:, split:], grid, cache=cache).last_hidden_state
            # both parts of each row side by side again: hidden states in the layout's own (flat) order
            hidden = torch.cat([main_hidden.detach().reshape(rows, split, -1), kl_hidden], dim=1).flatten(0, 1)
            where = grid.reshape(-1)
            executed += rows * (width - split)
        else:
            hidden = _forward(model, layout, kernel, grid, images=images).last_hidden_state.reshape(rows * width, -1)
            where = grid.reshape(-1)
            executed += rows * width
        kl = _score_branch(model, layout, hidden, where, 2, chunk_size, with_stats=False)
    if cache is not None:
        close_keys_values(cache)  # (a layer recomputed in the backward files nothing in it)
    return PolicyScores(completions, kl, executed, on_cache)


def kl_gathered(layout: Layout, n_kl: int, pair_cost: float) -> bool:
    """Whether training's KL forward on the cached prompts (`n_kl` tokens) runs gathered into one unpadded row (else
    in its rows, padded to the row with the most): whichever costs less, `pair_cost` a (query, key) pair of the
    dense mask."""
    rows, width, split = *layout.input_ids.shape, layout.split
    return n_kl * (1 + pair_cost * (rows * split + n_kl)) < rows * (width - split) * (1 + pair_cost * width)


def policy_attention(layout: Layout, pair_cost: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(queries, keys) of each forward `score_policy` runs over a layout when it keeps the prompts' keys/values: the
    prompts and completions, then the KL completions on the cached prompts (gathered or in rows, `kl_gathered`).
    For counting attention pairs (`attention.AttentionPairs`)."""
    rows, width, split = *layout.input_ids.shape, layout.split
    grid = torch.arange(rows * width).reshape(rows, width)
    main, kl_tokens = grid[:, :split], last_continuations(layout)
    if kl_gathered(layout, len(kl_tokens), pair_cost):
        return [(main, main), (kl_tokens[None], torch.cat([main.reshape(-1), kl_tokens])[None])]
    return [(main, main), (grid[:, split:], grid)]


class ReferenceScorer(torch.nn.Module):
    """The reference pass's scoring as a module forward: under FSDP2 this is the root, whose forward gathers the
    parameters outside the decoder layers (embeddings, final norm, LM head) that the scoring reads directly."""

    def __init__(self, model, attention: AttentionCosts):
        super().__init__()
        self.model = model
        self.attention = attention  # how packed rows attend (the run's plan)

    def forward(self, layout: Layout | None = None, padded: tuple | None = None, images=None) -> Scores:
        """The scores of a packed `layout`, or of a `padded` (input_ids, attention_mask, completion_mask) batch (with
        its prompts' `images`, in order)."""
        if layout is not None:
            return score_layout(self.model, layout, self.attention, with_stats=False, images=images)
        return score_sequences(self.model, *padded, with_stats=False, images=images, kernel=self.attention.kernel)


@torch.inference_mode()
def score_shard(
    scorer,
    trees: list[Tree],
    pad_id: int,
    batch_size: int | None,
    max_tokens: int,
    device,
    on_batch=None,
    packed=True,
    agree_on_forwards=None,
    images=None,
    image_filler=None,
) -> list[tuple[np.ndarray, ...]]:
    """Per-token reference log-probs of each tree's continuations (a row's completion and KL completion, or a
    pair's chosen and rejected answers; every tree has as many). `scorer`: a `ReferenceScorer` (sharded or not), whose
    attention the packed layouts are made for.

    `packed=True`: each prompt runs once, its completion and KL completion both attending to it
    (`packing.layout_trees`), several trees side by side in each tensor row. `packed=False`: every sequence
    on its own, padded (the path for models that cannot take a packed layout).

    `on_batch(sequences, tokens, executed)`, if given, is called after each forward pass with the number of
    sequences, the tokens they need, and the tokens the pass ran (padding included): progress and counters.

    `agree_on_forwards(count) -> total` (a sharded reference): every process runs `total` forwards, the last
    ones on a one-token filler tree whose scores are dropped, so that none waits for the others forever.

    `images(tree) -> {name: tensor}` (a VLM): a tree's image tensors (the vision tower runs once per image a
    forward: per tree packed, per sequence padded). `image_filler`: (prompt ids, image tensors) of a one-image
    prompt for the filler forwards, so that every process runs the (sharded) vision tower in every forward."""
    branches = len(trees[0][1]) if trees else 2
    out: list[list[np.ndarray]] = [[np.empty(0, np.float32)] * branches for _ in trees]
    if packed:
        costs = getattr(scorer, "module", scorer).attention  # (DeepSpeed's engine keeps the scorer in .module)
        sizes = [tree_tokens([len(p), *map(len, conts)], costs) for p, conts in trees]
        passes = pack_trees(sizes, batch_size, max_tokens, costs)
    else:
        seqs = [
            ScoredSequence(t, kind, len(prompt), prompt + continuation)
            for t, (prompt, continuations) in enumerate(trees)
            for kind, continuation in enumerate(continuations)
        ]
        passes = pack_batches(seqs, batch_size, max_tokens)
    total = len(passes) if agree_on_forwards is None else agree_on_forwards(len(passes))

    def inputs():  # the host's part of each forward, run ahead of the device (`prefetch.ahead`)
        for batch in passes:
            if packed:
                members = [t for row in batch for t in row]
                local = {t: i for i, t in enumerate(members)}
                rows = [[local[t] for t in row] for row in batch]
                layout = layout_trees([trees[t] for t in members], rows, pad_id, static=costs.static, align=costs.align)
                pixels = None if images is None else join_images([images(t) for t in members], device)
                counts = torch.bincount(layout.sequence, minlength=branches * len(members)).tolist()  # (on the host)
                sequences = [(t, k) for t in members for k in range(branches)]
                counted = (branches * len(members), layout.tokens(), layout.input_ids.numel())
                yield {"layout": layout.to(device), "images": pixels}, counts, sequences, counted
            else:
                ids, attn, comp = pad_sequences([s.ids for s in batch], [s.prompt_len for s in batch], pad_id)
                pixels = None if images is None else join_images([images(s.row) for s in batch], device)
                counts = comp[:, 1:].sum(1).tolist()  # the scored tokens of each row, as `score_sequences` takes them
                sequences = [(s.row, s.kind) for s in batch]
                counted = (len(batch), sum(len(s.ids) for s in batch), ids.numel())
                yield (
                    {"padded": tuple(to_device(t, device) for t in (ids, attn, comp)), "images": pixels},
                    counts,
                    sequences,
                    counted,
                )

    pending = None  # the last forward's log-probs on their way to the host, and (tree, continuation) of each sequence
    with closing(ahead(inputs())) as forwards:  # (closed however the loop ends: its thread stops then)
        for forward, counts, sequences, counted in forwards:
            scores = scorer(**forward)
            # this forward's values start for the host behind it; the last forward's are read meanwhile: on an
            # accelerator the host builds and queues the next forward while the device runs this one
            ready, pending = pending, (HostCopy(scores.token_logps, counts), sequences)
            _file(out, ready)
            if on_batch is not None:
                on_batch(*counted)
    _file(out, pending)
    for _ in range(total - len(passes)):
        prompt, image = image_filler or ([pad_id], {})  # a one-token prompt (or a one-image one) and one-token answers
        filler, pixels = (prompt, [[pad_id]] * branches), join_images([image], device)
        if packed:
            scorer(layout=layout_trees([filler], [[0]], pad_id, static=costs.static).to(device), images=pixels)
        else:
            sequence = pad_sequences([filler[0] + filler[1][0]], [len(filler[0])], pad_id)
            scorer(padded=tuple(t.to(device) for t in sequence), images=pixels)
    return [tuple(o) for o in out]


class HostCopy:
    """A forward's token log-probs copied to the host in one copy, queued behind the forward (into pinned memory on
    a GPU, so that queueing it does not wait for the device), and split by sequence (`counts`: each sequence's
    tokens, known on the host) when read."""

    def __init__(self, token_logps: torch.Tensor, counts: list[int]):
        values = token_logps.detach().float()
        self.counts, self.done = counts, None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(values.device))  # (the stream the copy was queued on)
        else:
            self.host = values.cpu()

    def read(self) -> list[np.ndarray]:
        """Each sequence's values (waits for the copy, on a GPU)."""
        if self.done is not None:
            self.done.synchronize()
        values = self.host.numpy().copy()  # (out of the pinned buffer, which goes back to torch's cache)
        return np.split(values, np.cumsum(self.counts)[:-1]) if self.counts else []


def _file(out: list[list[np.ndarray]], pending: tuple[HostCopy, list[tuple[int, int]]] | None) -> None:
    """Put a forward's values (`pending`: its copy, and (tree, continuation) of each sequence) in `out`."""
    if pending is None:
        return
    copy, sequences = pending
    for (tree, continuation), values in zip(sequences, copy.read(), strict=True):
        out[tree][continuation] = values


# ------------------------------------------------------------------------------------------ stage 1
