"""--torch-compile: the decoder layer compiled once for every layer gives the eager run's numbers, in both stages,
with no graph break and graphs that do not grow with depth, and the run records what compiling cost (the
manifest's timing and trainer_state.json, `compile`)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pyarrow as pa
import pytest
from helpers import (
    KL_ON_CACHED_PROMPTS,
    read_metrics,
    train_config,
    unpaired_rows,
    write_jsonl,
)

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing: graphs another test (or file) compiled in this process are not reused."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cache_values(cache) -> dict:
    from kto_pipeline.cache import open_cache

    table: pa.Table = open_cache(cache).table
    return {c: table.column(c).to_pylist() for c in ("ref_logp", "ref_kl_logp")}


def test_compiled_layers_give_the_eager_numbers(tmp_path):
    from kto_pipeline import PrecomputeConfig, precompute, train

    tiny_model_dir = _tiny_model_dir(tmp_path)
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
    # the layer (its first shape static, then dynamic: one recompile) and the head's statistics, once
    assert manifest["timing"]["compile"]["graph_breaks"] == 0 and 2 <= manifest["timing"]["compile"]["graphs"] <= 3
    assert manifest["timing"]["compile"]["recompiles"] <= 1, manifest["timing"]["compile"]

    steps = {k: read_metrics(runs[k]) for k in runs}
    assert len(steps["compiled"]) == len(steps["eager"]) == 4
    for a, b in zip(steps["compiled"], steps["eager"], strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
    state = json.loads((runs["compiled"] / "trainer_state.json").read_text())
    assert state["compile"]["graph_breaks"] == 0 and state["compile"]["recompiles"] <= 3, state["compile"]
    # the layer (with gradients, keeping its keys/values; without, on the kept ones), the head's statistics and
    # gradient, the loss: for all 4 layers (a graph per layer would be 8 of the layer alone)
    assert 4 <= state["compile"]["graphs"] <= 8 and state["compile"]["seconds"] > 0, state["compile"]
    # the steps that compiled, in order: the first, and at most one a recompile after it
    steps_compiling = state["compile"]["compiling_steps"]
    assert steps_compiling[0] == 1 and steps_compiling == sorted(set(steps_compiling)), steps_compiling
    assert set(steps_compiling) <= {1, 2, 3, 4} and len(steps_compiling) <= 1 + state["compile"]["recompiles"]
    eager_state = json.loads((runs["eager"] / "trainer_state.json").read_text())
    assert "compile" not in eager_state
    # the KL completions on the prompts' cached keys/values, as eager: the same tokens run, each prompt once
    assert state["kl_forward"] == eager_state["kl_forward"] == "on the prompts' cached keys/values"
    assert state["tokens_executed"] == eager_state["tokens_executed"]  # (the dense mask pads its rows)


def _tiny_model_dir(tmp_path, layers: int = 4, **overrides):
    """A saved tiny Llama of 4 layers: a graph per layer would pass Dynamo's recompile limit (8)."""
    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model

    model_dir = tmp_path / "model"
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, num_layers=layers, **overrides).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def _tiny(tmp_path, layers: int = 4):
    from kto_pipeline import PrecomputeConfig, precompute

    model_dir = _tiny_model_dir(tmp_path, layers)
    data = write_jsonl(tmp_path / "data.jsonl", unpaired_rows(16))
    config = PrecomputeConfig(model=str(model_dir), dataset=str(data), output=str(tmp_path / "cache"), max_length=64)
    return precompute(config)


def test_compiling_that_fails_runs_eagerly_with_the_eager_numbers(tmp_path, monkeypatch, capsys):
    """A backend that cannot build the layer's kernels: the run says why, runs eagerly (the key/value cache kept
    again), records `eager_fallback`, and its numbers are the eager run's, exactly."""

    from kto_pipeline import train
    from kto_pipeline.runtime import compiled

    def failing_backend(graph, example_inputs):
        raise RuntimeError("this backend builds no kernels")

    monkeypatch.setattr(compiled, "BACKEND", failing_backend)
    cache = _tiny(tmp_path)
    runs = {}
    for name, asked in (("eager", False), ("failed", True)):
        runs[name] = tmp_path / name
        train(train_config(cache, runs[name], max_steps=2, attention_kernel="dense", torch_compile=asked))
    out = capsys.readouterr().out
    assert "compiling failed; running eagerly" in out and "this backend builds no kernels" in out
    state = json.loads((runs["failed"] / "trainer_state.json").read_text())
    assert "this backend builds no kernels" in state["compile"]["eager_fallback"], state["compile"]
    assert state["kl_forward"] == json.loads((runs["eager"] / "trainer_state.json").read_text())["kl_forward"]
    for a, b in zip(read_metrics(runs["failed"]), read_metrics(runs["eager"]), strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "kl"):
            assert a[key] == b[key], key


