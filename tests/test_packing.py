"""Packed layouts (prompt shared by both continuations, no padding) give the unshared, padded values.

Checked for Llama, Qwen2 and Mistral-style models (GQA, tied embeddings, biases, a sliding window),
against the padded path (`score_sequences`, right and left padding) and against the models' own
full logits; and for training's two forwards (prompt keys/values reused by the KL completion),
values and gradients.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_attention

from kto_pipeline.scoring import attention
from kto_pipeline.scoring import by_tree as by_tree_kernel
from kto_pipeline.scoring.attention import attention_costs, checkpointing_kwargs, choose_kernel, enable_checkpointing
from kto_pipeline.scoring.logprobs import pad_sequences, score_layout, score_policy, score_sequences
from kto_pipeline.scoring.packable import packing_unsupported
from kto_pipeline.scoring.packing import MAX_ROW_TOKENS, AttentionCosts, last_continuations, layout_trees, pack_rows

ATOL = 1e-5


def make_model(kind: str, **overrides):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    common.update(overrides)
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    elif kind == "llama-tied":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    elif kind == "qwen2":  # q/k/v biases, tied embeddings (as Qwen2-0.5B)
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    elif kind == "mistral":  # a sliding window shorter than the sequences
        model = MistralForCausalLM(MistralConfig(sliding_window=6, **common))
    else:
        raise ValueError(kind)
    return model.float().eval()


def random_trees(n: int, seed: int = 0, vocab: int = 97):
    g = torch.Generator().manual_seed(seed)

    def seq(lo, hi):
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    return [(seq(1, 12), [seq(1, 9), seq(1, 9)]) for _ in range(n)]


def padded_logps(model, trees, left: bool = False) -> list[torch.Tensor]:
    """Per-token log-probs of every (prompt + continuation) as its own padded sequence."""
    seqs = [(p, c) for p, conts in trees for c in conts]
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    comp = torch.zeros_like(ids)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        cols = slice(width - n, width) if left else slice(0, n)
        ids[i, cols] = torch.tensor(p + c)
        attn[i, cols] = 1
        comp[i, cols.start + len(p) : cols.stop] = 1
    with torch.no_grad():
        return score_sequences(model, ids, attn, comp, chunk_size=7).per_sequence()


def full_logits_logps(model, trees) -> list[torch.Tensor]:
    """An independent computation: the model's own forward and full logits, one unpadded sequence at a time."""
    out = []
    with torch.no_grad():
        for p, conts in trees:
            for c in conts:
                ids = torch.tensor([p + c])
                logits = model(ids).logits[0, len(p) - 1 : -1].float()
                out.append(F.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen2", "mistral"])
def test_shared_prefix_layout_equals_padded_and_full_logits(kind):
    model = make_model(kind)
    assert packing_unsupported(model) is None
    trees = random_trees(7)
    want = full_logits_logps(model, trees)
    assert_same(padded_logps(model, trees), want)
    assert_same(padded_logps(model, trees, left=True), want)
    # several rows, right-padded to the longest, trees split unevenly across them
    layout = layout_trees(trees, rows=[[0, 1, 2], [3], [4, 5, 6]], pad_id=5)
    with torch.no_grad():
        scores = score_layout(model, layout, chunk_size=5, attention=cpu_attention(model))
    assert layout.tokens() == sum(len(p) + sum(map(len, c)) for p, c in trees)  # each prompt once
    assert_same(scores.per_sequence(), want)
    torch.testing.assert_close(scores.logps, torch.stack([w.sum() for w in want]), atol=1e-4, rtol=0)


def test_eager_attention_takes_the_additive_mask():
    model = make_model("llama", attn_implementation="eager")
    trees = random_trees(4, seed=1)
    with torch.no_grad():
        scores = score_layout(model, layout_trees(trees, rows=[[0, 1], [2, 3]]), attention=cpu_attention(model))
    assert_same(scores.per_sequence(), full_logits_logps(model, trees))


@pytest.mark.parametrize(
    "kind,rows,gather",
    [
        ("llama", None, True),
        ("qwen2", None, True),
        ("llama", [[0, 5], [1, 2, 3], [4]], True),
        ("mistral", [[0, 5], [1, 2, 3], [4]], False),
    ],
)
def test_kl_forward_on_cached_prompt_equals_separate_forwards(kind, rows, gather):
    """Training's two forwards: completion log-probs and their gradients, and KL log-probs, equal the padded
    path's; the KL forward runs only the KL completions' tokens (one row: no padding at all)."""
    model = make_model(kind)
    trees = random_trees(6, seed=2)
    layout = layout_trees(trees, rows, split_last=True)
    scores = score_policy(model, layout, chunk_size=6, gather_kl=gather, attention=cpu_attention(model))
    main, kl = scores.completions, scores.kl
    assert scores.kl_on_cached_prompt
    r, width = layout.input_ids.shape
    kl_run = sum(len(c[1]) for _, c in trees) if gather else r * (width - layout.split)  # one unpadded row, or rows
    assert scores.tokens_executed == r * layout.split + kl_run
    if rows is None:
        assert scores.tokens_executed == layout.tokens()
    want = padded_logps(model, trees)
    assert_same(main.per_sequence(), want[0::2])
    assert_same(kl.per_sequence(), want[1::2])
    assert not kl.logps.requires_grad
    weights = torch.linspace(-1, 1, len(trees))
    (main.logps * weights).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    seqs = [(p, conts[0]) for p, conts in trees]
    width = max(len(p) + len(c) for p, c in seqs)
    ids, attn, comp = (torch.zeros(len(seqs), width, dtype=torch.long) for _ in range(3))
    for i, (p, c) in enumerate(seqs):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        comp[i, len(p) : len(p) + len(c)] = 1
    (score_sequences(model, ids, attn, comp).logps * weights).sum().backward()
    for a, (name, p) in zip(packed_grads, model.named_parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("enabled_by", ["transformers", "train"])
def test_gradient_checkpointing_without_the_cache_runs_the_prompt_again_for_the_kl(enabled_by):
    """Checkpointed layers that keep no keys/values for the KL forward: transformers' own checkpointing (which drops
    a checkpointed layer's cache), or train's (`enable_checkpointing`) on a model whose keys/values of a token are
    more than half its hidden size (here equal to it: two key/value heads of 16 in 64), where the cache would cost
    back the memory checkpointing saves. The KL completions run in a forward over the prompts and KL completions:
    same values, P + K more tokens."""
    model = make_model("llama")
    if enabled_by == "transformers":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(model))
    else:
        enable_checkpointing(model)
    model.train()
    trees = random_trees(5, seed=3)
    layout = layout_trees(trees, [[0, 1], [2, 3, 4]], split_last=True)
    scores = score_policy(model, layout, attention=cpu_attention(model))
    assert not scores.kl_on_cached_prompt
    rows, width = layout.input_ids.shape
    assert scores.tokens_executed == rows * layout.split + rows * width
    model.eval()
    want = padded_logps(model, trees)
    assert_same(scores.completions.per_sequence(), want[0::2])
    assert_same(scores.kl.per_sequence(), want[1::2])
    no_kl = score_policy(model, layout, with_kl=False, attention=cpu_attention(model))
    assert no_kl.kl is None and no_kl.tokens_executed == rows * layout.split


@pytest.mark.parametrize("gather", [True, False])
def test_checkpointed_layers_keep_the_prompts_keys_values_for_the_kl(gather):
    """Gradient checkpointing as train enables it (`enable_checkpointing`), on a model with one key/value head (a
    token's keys and values: half its hidden size): the layers take training's cache along into their checkpoints,
    so the KL completions run on the prompts' cached keys/values (the K tokens, not P + K again), and the cache is
    closed before the backward recomputes the layers (which would otherwise file their keys/values twice: a size
    error). Every value equals the run's without checkpointing to the bit, the gradients to float32 rounding."""
    trees = random_trees(5, seed=3)
    layout = layout_trees(trees, [[0, 1], [2, 3, 4]], split_last=True)
    results = {}
    for checkpointing in (False, True):
        model = make_model("llama", num_key_value_heads=1)
        if checkpointing:
            enable_checkpointing(model)
        model.train()
        scores = score_policy(model, layout, gather_kl=gather, attention=cpu_attention(model))
        assert scores.kl_on_cached_prompt
        scores.completions.logps.sum().backward()
        results[checkpointing] = scores, [p.grad for p in model.parameters()]
    (plain, plain_grads), (checkpointed, grads) = results[False], results[True]
    rows, width = layout.input_ids.shape
    kl_run = sum(len(c[1]) for _, c in trees) if gather else rows * (width - layout.split)
    assert checkpointed.tokens_executed == plain.tokens_executed == rows * layout.split + kl_run
    assert torch.equal(checkpointed.completions.token_logps, plain.completions.token_logps)
    assert torch.equal(checkpointed.kl.token_logps, plain.kl.token_logps)
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_pack_rows():

    sizes = [10, 9, 6, 5, 4, 3, 1]
    rows = pack_rows(sizes, costs=AttentionCosts(pair=0.05))
    assert sorted(t for row in rows for t in row) == list(range(len(sizes)))
    assert sorted(sum(sizes[t] for t in row) for row in rows) == [9, 9, 10, 10]  # 10 | 9 1 | 6 3 | 5 4
    assert all(len(row) <= 1 for row in pack_rows(sizes, max_trees=1))
    uneven = [10, 7, 7, 7, 4]
    assert len(pack_rows(uneven)) == 1  # no attention cost: one row, no padding
    assert len(pack_rows(uneven, costs=AttentionCosts(pair=0.2))) == 4  # attention dearer: [10] [7 4] [7] [7]
    # attention tree by tree: each tree attends to itself whatever the row, so one row again where calls are cheap
    assert len(pack_rows(uneven, costs=AttentionCosts(pair=0.2, tree_call=0.1))) == 1
    assert len(pack_rows(uneven, costs=AttentionCosts(pair=0.2, tree_call=100.0))) == 4  # calls dearer: dense


def pairwise_tree_mask(layout, queries, keys, window=None, chunk=None):
    """The tree mask by its definition, pair by pair: same tree, the key in the prompt or the query's own branch,
    the key no later (flat index), within the window and the chunk."""
    t, b, p = (x.reshape(-1) for x in (layout.tree, layout.branch, layout.position_ids))
    tq, tk, bq, bk = t[queries][:, :, None], t[keys][:, None, :], b[queries][:, :, None], b[keys][:, None, :]
    pq, pk = p[queries][:, :, None], p[keys][:, None, :]
    visible = (tq == tk) & ((bk == 0) | (bk == bq)) & (keys[:, None, :] <= queries[:, :, None])
    if window is not None:
        visible &= (pq - pk) < window
    if chunk is not None:
        visible &= (pq // chunk) == (pk // chunk)
    return visible[:, None]


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_mask_is_its_definition_for_every_forward(seed):
    """`tree_mask` (made of copied rows of two tables) equals the pair-by-pair definition for each forward the
    stages run: whole rows (the reference pass, a pair loss), training's prompts and completions, its KL completions
    in their rows and gathered into one row, padded, aligned and static layouts, under windows and chunks."""
    trees = random_trees(9, seed=seed)
    order = torch.randperm(9, generator=torch.Generator().manual_seed(seed)).tolist()
    rows = [order[:4], order[4:5], order[5:]]
    for kind in (dict(), dict(pad_id=5, static=True), dict(align=8)):
        layout = layout_trees(trees, rows, **kind)
        split = layout_trees(trees, rows, split_last=True, **kind)
        r, w = split.input_ids.shape
        grid = torch.arange(r * w).reshape(r, w)
        kl = last_continuations(split)
        forwards = [
            (layout, torch.arange(layout.input_ids.numel()).reshape(layout.input_ids.shape), None),
            (split, grid[:, : split.split], None),
            (split, grid[:, split.split :], grid),
            (split, kl[None], torch.cat([grid[:, : split.split].reshape(-1), kl])[None]),
            (split, kl[None], kl[None].clone()),  # no prompt among the keys: each sees its own branch only
        ]
        for lay, queries, keys in forwards:
            for window, chunk in ((None, None), (3, None), (None, 4)):
                got = attention.tree_mask(lay, queries, queries if keys is None else keys, window, chunk)
                want = pairwise_tree_mask(lay, queries, queries if keys is None else keys, window, chunk)
                assert torch.equal(got, want), (kind, queries.shape, window, chunk)


def test_split_layout_puts_the_last_continuations_after_the_rest():
    trees = random_trees(4, seed=4)
    layout = layout_trees(trees, [[0, 1], [2, 3]], split_last=True)
    for r, row in enumerate([[0, 1], [2, 3]]):
        branch = layout.branch[r]
        assert (branch[layout.split :] != 1).all() and (branch[: layout.split] != 2).all()
        assert int((branch == 2).sum()) == sum(len(trees[t][1][1]) for t in row)


@pytest.mark.parametrize("static", [False, True])
def test_aligned_layouts_start_every_segment_on_a_tile(static):
    """`align`: every segment (prompt, each continuation) starts at a multiple of it, back to back otherwise (the
    columns between them padding), the split too; the needed tokens are the same; `last_continuations` takes each
    row's KL completions with the padding between them, up to the last one's aligned end."""
    trees = random_trees(7, seed=6)
    rows = [[0, 1, 2], [3], [4, 5, 6]]
    for split_last in (False, True):
        layout = layout_trees(trees, rows, pad_id=5, split_last=split_last, static=static, align=8)
        assert layout.align == 8 and (layout.split % 8 == 0 or not split_last)
        assert layout.tokens() == sum(len(p) + sum(map(len, c)) for p, c in trees)
        for r, row in enumerate(rows):
            tree, branch = layout.tree[r].tolist(), layout.branch[r].tolist()
            starts = [
                c
                for c in range(len(tree))
                if tree[c] >= 0 and (c == 0 or (tree[c - 1], branch[c - 1]) != (tree[c], branch[c]))
            ]
            assert all(c % 8 == 0 for c in starts)
            assert len(starts) == 3 * len(row)  # each segment one run
            assert [tree[c] for c in starts if branch[c] == 0] == row
        if split_last:
            kl = last_continuations(layout)
            assert (layout.branch.reshape(-1)[kl] == 2).sum() == sum(len(c[1]) for _, c in trees)
            assert set(kl.tolist()) >= set((layout.branch.reshape(-1) == 2).nonzero()[:, 0].tolist())
            assert (
                len(kl) % 8 == 0
                and len(kl) < layout.input_ids.shape[0] * (layout.input_ids.shape[1] - layout.split) + 1
            )
    plain = layout_trees(trees, rows, pad_id=5, split_last=True)
    assert torch.equal(last_continuations(plain), (plain.branch.reshape(-1) == 2).nonzero()[:, 0])


def test_unsupported_models_are_named():
    model = make_model("llama", attn_implementation="eager")
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in packing_unsupported(model)
    model = make_model("mistral", layer_types=["full_attention", "sliding_attention"])
    assert "several attention types" in packing_unsupported(model)


@pytest.mark.parametrize(
    ("kind", "implementation"), [("llama", "sdpa"), ("qwen2", "sdpa"), ("mistral", "sdpa"), ("llama", "eager")]
)
def test_tree_by_tree_attention_equals_the_dense_mask(kind, implementation, monkeypatch):
    """On the CPU, packed forwards attend tree by tree (`tree_attention`: sdpa, or the model's own eager attention);
    the values and gradients equal the dense mask's, for the reference pass's layout and for training's two forwards
    (KL in rows and gathered)."""

    model = make_model(kind, attn_implementation=implementation)
    assert choose_kernel(model, "auto", "cpu") == ("by-tree", None)
    flash = make_model(kind)
    flash.config._attn_implementation = "flash_attention_2"
    assert choose_kernel(flash, "auto", "cpu")[0] == "dense"
    trees = random_trees(6, seed=5)
    calls = []

    def run(by_tree: bool):
        kernel = "by-tree" if by_tree else "dense"
        assert choose_kernel(model, kernel, "cpu") == (kernel, None)
        with torch.no_grad():
            reference = score_layout(
                model, layout_trees(trees, rows=[[0, 1, 2], [3, 4], [5]], pad_id=5), attention_costs(model, kernel)
            )
        results = [reference.token_logps]
        for gather in (False, True):
            scores = score_policy(
                model,
                layout_trees(trees, [[0, 5], [1, 2, 3], [4]], split_last=True),
                attention_costs(model, kernel),
                gather_kl=gather,
            )
            (scores.completions.logps * torch.linspace(-1, 1, len(trees))).sum().backward()
            results += [scores.completions.token_logps.detach(), scores.kl.token_logps]
            results += [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
        assert model.config._attn_implementation == implementation  # restored after every forward
        return results

    original = by_tree_kernel.tree_attention
    monkeypatch.setattr(
        by_tree_kernel, "tree_attention", lambda *a, **k: calls.append(k.get("tree_blocks")) or original(*a, **k)
    )
    dense = run(False)
    assert not calls
    by_tree = run(True)
    assert calls and all(blocks is not None for blocks in calls)
    for a, b in zip(by_tree, dense, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sequence_scores_alike_in_every_layout(dtype):
    """Attention sequence by sequence makes a sequence's log-probs one computation wherever it lies: the reference
    pass's rows of several trees, one tree alone, and training's rows with the KL completions on the cached prompts
    (in rows and gathered), each also with every segment aligned (as under a block mask). Under bf16 autocast on the
    CPU they are equal bit for bit (the dense mask's extra masked keys moved them by up to 4e-3 a value); in float32,
    to float32 rounding (the CPU's float32 matmuls round a single row apart from a batch)."""
    model = make_model("llama")
    with torch.no_grad():
        for p in model.parameters():  # scaled up so that precision shows (a random tiny model is nearly uniform)
            p.mul_(4.0 if p.ndim == 2 else 1.0)
    trees = random_trees(6, seed=5)
    exact = dtype == torch.bfloat16

    def per_sequence(scores, sequences):
        return [t.float() for t in scores.per_sequence()[: len(sequences)]]

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=exact), torch.no_grad():
        packed = score_layout(
            model, layout_trees(trees, rows=[[0, 1, 2], [3, 4], [5]], pad_id=5), attention=cpu_attention(model)
        ).per_sequence()
        alone = [
            t
            for i in range(len(trees))
            for t in score_layout(model, layout_trees([trees[i]]), attention=cpu_attention(model)).per_sequence()
        ]
        policy = []
        for gather, align in ((False, 1), (True, 1), (False, 8), (True, 8)):  # align: segments as under a block mask
            layout = layout_trees(trees, [[0, 5], [1, 2, 3], [4]], split_last=True, align=align)
            scores = score_policy(model, layout, gather_kl=gather, attention=cpu_attention(model))
            completions, kl = scores.completions.per_sequence(), scores.kl.per_sequence()
            policy.append([t for pair in zip(completions, kl, strict=True) for t in pair])
        aligned = layout_trees(trees, rows=[[0, 1, 2], [3, 4], [5]], pad_id=5, align=8)
        policy.append(score_layout(model, aligned, attention=cpu_attention(model)).per_sequence())
    for other in (alone, *policy):
        for a, b in zip(packed, other, strict=True):
            if exact:
                assert torch.equal(a, b), (a - b).abs().max()
            else:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_padded_sequence_attends_alone_by_tree_whatever_it_is_padded_to(kind, dtype):
    """The padded path (a model that takes no packed layout: a sequence a row, right-padded) under the by-tree
    kernel: each row attends over its own tokens alone (`attention.padded_inputs`), so that a sequence's log-probs
    are the same, bit for bit, alone and padded beside longer rows, as the two stages pad it to other widths. The
    model's own attention over the row's width need not give that on a CPU (an Intel Xeon with AMX: 9.5e-7 in
    float32, 8.9e-3 under bf16 autocast, which moved a conv hybrid's step-1 rewards off 0), and by tree the values
    are still the model's own (mistral: a sliding window shorter than the rows, each row's windowed mask)."""
    model = make_model(kind)
    with torch.no_grad():
        for p in model.parameters():  # scaled up so that precision shows (a random tiny model is nearly uniform)
            p.mul_(4.0 if p.ndim == 2 else 1.0)
    sequences = [(prompt + continuations[0], len(prompt)) for prompt, continuations in random_trees(6, seed=5)]
    longest = max(len(s) for s, _ in sequences)
    filler = ([7, 11, 13] * longest)[: longest + 17]  # a longer row: every sequence padded past its length

    def scored(batch, kernel):
        seqs, prompts = [s for s, _ in batch], [n for _, n in batch]
        return score_sequences(model, *pad_sequences(seqs, prompts, 5), kernel=kernel).per_sequence()[: len(batch)]

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), torch.no_grad():
        alone = [scored([s], "by-tree")[0] for s in sequences]
        padded = scored([*sequences, (filler, 1)], "by-tree")[: len(sequences)]
        own = [scored([s], None)[0] for s in sequences]  # the model's attention, no padding
    for a, b, c in zip(alone, padded, own, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
        torch.testing.assert_close(a.float(), c.float(), atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_recomputes_with_the_forwards_attention(monkeypatch):
    """Gradient checkpointing recomputes each layer in the backward, after the forward's sequence-by-sequence
    attention has exited; `checkpointing_kwargs` makes the recomputation attend as the forward did (else it would
    save other tensors). The log-probs are bit-equal with and without checkpointing (bf16 autocast), and the
    gradients equal to float32 rounding."""
    trees = random_trees(5, seed=6)
    calls = []
    original = by_tree_kernel.tree_attention
    monkeypatch.setattr(
        by_tree_kernel, "tree_attention", lambda *a, **k: calls.append(k.get("tree_blocks")) or original(*a, **k)
    )
    results = {}
    for checkpointing in (False, True):
        for bf16 in (False, True):
            model = make_model("llama")
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(model))
            model.train()
            assert choose_kernel(model, "auto", "cpu")[0] == "by-tree"
            calls.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                scores = score_policy(
                    model, layout_trees(trees, [[0, 1, 2, 3, 4]], split_last=True), attention=cpu_attention(model)
                )
            forward_calls = len(calls)
            scores.completions.logps.sum().backward()
            assert model.config._attn_implementation == "sdpa"  # restored
            assert all(blocks is not None for blocks in calls)  # forward and recomputation: sequence by sequence
            assert (len(calls) > forward_calls) is checkpointing  # the backward recomputed the layers
            values = [scores.completions.token_logps.detach(), scores.kl.token_logps]
            results[checkpointing, bf16] = values, [p.grad for p in model.parameters()]
    for bf16 in (False, True):
        values, values_ac = results[False, bf16][0], results[True, bf16][0]
        assert all(torch.equal(a, b) for a, b in zip(values, values_ac, strict=True))
    for a, b in zip(results[False, False][1], results[True, False][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_rows_stay_under_the_mask_budget():

    sizes = [200] * 100  # 20,000 tokens: where attention costs nothing per pair, rows still stop near the budget
    rows = pack_rows(sizes)
    assert len(rows) >= 3  # (4 rows of 5,000: 3 would pad 400 tokens)
    assert max(sum(sizes[t] for t in row) for row in rows) <= MAX_ROW_TOKENS
    assert len(pack_rows([MAX_ROW_TOKENS * 2] * 3)) == 3  # trees wider than the budget: one a row


@pytest.mark.parametrize(
    "costs",
    [AttentionCosts(pair=0.003), AttentionCosts(pair=0.003, tree_call=2.0), AttentionCosts(block=128, align=128)],
    ids=["dense", "by-tree", "block-mask"],
)
def test_a_forward_stays_within_its_token_budget_under_every_kernel(costs):
    """`pack_trees` keeps every forward within max_tokens, rows included: where a row's width costs nothing (tree by
    tree, a block mask) rows still stop at the budget, not at MAX_ROW_TOKENS (a budget of 2,048 once ran forwards
    of 7,741 tokens); a tree wider than the budget runs alone."""
    from kto_pipeline.scoring.packing import pack_trees

    sizes = [int(n) for n in np.random.default_rng(0).integers(40, 600, size=300)]
    for max_tokens in (1024, 2048, 8192):
        passes = pack_trees(sizes, None, max_tokens, costs)
        assert sorted(t for rows in passes for row in rows for t in row) == list(range(len(sizes)))
        for rows in passes:
            assert len(rows) * max(sum(sizes[t] for t in row) for row in rows) <= max_tokens, (max_tokens, rows)
        if max_tokens >= 3 * max(sizes):  # and filled (where a budget holds a few trees)
            assert len(passes) <= 1.5 * sum(sizes) / max_tokens + 1, (max_tokens, len(passes))
    assert [[[0]], [[1]]] == pack_trees([3000, 3000], None, 2048, costs)


def test_static_shapes_pad_layouts_to_few_sizes_and_score_alike():
    """--static-shapes: rows a power of two, widths (and training's split) from `static_width`; the padding changes
    no sequence's log-probs, under either kernel that runs on the CPU; `pack_trees` keeps a pass, padded, within
    max_tokens."""
    from kto_pipeline.scoring.packing import pack_trees, static_rows, static_width

    assert [static_width(n) for n in (1, 64, 65, 81, 128, 129, 1000, 1025)] == [64, 64, 80, 96, 128, 160, 1024, 1280]
    assert [static_rows(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    model = make_model("llama")
    trees = [(p * 5, [c * 6, k * 4]) for p, (c, k) in random_trees(7)]  # long enough for widths past 64
    want = full_logits_logps(model, trees)
    sizes = {static_width(n) for n in range(1, 4096)}
    for kernel in ("by-tree", "dense"):
        layout = layout_trees(trees, rows=[[0, 1, 2], [3], [4, 5, 6]], pad_id=5, split_last=True, static=True)
        assert layout.input_ids.shape[0] == 4 and layout.width in sizes and layout.split in sizes, layout.width
        plain = layout_trees(trees, rows=[[0, 1, 2], [3], [4, 5, 6]], pad_id=5, split_last=True)
        assert layout.width > plain.width and layout.tokens() == plain.tokens()
        static_layout = layout_trees(trees, rows=[[0, 1, 2], [3], [4, 5, 6]], pad_id=5, static=True)
        with torch.no_grad():
            assert_same(
                score_layout(
                    model, static_layout, attention_costs(model, kernel, static=True), chunk_size=5
                ).per_sequence(),
                want,
            )
    lengths = [int(n) for n in torch.randint(20, 300, (60,), generator=torch.Generator().manual_seed(0))]
    costs = AttentionCosts(pair=0.01, static=True)
    for batch in pack_trees(lengths, batch_size=64, max_tokens=2048, costs=costs):
        width = max(sum(lengths[i] for i in row) for row in batch)
        assert len(batch) == 1 or static_rows(len(batch)) * static_width(width) <= 2048, batch
