"""FlexAttention under a block mask (the "block-mask" attention kernel, the default on accelerators).

FlexAttention runs on this CPU forward only (torch has no FlexAttention backward on the CPU), unfused: the values
of both stages' forwards are compared with the sequence-by-sequence kernel (the CPU's default, itself held to the
dense mask and to the padded path in test_packing.py), for plain, GQA, biased and sliding-window models, in float32
and under bf16 autocast. The compiled GPU kernel never ran here.
"""

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from test_packing import make_model, random_trees

from kto_pipeline.scoring import attention
from kto_pipeline.scoring.attention import (
    BLOCK_SIZE,
    AttentionPairs,
    attention_costs,
    attention_kernel,
    block_mask,
    request_attention_kernel,
    tree_mask,
)
from kto_pipeline.scoring.logprobs import score_layout, score_policy
from kto_pipeline.scoring.packing import AttentionCosts, block_pairs, layout_trees, pack_rows


def forwards(model, trees, kernel: str, bf16: bool) -> list[torch.Tensor]:
    """Per-token log-probs of the reference pass's layout and of training's two forwards (KL in rows, gathered)."""
    assert request_attention_kernel(model, kernel, "cpu") == (kernel, None)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = [score_layout(model, layout_trees(trees, rows=[[0, 1, 2], [3, 4], [5]], pad_id=5)).token_logps]
        for gather in (False, True):
            layout = layout_trees(trees, [[0, 5], [1, 2, 3], [4]], split_last=True)
            scores = score_policy(model, layout, gather_kl=gather)
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
    original = attention.block_mask_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(attention, "block_mask_attention", spy)
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
    """The BlockMask's tiles are the tree mask's: a tile with no visible pair is skipped, a tile of visible pairs only
    runs without mask_mod, the others call mask_mod, which agrees with the mask pair by pair (sliding window
    included); rows of several tiles, the last one partial."""
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
        full = torch.zeros_like(tiles, dtype=torch.bool)
        for n in range(2):
            for qb in range(tiles.shape[1]):
                for i in mask.full_kv_indices[n, 0, qb, : mask.full_kv_num_blocks[n, 0, qb]]:
                    full[n, qb, i] = True
        assert torch.equal(full, tiles == BLOCK_SIZE * BLOCK_SIZE) and (~full & (tiles > 0)).any()
        assert bool(full.any()) is (window is None)  # a window of 50 leaves no tile whole
        grid = torch.meshgrid(*(torch.arange(s) for s in visible[:, 0].shape), indexing="ij")
        n, q, k = (x.reshape(-1) for x in grid)
        assert torch.equal(mask.mask_mod(n, torch.zeros_like(n), q, k), visible[n, 0, q, k])
        pairs = AttentionPairs().add(visible)
        assert pairs.needed == int(visible.sum()) and pairs.dense == visible.numel()
        assert pairs.block_mask == int((tiles > 0).sum()) * BLOCK_SIZE**2 < pairs.dense


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
    dense = pack_rows(sizes, None, AttentionCosts(pair=attention_costs(model, "cpu").pair))
    request_attention_kernel(model, "block-mask", "cpu")
    costs = attention_costs(model, "cpu")
    assert costs.block == BLOCK_SIZE
    blocked = pack_rows(sizes, None, costs)
    assert len(blocked) < len(dense)

    def padding(rows):
        return len(rows) * max(sum(sizes[i] for i in row) for row in rows) - sum(sizes)

    assert padding(blocked) <= padding(dense)


def test_a_kernel_that_cannot_run_falls_back_and_says_why_once(caplog):
    """A model in training on the CPU (no FlexAttention backward there) falls back to by-tree; an eager-attention
    model asked for by-tree to dense; "auto" on an accelerator is the block mask. Each reason is logged once."""
    model = make_model("llama").train()
    assert attention_kernel(model, "cuda") == "block-mask"
    request_attention_kernel(model, "auto", "cpu")
    assert attention_kernel(model, "cpu") == "by-tree"
    kernel, why = request_attention_kernel(model, "block-mask", "cpu")
    assert kernel == "by-tree" and "no FlexAttention backward on the CPU" in why and "by-tree kernel runs" in why
    assert attention_kernel(model.eval(), "cpu") == "block-mask"
    eager = make_model("llama", attn_implementation="eager")
    with caplog.at_level(logging.WARNING, logger="kto_pipeline.scoring.attention"):
        for _ in range(3):
            request_attention_kernel(eager, "auto", "cpu")
            assert attention_kernel(eager, "cpu") == "dense"
    told = [r.getMessage() for r in caplog.records if "eager attention, not sdpa" in r.getMessage()]
    assert len(told) <= 1  # once in the process: this test or an earlier one may have said it
    with pytest.raises(ValueError, match="expected one of auto, by-tree, block-mask, dense"):
        request_attention_kernel(model, "flash", "cpu")


def test_estimate_memory_runs_the_block_mask_on_a_gpu():
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
    original = attention.attention_kernel

    def spy(model, device):
        calls.append(original(model, device))
        return calls[-1]

    attention.attention_kernel, saved = spy, attention.attention_kernel
    try:
        step = simulate_ours(config, rows, StepSettings(bf16=True, device_type="cuda"), fake=True)
    finally:
        attention.attention_kernel = saved
    assert calls and set(calls) == {"block-mask"}
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