def test_passing_the_recompile_limit_is_said_with_its_reason(tmp_path, capsys, monkeypatch):
    """Past torch's recompile limit new shapes run eagerly: the log and trainer_state.json say so, with the guard
    that failed (here the grad mode: the KL completions' forward runs without gradients). Dynamo's side: aot_eager."""
    import torch

    from kto_pipeline import train
    from kto_pipeline.runtime import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")

    cache = _tiny(tmp_path)
    with torch._dynamo.config.patch(recompile_limit=1):
        train(train_config(cache, tmp_path / "run", max_steps=2, attention_kernel="dense", torch_compile=True))
    out = capsys.readouterr().out
    assert "recompiled past torch's recompile limit" in out, out[-2000:]
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["compile"]["recompile_limit"], state["compile"]


def test_a_run_evaluating_with_one_row_batches_stays_within_the_raised_recompile_limit(tmp_path, capsys, monkeypatch):
    """The compiled layer meets training's two forwards and evaluation's two (in eval mode), each static, dynamic and
    for one row: more graphs than torch's default limit (8) keeps, so compiling raises it (to 16), and no shape runs
    eagerly. A limit the user set stays (`test_passing_the_recompile_limit_is_said_with_its_reason`). Dynamo's
    graphs are what counts here, so they compile with aot_eager (inductor's kernels: the other tests)."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.runtime import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")

    model_dir = _tiny_model_dir(tmp_path, layers=2)
    caches = {}
    for name, rows in (("train", 21), ("eval", 11)):  # batches of 4 and 5: the last of each, one row
        data = write_jsonl(tmp_path / f"{name}.jsonl", unpaired_rows(rows))
        config = PrecomputeConfig(model=str(model_dir), dataset=str(data), output=str(tmp_path / name), max_length=64)
        caches[name] = precompute(config)
    with torch._dynamo.config.patch(recompile_limit=min(torch._dynamo.config.recompile_limit, 8)):
        monkeypatch.setattr(compiled, "_RAISED", {8})  # torch's own limit (8), as a user who set none has it
        run = tmp_path / "run"
        settings = dict(eval_cache=str(caches["eval"]), eval_steps=2, per_device_eval_batch_size=5)
        train(train_config(caches["train"], run, max_steps=6, attention_kernel="dense", torch_compile=True, **settings))
        assert torch._dynamo.config.recompile_limit == compiled.DYNAMIC_RECOMPILE_LIMIT
    from transformers import AutoModelForCausalLM

    layer_code = type(AutoModelForCausalLM.from_pretrained(model_dir).model.layers[0]).forward.__code__
    assert 8 < len(_debug_get_cache_entry_list(layer_code)) <= compiled.DYNAMIC_RECOMPILE_LIMIT
    assert "recompile limit" not in capsys.readouterr().out
    state = json.loads((run / "trainer_state.json").read_text())
    assert "recompile_limit" not in state["compile"] and state["compile"]["graph_breaks"] == 0, state["compile"]
    assert any("eval_loss" in record for record in read_metrics(run))


def test_a_vision_language_model_with_lora_compiles_its_language_models_layers_with_the_eager_numbers(
    tmp_path, monkeypatch
):
    """The decoder layers are found through PEFT's wrapper and a vision-language model's body: its language model's
    are compiled (the vision tower runs eagerly), and the numbers are the eager run's. (LoRA's dropout is off here:
    compiled and eager draw different dropout masks.) Which layers compile is Dynamo's side: aot_eager."""
    from vision_trl import vision_rows, write_vision_jsonl

    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.demo.tiny_vision import save_tiny_vlm
    from kto_pipeline.runtime import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")

    model_dir = save_tiny_vlm("llava", tmp_path / "model")
    data = write_vision_jsonl(vision_rows(8, seed=1), tmp_path / "data")
    config = PrecomputeConfig(model=str(model_dir), dataset=str(data), output=str(tmp_path / "cache"), max_length=80)
    cache = precompute(dataclasses.replace(config, dtype="float32"))
    runs = {}
    for name, asked in (("eager", False), ("compiled", True)):
        runs[name] = tmp_path / name
        lora = dict(use_peft=True, lora_r=4, lora_dropout=0.0)
        train(train_config(cache, runs[name], max_steps=2, attention_kernel="dense", torch_compile=asked, **lora))
    state = json.loads((runs["compiled"] / "trainer_state.json").read_text())
    assert state["compile"]["graphs"] >= 2 and "eager_fallback" not in state["compile"], state["compile"]
    assert state["kl_forward"] == "on the prompts' cached keys/values"
    for a, b in zip(read_metrics(runs["compiled"]), read_metrics(runs["eager"]), strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


def _asked(
    torch_compile: bool | None, mode: str = "default", static: bool = False, checkpointing: bool = False
) -> SimpleNamespace:
    """The options `compile_layers` reads (train's and precompute's alike; precompute has no checkpointing)."""
    options = dict(torch_compile=torch_compile, torch_compile_mode=mode, static_shapes=static)
    return SimpleNamespace(**options, gradient_checkpointing=checkpointing)


ONE_PROCESS = SimpleNamespace(
    name="single", fixed_parameter_addresses=True, caches_whole_casts=True, compile_refusal=None
)


def test_unset_compiles_training_on_cuda_only_and_a_model_without_layers_runs_eagerly():
    """Unset, training compiles on CUDA and the reference pass only when asked, but not a mixture-of-experts model
    trained with its load-balancing loss (transformers' router-logit hooks break the layers' graphs); a model
    without decoder layers, or DeepSpeed ZeRO-3 (whose parameter hooks break every compiled layer's graph), runs
    eagerly and says why."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model
    from kto_pipeline.runtime.compiled import TRAIN_COMPILES_ON, compile_layers
    from kto_pipeline.runtime.engines.deepspeed import DeepSpeed

    said, cpu, cuda = [], torch.device("cpu"), torch.device("cuda")
    model = build_tiny_model(build_char_tokenizer())
    assert compile_layers(model, _asked(None), cpu, ONE_PROCESS, said.append, TRAIN_COMPILES_ON) is None
    assert compile_layers(model, _asked(None), cuda, ONE_PROCESS, said.append) is None  # precompute: when asked
    stats = compile_layers(model, _asked(None), cuda, ONE_PROCESS, said.append, TRAIN_COMPILES_ON)
    assert stats is not None and said[-1].endswith("(on by default on cuda; --no-torch-compile runs eagerly)")
    assert stats.mode == "default" and not stats.cuda_graphs and "mode" not in stats.report()
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    moe = MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=4, router_aux_loss_coef=0.02))
    assert compile_layers(moe, _asked(None), cuda, ONE_PROCESS, said.append, TRAIN_COMPILES_ON) is None
    assert "not by default for a mixture-of-experts model" in said[-1], said[-1]
    no_loss = SimpleNamespace(**vars(_asked(None)), router_aux_loss_coef=0.0)
    assert compile_layers(moe, no_loss, cuda, ONE_PROCESS, said.append, TRAIN_COMPILES_ON) is not None
    assert compile_layers(moe, _asked(True), cuda, ONE_PROCESS, said.append, TRAIN_COMPILES_ON) is not None
    model = build_tiny_model(build_char_tokenizer())
    assert compile_layers(model, _asked(True), cuda, DeepSpeed(2, zero_stage=3), said.append) is None
    assert said[-1].startswith("--torch-compile: DeepSpeed ZeRO-3 gathers") and said[-1].endswith("running eagerly")
    assert compile_layers(model, _asked(True), cuda, DeepSpeed(2, zero_stage=2), said.append) is not None
    model.model.layers = torch.nn.ModuleList()
    assert compile_layers(model, _asked(True), cpu, ONE_PROCESS, said.append) is None
    assert "has no decoder layers" in said[-1] and said[-1].endswith("running eagerly")


def test_cuda_graph_modes_compile_static_where_the_parameters_stay_and_mark_each_step_but_the_kl_forward(
    monkeypatch, request
):
    """--torch-compile-mode reduce-overhead / max-autotune (CUDA graphs): compiling is on without --torch-compile,
    static shapes with it; an engine that moves the parameters compiles without CUDA graphs; a forward begins a new
    step of CUDA graph trees except training's KL forward (no gradients, its micro-batch's backward to come); the
    layers' weights are not cast once a step (inside a graph a cast costs no launch); the report counts the graphs
    compiled without CUDA graphs, with inductor's reasons."""
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_utils import cudagraphs_log, log_cudagraph_skip_and_bump_counter

    from kto_pipeline.config.train import TrainConfig
    from kto_pipeline.demo.tiny import build_char_tokenizer, build_tiny_model
    from kto_pipeline.errors import KTOPipelineError
    from kto_pipeline.runtime import compiled
    from kto_pipeline.runtime.precision import policy_regime
    from kto_pipeline.scoring.products import StepCasts

    with pytest.raises(KTOPipelineError, match="drop --no-torch-compile"):
        TrainConfig(cache="c", output_dir="o", torch_compile=False, torch_compile_mode="reduce-overhead")
    with pytest.raises(KTOPipelineError, match="must be one of default, reduce-overhead"):
        TrainConfig(cache="c", output_dir="o", torch_compile_mode="fast")

    said, cuda = [], torch.device("cuda")
    model = build_tiny_model(build_char_tokenizer())
    limit = torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit)  # static raises it
    limit.__enter__()
    request.addfinalizer(lambda: limit.__exit__(None, None, None))
    stats = compiled.compile_layers(model, _asked(None, "reduce-overhead"), cuda, ONE_PROCESS, said.append)
    assert stats is not None and stats.cuda_graphs and stats.mode == "reduce-overhead", said
    assert stats.static_layouts, said  # the plan takes them for the layouts (`plan_scoring`)
    assert any("take a few fixed shapes (as under --static-shapes" in line for line in said), said
    assert said[-1].endswith("compiled region(s), mode reduce-overhead")
    plain = SimpleNamespace(gradient_checkpointing=False)
    assert StepCasts(SimpleNamespace(model=model), policy_regime(True, False), ONE_PROCESS, plain).linears == []

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    backbone = model.model
    for training, grad, marked in ((True, True, 1), (True, False, 0), (False, False, 1), (False, True, 1)):
        marks.clear()
        with torch.set_grad_enabled(grad):
            backbone.train(training)(torch.tensor([[1, 2, 3]]))  # the hook on the backbone's forward
        assert len(marks) == marked, (training, grad)

    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
    cudagraphs_log.warning("CUDAGraph supports dynamic shapes ... We have observed 9 distinct sizes. Please ...")
    report = stats.report()
    assert report["mode"] == "reduce-overhead" and report["cudagraph_skips"] >= 2, report
    assert report["cudagraph_skip_reasons"] == ["skipping cudagraphs due to mutated inputs"], report
    assert report["cudagraph_sizes"] == 9, report  # a warning, not a skip
    assert report["cudagraph_recorded_inputs"] == 0, report  # a CPU records no CUDA graph
    counters["inductor"]["cudagraph_recorded_non_static_inputs"] += 3  # (as inductor counts a graph recorded)
    assert stats.report()["cudagraph_recorded_inputs"] == 3
    counters["inductor"]["cudagraph_recorded_non_static_inputs"] -= 3  # (the process's count as it was)
    # inductor itself counts a graph of a CUDA graph mode that it runs without them (here: on a CPU)
    skipped = compiled._counts()["cudagraph_skips"]
    assert torch.compile(lambda x: x * 2 + 1, mode="reduce-overhead")(torch.ones(3)).sum() == 9
    assert compiled._counts()["cudagraph_skips"] > skipped

    # accumulating micro-batches, the gradients are allocated up front and zeroed in place: autograd adds each layer's
    # backward graph's output (its memory, overwritten by the next replay) into them, never keeps one as the gradient
    from kto_pipeline.runtime.engines.base import Engine

    for steps, in_place in ((2, True), (1, False)):
        engine = Engine(1)
        engine.make_accelerator(policy_regime(False, False), 1.0, 60, cpu=True, gradient_accumulation_steps=steps)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        _, optimizer, _ = engine.prepare_policy(model, model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        assert engine.gradients_in_place is in_place
        assert all((p.grad is not None and not p.grad.any()) for p in params) is in_place
        grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.ones_like(p) if p.grad is None else p.grad.fill_(1.0)  # a backward's gradients
        engine.accelerator.gradient_state._set_sync_gradients(True)
        engine.step(optimizer)
        if in_place:  # the same buffers, zeroed
            assert all(p.grad is g and not g.any() for p, g in zip(params, grads, strict=True))
        else:
            assert all(p.grad is None for p in params)

    sharded = SimpleNamespace(name="fsdp2", fixed_parameter_addresses=False, compile_refusal=None)
    for mode, without in (("reduce-overhead", "default"), ("max-autotune", "max-autotune-no-cudagraphs")):
        model = build_tiny_model(build_char_tokenizer())
        stats = compiled.compile_layers(model, _asked(None, mode), cuda, sharded, said.append)
        assert stats.mode == without and not stats.cuda_graphs, said[-2:]
        assert "fsdp2 may move the parameters" in said[-2] and "fixed shapes" not in said[-2]
        assert not stats.static_layouts  # no padding where no graph is recorded
        assert not model.model._forward_pre_hooks  # no steps of CUDA graph trees to mark
        again = compiled.compile_layers(model, _asked(None, mode, static=True), cuda, sharded, said.append)
        assert again.static_layouts  # --static-shapes given: kept
        # gradient checkpointing: recomputing a layer around its recorded graph is what CUDA graph trees cannot do
        model = build_tiny_model(build_char_tokenizer())
        stats = compiled.compile_layers(model, _asked(None, mode, checkpointing=True), cuda, ONE_PROCESS, said.append)
        assert stats.mode == without and not stats.cuda_graphs and "gradient checkpointing" in said[-2], said[-2:]
        assert not stats.static_layouts and not model.model._forward_pre_hooks


@pytest.mark.parametrize("kernel", ["by-tree", "dense"])
def test_compiled_layers_score_packed_as_padded_and_as_full_logits(kernel, monkeypatch):
    """The packed layout through compiled layers (prompts shared, trees side by side in rows) gives the eager model's
    full-logits log-probs, as the padded sequences through the same compiled layers do. Four trees: a row of three
    and a row of one, right-padded (attention by tree unrolls every tree into the compiled layer's graph, whose
    compiling grows with them)."""
    import torch
    from test_packing import ATOL, assert_same, full_logits_logps, make_model, padded_logps, random_trees

    from kto_pipeline.runtime.compiled import compile_layers
    from kto_pipeline.scoring.attention import attention_costs
    from kto_pipeline.scoring.logprobs import score_layout
    from kto_pipeline.scoring.packing import layout_trees

    model = make_model("llama")
    trees = random_trees(4)
    want = full_logits_logps(model, trees)  # eager, before compiling
    assert compile_layers(model, _asked(True), torch.device("cpu"), ONE_PROCESS, print) is not None
    assert_same(padded_logps(model, trees), want)
    layout = layout_trees(trees, rows=[[0, 1, 2], [3]], pad_id=5)
    with torch.no_grad():
        scores = score_layout(model, layout, attention_costs(model, kernel), chunk_size=5)
    assert_same(scores.per_sequence(), want)
    torch.testing.assert_close(scores.logps, torch.stack([w.sum() for w in want]), atol=10 * ATOL, rtol=0)


def test_static_shapes_compile_a_graph_a_shape_with_the_same_numbers(tmp_path, monkeypatch):
    """--static-shapes with compiled layers, both stages, in `--torch-compile-mode reduce-overhead` (CUDA graphs,
    which a CPU skips): a handful of static graphs, no recompile past the limit, the losses of the run without static
    shapes, and the padding counted in the token efficiency. A new step of CUDA graph trees is marked before each
    forward but training's KL forward: once a micro-batch in training (2 a step), once a forward in the reference
    pass. The shapes, graphs and marks are Dynamo's side and ours: aot_eager (inductor's kernels and its count of
    the graphs run without CUDA graphs: the other tests)."""
    import torch

    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.runtime import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model_dir = _tiny_model_dir(tmp_path)
    data = write_jsonl(tmp_path / "data.jsonl", unpaired_rows(32))
    runs, caches, marks, counted = {}, {}, {}, []
    mark = torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: counted.append(1) or mark())
    for static in (False, True):
        torch._dynamo.reset()
        settings = dict(attention_kernel="dense", torch_compile=None if static else True, static_shapes=static)
        if static:  # (a mode other than default compiles: --torch-compile unset)
            settings["torch_compile_mode"] = "reduce-overhead"
        out = PrecomputeConfig(model=str(model_dir), dataset=str(data), output=str(tmp_path / f"cache-{static}"))
        counted.clear()
        # (forwards of up to 4,096 tokens: the packing check's rows fit one forward packed and one alone)
        caches[static] = precompute(dataclasses.replace(out, max_length=128, max_tokens_per_batch=4096, **settings))
        marks[static, "precompute"] = len(counted)
        counted.clear()
        runs[static] = tmp_path / f"run-{static}"
        run = train_config(caches[static], runs[static], max_steps=4, per_device_train_batch_size=3, **settings)
        train(dataclasses.replace(run, gradient_accumulation_steps=2))  # (CUDA graphs: gradients kept in place)
        marks[static, "train"] = len(counted)
    for a, b in zip(read_metrics(runs[True]), read_metrics(runs[False]), strict=True):
        assert a.keys() == b.keys()  # (a step without undesirable rows logs no rewards/rejected)
        for key in {"loss", "grad_norm", "rewards/chosen", "rewards/rejected", "kl"} & a.keys():
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), key  # KL: a clamped mean of differences
    state = json.loads((runs[True] / "trainer_state.json").read_text())
    assert state["compile"]["graph_breaks"] == 0 and "recompile_limit" not in state["compile"], state["compile"]
    assert 2 <= state["compile"]["graphs"] <= 12, state["compile"]  # a graph a shape: a handful
    timing = {s: json.loads((caches[s] / "manifest.json").read_text())["timing"] for s in caches}
    assert timing[True]["tokens_needed"] == timing[False]["tokens_needed"]
    assert timing[True]["tokens_executed"] > timing[False]["tokens_executed"]  # the padding up to the static shapes
    assert state["compile"]["mode"] == timing[True]["compile"]["mode"] == "reduce-overhead", state["compile"]
    assert marks[False, "train"] == marks[False, "precompute"] == 0  # default mode: no CUDA graphs, no marks
    assert marks[True, "train"] == 8, marks  # 4 steps of 2 micro-batches: their KL forwards not marked
    # a forward a batch (the manifest counts them), and the packing check's two before the pass (its 8 rows packed,
    # then each sequence alone: 16 rows, one batch each)
    assert marks[True, "precompute"] == timing[True]["forwards"] + 2, marks


