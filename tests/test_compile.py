"""--torch-compile: the decoder layer compiled once for every layer gives the eager run's numbers, in both stages,
with no graph break and graphs that do not grow with depth, and the run records what compiling cost (the
manifest's timing and trainer_state.json, `compile`)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from helpers import read_metrics, train_config, unpaired_rows, write_jsonl

pytestmark = pytest.mark.slow


def _cache_values(cache) -> dict:
    from kto_pipeline.cache import open_cache

    table: pa.Table = open_cache(cache).table
    return {c: table.column(c).to_pylist() for c in ("ref_logp", "ref_kl_logp")}


def test_compiled_layers_give_the_eager_numbers(tmp_path):
    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model

    tiny_model_dir = tmp_path / "model"  # 4 layers: a graph per layer would pass the recompile limit (8)
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, num_layers=4).save_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(tiny_model_dir)
    data = write_jsonl(tmp_path / "data.jsonl", unpaired_rows(24))
    caches, runs = {}, {}
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        settings = dict(attention_kernel="dense", torch_compile=compiled)
        caches[name] = precompute(
            PrecomputeConfig(
                model=str(tiny_model_dir),
                dataset=str(data),
                output=str(tmp_path / f"cache-{name}"),
                max_length=64,
                **settings,
            )
        )
        runs[name] = tmp_path / f"run-{name}"
        train(train_config(caches["eager"], runs[name], max_steps=4, **settings))

    eager, compiled = (_cache_values(caches[k]) for k in ("eager", "compiled"))
    for column in eager:
        assert compiled[column] == pytest.approx(eager[column], rel=1e-5), column
    manifest = json.loads((caches["compiled"] / "manifest.json").read_text())
    assert "compile" not in json.loads((caches["eager"] / "manifest.json").read_text())["timing"]
    assert manifest["timing"]["compile"]["graph_breaks"] == 0 and 1 <= manifest["timing"]["compile"]["graphs"] <= 2

    steps = {k: read_metrics(runs[k]) for k in runs}
    assert len(steps["compiled"]) == len(steps["eager"]) == 4
    for a, b in zip(steps["compiled"], steps["eager"], strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
    state = json.loads((runs["compiled"] / "trainer_state.json").read_text())
    assert state["compile"]["graph_breaks"] == 0 and state["compile"]["recompiles"] <= 3, state["compile"]
    assert 1 <= state["compile"]["graphs"] <= 4 and state["compile"]["seconds"] > 0, state["compile"]
    assert "compile" not in json.loads((runs["eager"] / "trainer_state.json").read_text())
