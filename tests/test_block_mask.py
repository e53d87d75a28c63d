"""FlexAttention under a block mask (the "block-mask" attention kernel, the default on accelerators).

FlexAttention runs on this CPU forward only (torch has no FlexAttention backward on the CPU), unfused: the values
of both stages' forwards are compared with the sequence-by-sequence kernel (the CPU's default, itself held to the
dense mask and to the padded path in test_packing.py), for plain, GQA, biased and sliding-window models, in float32
and under bf16 autocast. The compiled GPU kernel never ran here.
"""

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from test_packing import make_model, random_trees

from kto_pipeline.scoring import attention
from kto_pipeline.scoring import block_mask as flex_kernel
from kto_pipeline.scoring.attention import attention_costs, choose_kernel, tree_mask
from kto_pipeline.scoring.block_mask import BLOCK_SIZE, KEY_TILE, AttentionPairs, block_mask
from kto_pipeline.scoring.logprobs import score_layout, score_policy
from kto_pipeline.scoring.packing import AttentionCosts, block_pairs, last_continuations, layout_trees, pack_rows


def forwards(model, trees, kernel: str, bf16: bool) -> list[torch.Tensor]:
    """Per-token log-probs of the reference pass's layout and of training's two forwards (KL in rows, gathered)."""
    assert choose_kernel(model, kernel, "cpu") == (kernel, None)
    costs = attention_costs(model, kernel)
    align = costs.align  # as the stages lay them out: segments on the key tiles (block mask)
    assert align == (KEY_TILE if kernel == "block-mask" else 1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        reference = layout_trees(trees, rows=[[0, 1, 2], [3, 4], [5]], pad_id=5, align=align)
        out = [score_layout(model, reference, costs).token_logps]
        for gather in (False, True):
            layout = layout_trees(trees, [[0, 5], [1, 2, 3], [4]], split_last=True, align=align)
            scores = score_policy(model, layout, costs, gather_kl=gather)
            assert scores.kl_on_cached_prompt
            out += [scores.completions.token_logps, scores.kl.token_logps]
    assert model.config._attn_implementation == "sdpa"  # restored after every forward
    return out


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_block_mask_equals_attention_by_tree(kind, bf16, monkeypatch):
    """llama: GQA (4 heads, 2 key/value heads); qwen2: q/k/v biases, tied embeddings; mistral: a sliding window of 6
    shorter than the sequences. Within float32 rounding; under bf16 within the suite's bf16 tolerance for products
    summed in another order (measured: at most 4e-3 here, where the padded path differs from by-tree by 2e-3)."""
    model = make_model(kind)
    trees = random_trees(6, seed=5)
    masks = []
    original = flex_kernel.block_mask_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(flex_kernel, "block_mask_attention", spy)
    by_tree = forwards(model, trees, "by-tree", bf16)
    assert not masks
    flex = forwards(model, trees, "block-mask", bf16)
    from torch.nn.attention.flex_attention import BlockMask

    assert masks and all(isinstance(m, BlockMask) for m in masks)
    for a, b in zip(flex, by_tree, strict=True):
        if bf16:
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_block_mask_holds_the_tree_masks_tiles():
    """The BlockMask's tiles are the tree mask's: a tile with no visible pair is skipped, the others run in column
    order, every one with mask_mod (none as full: which tiles are full depends on a tree's neighbours, and the
    kernel would run them last), which agrees with the mask pair by pair (sliding window included); rows of several
    tiles, the last one partial."""
    g = torch.Generator().manual_seed(3)
    trees = [
        (torch.randint(3, 90, (int(n) * 3,), generator=g).tolist(), [[7] * int(c1), [8] * int(c2)])
        for n, c1, c2 in torch.randint(20, 130, (7, 3), generator=g)
    ]  # prompts of 60-390 tokens: some hold whole tiles
    layout = layout_trees(trees, rows=[[0, 1, 2, 3], [4, 5, 6]], pad_id=0)
    tokens = torch.arange(layout.input_ids.numel()).reshape(layout.input_ids.shape)
    for window in (None, 50):
        visible = tree_mask(layout, tokens, tokens, window)
        mask = block_mask(layout, tokens, tokens, visible, window)
        assert mask.BLOCK_SIZE == (BLOCK_SIZE, BLOCK_SIZE) and mask.shape == (2, 1, *visible.shape[2:])
        dense = mask.to_dense()  # (N, 1, QB, KB): 1 on every tile that runs, partial or full
        edges = (0, -visible.shape[3] % BLOCK_SIZE, 0, -visible.shape[2] % BLOCK_SIZE)
        tiles = torch.nn.functional.pad(visible[:, 0], edges)
        tiles = tiles.unflatten(1, (-1, BLOCK_SIZE)).unflatten(3, (-1, BLOCK_SIZE)).sum((2, 4))
        assert torch.equal(dense[:, 0].bool(), tiles > 0)
        assert mask.full_kv_num_blocks is None and mask.full_kv_indices is None
        assert bool((tiles == BLOCK_SIZE * BLOCK_SIZE).any()) is (window is None)  # whole tiles, run with mask_mod
        for n in range(2):
            for qb in range(tiles.shape[1]):
                run = mask.kv_indices[n, 0, qb, : mask.kv_num_blocks[n, 0, qb]]
                assert torch.equal(run, (tiles[n, qb] > 0).nonzero()[:, 0].to(run.dtype))  # in column order
        grid = torch.meshgrid(*(torch.arange(s) for s in visible[:, 0].shape), indexing="ij")
        n, q, k = (x.reshape(-1) for x in grid)
        assert torch.equal(mask.mask_mod(n, torch.zeros_like(n), q, k), visible[n, 0, q, k])
        pairs = AttentionPairs().add(visible)
        assert pairs.needed == int(visible.sum()) and pairs.dense == visible.numel()
        assert pairs.block_mask == int((tiles > 0).sum()) * BLOCK_SIZE**2 < pairs.dense


def tiled_attention(layout, forwards, tile: int) -> dict[int, torch.Tensor]:
    """A model of the fused kernel's forward: each query's keys summed tile by tile (`tile` keys at a time, in the
    order of the forward's key list), an online softmax, every sum within a tile one term after another. q, k, v of a
    token are fixed functions of its id and position (one layer: at step 1 they are the same in every layout).
    `forwards`: (queries, keys) flat-index vectors of each forward. Returns flat index -> the query's output."""
    g = torch.Generator().manual_seed(0)
    tables = [torch.randn(100, 8, generator=g) * 2 for _ in range(3)] + [
        torch.randn(64, 8, generator=g) for _ in range(3)
    ]
    ids, pos = layout.input_ids.reshape(-1), layout.position_ids.reshape(-1)

    def features(index, which):
        return tables[which][ids[index]] + tables[3 + which][pos[index].clamp(max=63)]  # (padding's may pass 63)

    out = {}
    for queries, keys in forwards:
        visible = tree_mask(layout, queries[None], keys[None], None)[0, 0]
        q, k, v = features(queries, 0), features(keys, 1), features(keys, 2)
        m, total, acc = torch.full((len(queries),), -torch.inf), torch.zeros(len(queries)), torch.zeros(len(queries), 8)
        for start in range(0, len(keys), tile):
            scores = (q @ k[start : start + tile].T).masked_fill(~visible[:, start : start + tile], -torch.inf)
            new = torch.maximum(m, scores.amax(1))
            safe = torch.where(new == -torch.inf, 0.0, new)
            alpha, p = torch.exp(m - safe), torch.exp(scores - safe[:, None])
            total, acc = total * alpha, acc * alpha[:, None]
            for j in range(p.shape[1]):  # one term after another, as a tile's sum runs in a fixed order
                total, acc = total + p[:, j], acc + p[:, j, None] * v[start + j]
            m = new
        out.update(zip(queries.tolist(), acc / total[:, None], strict=True))
    return out


def test_aligned_segments_make_a_tiled_kernel_score_alike_in_every_layout():
    """Why every segment starts at a multiple of the key tile under a block mask: a kernel that sums a query's keys tile
    by tile (`tiled_attention`, a model of FlexAttention's fused forward) gives each sequence token exactly the same
    output in the reference pass's rows, in training's two forwards (KL completions in rows and gathered) and in a
    pair's tree (its rejected answer the second continuation, where the reference pass scored it the first), when the
    segments are aligned; and not when they lie back to back."""
    g = torch.Generator().manual_seed(7)

    def seq(lo, hi):
        return torch.randint(3, 100, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    trees = [(seq(3, 40), [seq(2, 30), seq(2, 30)]) for _ in range(6)]
    tile = 8

    def outputs(align: int) -> list[torch.Tensor]:
        """Per layout: the outputs at the predictors of every (completion, KL completion) sequence token, in order."""
        reference = layout_trees(trees, [[0, 1, 2], [3, 4], [5]], align=align)
        rows = [(r, r) for r in torch.arange(reference.input_ids.numel()).reshape(reference.input_ids.shape)]
        got = [tiled_attention(reference, rows, tile)]
        training = layout_trees(trees, [[4, 1], [0, 2, 3], [5]], split_last=True, align=align)
        grid = torch.arange(training.input_ids.numel()).reshape(training.input_ids.shape)
        main = [(r[: training.split], r[: training.split]) for r in grid]
        in_rows = [(r[training.split :], r) for r in grid]
        kl = last_continuations(training)
        got.append(tiled_attention(training, main + in_rows, tile))
        got.append(
            tiled_attention(training, main + [(kl, torch.cat([grid[:, : training.split].reshape(-1), kl]))], tile)
        )
        layouts = [reference, training, training]
        return [torch.stack([o[int(i)] for i in lay.predictor]) for o, lay in zip(got, layouts, strict=True)]

    def pair_outputs(align: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A pair (chosen = tree a's completion, rejected = tree b's, tree a's prompt): the reference pass's rows score
        each as its row's completion; the pair's tree, after another tree in its row, as its two continuations."""
        prompt, (chosen, kl_a), (rejected, kl_b) = trees[a][0], trees[a][1], trees[b][1]
        other = min({0, 1, 2} - {a, b})
        rows = layout_trees([(prompt, [chosen, kl_a]), (prompt, [rejected, kl_b])], [[0, 1]], align=align)
        pair = layout_trees([(trees[other][0], trees[other][1]), (prompt, [chosen, rejected])], [[0, 1]], align=align)
        scored = []
        for layout, sequences in ((rows, (0, 2)), (pair, (2, 3))):
            grid = torch.arange(layout.input_ids.numel())
            out = tiled_attention(layout, [(grid, grid)], tile)
            scored.append(torch.stack([out[int(i)] for s in sequences for i in layout.predictor[layout.sequence == s]]))
        return scored[0], scored[1]

    aligned = outputs(tile)
    assert all(torch.equal(aligned[0], other) for other in aligned[1:])
    pairs = list(itertools.permutations(range(len(trees)), 2))  # every (chosen's tree, rejected's tree)
    assert all(torch.equal(*pair_outputs(tile, a, b)) for a, b in pairs)
    packed = outputs(1)  # back to back: a sequence's keys fall on other tiles in each layout
    assert not all(torch.equal(packed[0], other) for other in packed[1:])
    torch.testing.assert_close(packed[1], aligned[1], atol=1e-5, rtol=1e-5)  # the same values, rounded otherwise
    # (whether a given pair's outputs round otherwise depends on the CPU's matmul: over all pairs some do; one pair
    # alone was bit-equal back to back on an AMD EPYC, and not on an Intel Xeon)
    assert not all(torch.equal(*pair_outputs(1, a, b)) for a, b in pairs)


def test_block_pairs_counts_the_tiles_of_causal_trees():
    """`block_pairs` (the packing cost model's count) = the tiles a one-continuation tree layout's mask touches."""
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(2, 300, (9,), generator=g).tolist()
    trees = [([5] * (n // 2), [[6] * (n - n // 2)]) for n in sizes]
    for rows in ([[0, 1, 2, 3, 4, 5, 6, 7, 8]], [[0, 3, 6], [1, 4], [2, 5, 7, 8]]):
        layout = layout_trees(trees, rows=rows, pad_id=0)
        tokens = torch.arange(layout.input_ids.numel()).reshape(layout.input_ids.shape)
        visible = tree_mask(layout, tokens, tokens, None) & (layout.tree.reshape(-1)[tokens] >= 0)[:, None, None, :]
        assert block_pairs(rows, sizes, BLOCK_SIZE) == AttentionPairs().add(visible).block_mask


def test_packing_under_a_block_mask_takes_the_fewest_rows():
    """Under the dense mask many narrow rows attend less; under a block mask a row's width costs (almost) nothing, so
    the trees go into few rows, with little padding."""
    model = make_model("llama")
    sizes = [400, 380, 350, 300, 260, 220, 200, 150, 120, 90, 60, 40]
    dense = pack_rows(sizes, None, AttentionCosts(pair=attention_costs(model, "dense").pair))
    costs = attention_costs(model, "block-mask")
    assert costs.block == BLOCK_SIZE
    blocked = pack_rows(sizes, None, costs)
    assert len(blocked) < len(dense)

    def padding(rows):
        return len(rows) * max(sum(sizes[i] for i in row) for row in rows) - sum(sizes)

    assert padding(blocked) <= padding(dense)


def test_a_kernel_that_cannot_run_falls_back_and_says_why():
    """A model in training on the CPU (no FlexAttention backward there) falls back to by-tree; a model whose attention
    is neither sdpa nor eager (a flash kernel) to dense; "auto" on an accelerator is the block mask. The reason comes
    with the kernel chosen, for the stage to say once."""
    model = make_model("llama").train()
    assert choose_kernel(model, "auto", "cuda") == ("block-mask", None)
    assert choose_kernel(model, "auto", "cpu") == ("by-tree", None)
    kernel, why = choose_kernel(model, "block-mask", "cpu")
    assert kernel == "by-tree" and "no FlexAttention backward on the CPU" in why and "by-tree kernel runs" in why
    assert choose_kernel(model.eval(), "block-mask", "cpu") == ("block-mask", None)
    flash = make_model("llama")
    flash.config._attn_implementation = "flash_attention_2"
    kernel, why = choose_kernel(flash, "auto", "cpu")
    assert kernel == "dense" and "flash_attention_2 attention, not sdpa" in why and "dense kernel runs" in why
    with pytest.raises(ValueError, match="expected one of auto, by-tree, block-mask, dense"):
        choose_kernel(model, "flash", "cpu")


def test_estimate_memory_runs_the_block_mask_on_a_gpu(monkeypatch):
    """`estimate-memory` decides as the device would: on "cuda", packed rows under a block mask (the fused kernel's
    saved tensors on fake tensors), which packs a batch into fewer rows than the dense mask did."""
    from transformers import LlamaConfig

    from kto_pipeline.memory import StepSettings, simulate_ours, synthetic_rows

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    rows = synthetic_rows(8, 256, "full", config.vocab_size)
    calls = []
    original = attention.choose_kernel

    def spy(model, asked, device):
        calls.append(original(model, asked, device)[0])
        return calls[-1], None

    monkeypatch.setattr(attention, "choose_kernel", spy)
    step = simulate_ours(config, rows, StepSettings(bf16=True, device_type="cuda"), fake=True)
    assert calls == ["block-mask"]
    assert step.peak_bytes > 0 and step.tokens_executed >= sum(1 for r in rows for _ in r["completion_ids"])


def test_precompute_under_a_block_mask_equals_the_default_cache(tmp_path, tiny_model_dir, small_cache, capsys):
    """The reference pass with `--attention-kernel block-mask` on this CPU writes the default (by-tree) cache's rows
    and values within float32 rounding, and its manifest names the kernel."""
    import numpy as np
    from helpers import unpaired_rows, write_jsonl

    from kto_pipeline import PrecomputeConfig, precompute
    from kto_pipeline.cache import open_cache

    data = write_jsonl(tmp_path / "d.jsonl", unpaired_rows())
    config = PrecomputeConfig(model=str(tiny_model_dir), dataset=str(data), output=str(tmp_path / "c"), max_length=64)
    out = precompute(dataclasses.replace(config, attention_kernel="block-mask"))
    assert "attention: block-mask" in capsys.readouterr().out
    flex, default = open_cache(out), open_cache(small_cache)
    assert flex.manifest["reference_pass"]["attention_kernel"] == "block-mask"
    assert default.manifest["reference_pass"]["attention_kernel"] == "by-tree"
    for x, y in zip(flex.table.to_pylist(), default.table.to_pylist(), strict=True):
        assert x["example_id"] == y["example_id"] and x["kl_example_id"] == y["kl_example_id"]
        np.testing.assert_allclose(x["ref_token_logps"], y["ref_token_logps"], atol=1e-5)
        np.testing.assert_allclose(x["ref_kl_token_logps"], y["ref_kl_token_logps"], atol=1e-5)


def test_attention_pairs_of_the_benchmark(small_cache):
    """bench.count_pairs (printed by `make bench` for the real case) on a tiny cache: per training batch
    and for the reference pass, the dense mask's pairs are the layout's rows squared, the block mask's are whole
    tiles, and both cover the needed pairs."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from bench import count_pairs, pairs_table

    counts = count_pairs(small_cache, batch=8, steps=2, reference_batch=16, max_tokens=16384)
    assert len(counts["train"]) == 2
    for pairs in [*counts["train"], counts["reference"]]:
        for p in pairs.values():
            assert 0 < p.needed <= min(p.dense, p.block_mask) and p.block_mask % (BLOCK_SIZE * BLOCK_SIZE) == 0
    lines = pairs_table(counts)
    assert len(lines) == 2 + 2 + 2 and lines[-1].startswith("| **reference pass** |")