def _weight_casts(graphs) -> int:
    """Casts to bf16, in forward graphs, of float32 matrices that enter the graph (a linear layer's weight)."""
    import torch

    casts = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}
    count = 0
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op != "call_function" or node.target not in casts or not node.args:
                continue
            source, value = node.args[0], node.meta.get("val")
            given = getattr(source, "op", None) == "placeholder" and source.meta.get("val") is not None
            if given and source.meta["val"].dtype == torch.float32 and source.meta["val"].dim() == 2:
                count += value is not None and value.dtype == torch.bfloat16
    return count


def test_compiled_layers_under_bf16_take_their_weights_cast_once_a_step(tmp_path, monkeypatch):
    """Under bf16 autocast the compiled layers' graphs take the weights already cast (once a step, by `StepCasts`),
    where without it every call casts them inside the graph (the completions' forward and the KL completions', a
    kernel a weight); the losses are the eager run's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from kto_pipeline import PrecomputeConfig, precompute, train
    from kto_pipeline.runtime import compiled
    from kto_pipeline.runtime.engines.base import Engine

    model_dir = _tiny_model_dir(tmp_path)
    data = write_jsonl(tmp_path / "data.jsonl", unpaired_rows(16))
    config = PrecomputeConfig(model=str(model_dir), dataset=str(data), output=str(tmp_path / "cache"), max_length=64)
    cache = precompute(dataclasses.replace(config, bf16=True, attention_kernel="dense"))
    graphs: dict[str, list] = {}

    def recording(name):
        def forward_graph(graph, example_inputs):
            graphs.setdefault(name, []).append(graph)
            return make_boxed_func(graph.forward)

        return aot_autograd(fw_compiler=forward_graph, bw_compiler=lambda graph, _: make_boxed_func(graph.forward))

    runs = {}
    for name, once in (("eager", True), ("once a step", True), ("once a call", False)):
        import torch

        torch._dynamo.reset()
        monkeypatch.setattr(Engine, "caches_whole_casts", once)
        monkeypatch.setattr(compiled, "BACKEND", recording(name))
        runs[name] = tmp_path / name.replace(" ", "-")
        settings = dict(max_steps=3, bf16=True, attention_kernel="dense", torch_compile=name != "eager")
        train(train_config(cache, runs[name], **settings))
    assert "eager" not in graphs
    states = {name: json.loads((runs[name] / "trainer_state.json").read_text())["compile"] for name in graphs}
    for state in states.values():
        assert state["graph_breaks"] == 0 and "eager_fallback" not in state, state
    assert states["once a step"]["recompiles"] <= states["once a call"]["recompiles"], states
    per_step, per_call = _weight_casts(graphs["once a step"]), _weight_casts(graphs["once a call"])
    print("casts of float32 weights inside the compiled graphs: once a step", per_step, "once a call", per_call)
    assert per_step == 0 and per_call >= 7  # a tiny Llama layer's 7 linear weights
    metrics = {name: read_metrics(out) for name, out in runs.items()}
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "kl")
    assert metrics["once a step"][0]["rewards/chosen"] == 0 == metrics["once a step"][0]["rewards/rejected"]
    for a, b, c in zip(metrics["once a step"], metrics["once a call"], metrics["eager"], strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys]  # the same casts, made once or in every call
        for key in keys:  # (the KL completions on the prompts' cached keys/values, compiled as eager)
            assert a[key] == pytest.approx(c[key], rel=1e-3, abs=1e-6), key


def test_compiled_layers_with_gradient_checkpointing_stay_compiled_with_step_one_exact(tmp_path):
    """--torch-compile with --gradient-checkpointing (what a large model needs): the layers compile (torch.compile
    takes the checkpoint without the eager recomputation's attention context, the attention being in the graph), no
    graph break (the keys/values the checkpointed layers keep for the KL completions' forward are noted once, in the
    forward), no fallback, under bf16: the KL completions run on the prompts' cached keys/values as without
    checkpointing (one key/value head: small keys/values), and every step's numbers are those of the compiled run
    without checkpointing."""
    import torch

    from kto_pipeline import PrecomputeConfig, precompute, train

    model_dir = _tiny_model_dir(tmp_path, num_key_value_heads=1)
    data = write_jsonl(tmp_path / "data.jsonl", unpaired_rows(16))
    settings = dict(bf16=True, attention_kernel="dense", torch_compile=True)
    config = PrecomputeConfig(model=str(model_dir), dataset=str(data), output=str(tmp_path / "cache"), max_length=64)
    cache = precompute(dataclasses.replace(config, bf16=True, attention_kernel="dense"))  # both runs read it alike
    runs = {}
    for checkpointing in (True, False):
        # each run compiles from a fresh start (Dynamo's automatic dynamic shapes remember a process's earlier runs:
        # a second run compiling dynamic from its first step runs other kernels, rounding bf16 elsewhere)
        torch._dynamo.reset()
        runs[checkpointing] = tmp_path / f"run-{checkpointing}"
        run = train_config(cache, runs[checkpointing], max_steps=2, **settings)
        train(dataclasses.replace(run, gradient_checkpointing=checkpointing))
    state = json.loads((runs[True] / "trainer_state.json").read_text())
    assert state["compile"]["graphs"] > 0 and state["compile"]["graph_breaks"] == 0, state["compile"]
    assert "eager_fallback" not in state["compile"], state["compile"]
    assert json.loads((runs[False] / "trainer_state.json").read_text())["kl_forward"] == KL_ON_CACHED_PROMPTS
    assert json.loads((runs[True] / "trainer_state.json").read_text())["kl_forward"] == KL_ON_CACHED_PROMPTS
    with_checkpoints, without = read_metrics(runs[True]), read_metrics(runs[False])
    for key in ("rewards/chosen", "rewards/rejected", "kl"):  # step 1: the same forwards, to the bit
        assert with_checkpoints[0][key] == without[0][key], key
    # after step 1 the two runs' layers are two compiled graphs (checkpointing's recomputation partitions the backward
    # otherwise) computing in bf16, each rounding in its own places: they are held to one bf16 unit in the last place
    # (2**-8 relative), the most the layers' precision promises, and a reward (beta x a log-prob difference) to beta
    # x one such unit of a nat; on a CPU without bf16 kernels (float32 products rounded to bf16) step 2's grad norms
    # came 1.9e-3 apart, its rewards 8.7e-5
    beta = json.loads((runs[True] / "run_config.json").read_text())["beta"]
    for a, b in zip(with_checkpoints, without, strict=True):
        for key in ("loss", "grad_norm", "kl"):
            assert a[key] == pytest.approx(b[key], rel=2**-8, abs=1e-6), key
        for key in ("rewards/chosen", "rewards/rejected"):
            assert a[key] == pytest.approx(b[key], abs=beta * 2**-8), key


def test_a_step_counts_as_compiling_where_a_region_compiled_or_a_cuda_graph_was_recorded_since_the_last_step(
    monkeypatch,
):
    """`CompileStats.step_ended`: a step is noted where Dynamo compiled a frame (a first graph or a recompile) or
    CUDA graph trees recorded a graph (inductor's count of the recorded graphs' inputs grew: a function's second
    call, a new size) since the step before ended, and trainer_state.json's `compile` reports them
    (`compiling_steps`), none where none."""
    from types import SimpleNamespace

    import torch

    from kto_pipeline.runtime import compiled

    # at the start, a report, after each step (1 and 3 compiled, 2 and 5 recorded a CUDA graph), a report
    frames = iter([3, 3, 5, 5, 6, 6, 6, 6])
    recorded = iter([0, 0, 0, 4, 4, 4, 6, 6])
    counts = dict(cudagraph_skips=0, graphs=0, graph_breaks=0, seconds=0.0)
    monkeypatch.setattr(
        compiled, "_counts", lambda: dict(counts, frames=next(frames), cudagraph_recorded=next(recorded))
    )
    stats = compiled.CompileStats(SimpleNamespace(layers=[torch.nn.Linear(1, 1)]), say=lambda _: None)
    assert "compiling_steps" not in stats.report()
    for step in (1, 2, 3, 4, 5):
        stats.step_ended(step)
    assert stats.compiling_steps == [1, 2, 3, 5]
    assert stats.report()["compiling_steps"] == [1, 2, 3, 5]


def test_kept_keys_values_files_each_layer_or_keeps_nothing():
    """What compiled layers keep for the KL forward: a first forward files each layer's keys/values under its index;
    a later one hands each layer its own, followed by the new tokens'. Layers called out of order, or a call without
    an update, keep nothing (so the KL completions run with their prompts again) rather than another layer's."""
    import torch

    from kto_pipeline.scoring.keys_values import KeptKeysValues, keeping_keys_values

    def layer(i: int, updates: bool = True):
        def call(hidden, cache=None):
            keys = torch.full((1, 1, 2, 1), float(i))
            return cache.update(keys, keys + 10, i)[0] if updates else keys

        return keeping_keys_values(call, i)

    calls = [layer(i) for i in range(3)]
    kept = KeptKeysValues()
    for call in calls:
        call(None, cache=kept)
    assert kept.get_seq_length() == 2 and [float(k.keys[0, 0, 0, 0]) for k in kept.layers] == [0, 1, 2]
    assert [float(k.values[0, 0, 0, 0]) for k in kept.layers] == [10, 11, 12]
    keys = calls[1](None, cache=kept)  # the KL forward: layer 1's own, then the new
    assert keys.shape == (1, 1, 4, 1) and keys.eq(1).all() and kept.past is None and kept.latest is None
    for order in ((0, 2, 1), (1,)):
        shuffled = KeptKeysValues()
        for i in order:
            calls[i](None, cache=shuffled)
        assert shuffled.layers == [] and shuffled.get_seq_length() == 0, order
    silent = KeptKeysValues()
    calls[0](None, cache=silent)
    layer(1, updates=False)(None, cache=silent)
    calls[2](None, cache=silent)
    assert silent.layers == [] and silent.get_seq_length() == 0
    assert layer(0, updates=False)(None, cache=None).shape == (1, 1, 2, 1)  # no KeptKeysValues: the call as it is


def test_compile_seconds_count_the_backward_lowered_at_its_first_call():
    """compile.seconds (trainer_state.json, the manifest) counts all of the compiling: the backward graphs too, which
    AOT autograd lowers lazily at the first backward, outside Dynamo's compile (on a cold cache about as long as the
    forward's). Here a backward compiler that takes a second, as a cold one would."""
    import time

    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from kto_pipeline.runtime.compiled import _counts

    def slow_backward_compiler(graph, example_inputs):
        time.sleep(1.0)
        return make_boxed_func(graph.forward)

    backend = aot_autograd(
        fw_compiler=lambda graph, _: make_boxed_func(graph.forward), bw_compiler=slow_backward_compiler
    )
    f = torch.compile(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)), backend=backend
    )
    before = _counts()["seconds"]
    loss = f(torch.randn(8, 16)).sum()
    forward = _counts()["seconds"] - before
    started = time.perf_counter()
    loss.backward()  # the backward graph lowered now, at its first call
    backward = time.perf_counter() - started
    assert backward >= 1.0 and _counts()["seconds"] - before >= forward + 0.95 * backward
