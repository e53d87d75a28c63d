"""`--torch-compile`: the decoder layer compiled once for every layer, and what compiling cost.

Compilation by region, as torchtitan and torchtune compile the repeated block: `nn.Module.compile` on each decoder
layer. With torch's default `inline_inbuilt_nn_modules` a layer's parameters are inputs of its graph, so every layer
runs the graphs compiled for the first one, and compile time does not grow with depth. A graph that wrote into the
step's `DynamicCache` at its layer index would specialise on that index, one graph per layer (measured: the recompile
limit reached at 4 layers). So training's first forward keeps its keys/values in a `KeptKeysValues` instead
(`scoring/keys_values.py`): a layer's graph hands its keys and values out as outputs, and its call's wrapper (outside
the graph) files them by layer, then hands each layer its own to the KL completions' forward, which runs on the
prompts' cached keys/values as in an eager run (the same graphs for every layer: the first forward's and the KL
forward's, for each shape and grad mode they meet, as without a cache). Not under static shapes: the KL completions
alone would take shapes of their own, a graph each, so they run with their prompts again, in the layout's static
shape (more FLOPs). The log-prob head's math of a chunk
(`scoring.head.softmax_stats` and `logits_grad`, in both stages) and training's loss (each family's loss
function, from its objective's forward) are regions of their own (`compiled_region`), with the number of tokens, rows
or pairs dynamic from the first call, so that a new batch size compiles nothing (but a size of 1, which Dynamo
specialises); the embedding, the layouts' gathers, the head's matmuls and the optimizer run eagerly.

Under gradient checkpointing a layer checkpoints inside its graph (`attention.enable_checkpointing`: while compiling,
without the eager recomputation's attention context, the attention being traced into the graph), noting the
keys/values it keeps once, in the forward (`_filing_once_under_checkpoints`).

Unset, training compiles on CUDA (measured on one H100: the step 2.03x the eager one's) and nowhere else (on the
CPU a run pays more in compiling than its steps save); the reference pass compiles only when asked (never timed on a
GPU). Where compiling
fails (a model without decoder layers, a backend that cannot build its kernels, Dynamo meeting what it cannot
trace), every region runs eagerly from then on, the run says why, and the numbers are the eager run's.

`--torch-compile-mode` (transformers' `torch_compile_mode`) is the layers' torch.compile mode. reduce-overhead and
max-autotune replay the layers as CUDA graphs (CUDA graph trees: each layer's call one recorded graph, replayed with
one launch; a path of them per shape, hence static shapes), where the parameters stay in place (one process, DDP).
Each forward but training's KL forward begins a new step of the trees (`_new_step_of_graphs`). Never run on a GPU
here: on a CPU inductor compiles the same graphs without CUDA graphs, and says so in `cudagraph_skips`.

`CompileStats` reads Dynamo's counters over a stage: graphs compiled, graph breaks, recompiles (the layer compiled
again for new guards: grad mode, a new shape) and seconds spent compiling; trainer_state.json and the cache's
manifest record them as `compile`, with `eager_fallback` (why the layers ran eagerly) and `recompile_limit`
(the shapes that passed Dynamo's recompile limit, after which new shapes run eagerly) where they happened. That
limit is raised where the user set none: to `DYNAMIC_RECOMPILE_LIMIT` (a layer's variants), or
`STATIC_RECOMPILE_LIMIT` under static shapes (a graph per shape).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from kto_pipeline.models import (
    COMPILED_LAYERS,
    STATIC_LAYERS,
    checkpointing,
    decoder_body,
    load_balancing_coef,
    scorable,
)
from kto_pipeline.runtime import CUDA_GRAPH_MODES

# torch.compile's backend for every region (the tests swap in one that fails; the GPU matrix's CPU rehearsal,
# aot_eager); a backend other than inductor is recorded with the stage's `compile`
BACKEND = "inductor"
WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
TRAIN_COMPILES_ON = ("cuda",)  # device types where training compiles when --torch-compile is unset
STATIC_RECOMPILE_LIMIT = 64  # with --static-shapes, Dynamo's recompile limit is raised to this (a graph per shape)
# Otherwise to this: a layer meets 4 calls (training's forward with gradients, its KL forward on the kept keys/values,
# evaluation's two in eval mode), each compiled static, then dynamic, then for one row (Dynamo specialises a size of
# 1); measured: 10 graphs of the layer in 16 steps evaluating at each, with one-row batches in both (torch's default
# limit, 8, passed by the 6th step)
DYNAMIC_RECOMPILE_LIMIT = 16
STATS = "_kto_compile_stats"  # on a model compiled by region: its CompileStats (the head and the loss ask it)
# Dynamo's switch for a Python side effect inside a checkpoint: applied once, in the forward, not in the recomputation
SIDE_EFFECTS_ONCE = "skip_fwd_side_effects_in_bwd_under_checkpoint"
WrapLayer = Callable[[Callable, int], Callable]  # (a layer's call, its index) -> the call the layer runs


def compile_layers(
    model, config, device, engine, say: Callable[[str], None], by_default=(), wrap_layer: WrapLayer | None = None
) -> CompileStats | None:
    """Compile each decoder layer of `model` (`backbone.layers`) in place where `config.torch_compile` asks (unset:
    where `config.torch_compile_mode` is not default, or `device`'s type is in `by_default`), in that mode;
    Dynamo's counters from then on. None where the layers run eagerly. `config.static_shapes`: the model's packed
    layouts take static shapes, and each compiles as a static graph. A mode that replays CUDA graphs: the layouts
    take static shapes too (a few shapes, a graph recorded for each), compiled as without them (one graph with
    dynamic shapes serving every shape after the first). `engine`: whether its parameters stay in place
    (`fixed_parameter_addresses`), which CUDA graphs need. `wrap_layer(call, index)`: each layer's call (compiled, or
    eager after a fallback) wrapped (training's: `scoring.keys_values.keeping_keys_values`). The layouts' shapes are
    the caller's to request: `static_layouts` of the stats (`config.static_shapes` where this returns None)."""
    mode, asked = config.torch_compile_mode, config.torch_compile
    asked = asked if asked is not None or mode == "default" else True  # a mode compiles, as transformers'
    static = config.static_shapes
    if not (asked if asked is not None else device.type in by_default):
        return None
    if engine is not None and engine.compile_refusal is not None:
        say(f"--torch-compile: {engine.compile_refusal}; running eagerly")
        return None
    if asked is None and load_balancing_coef(model, getattr(config, "router_aux_loss_coef", None)):
        say(
            "--torch-compile: not by default for a mixture-of-experts model trained with its load-balancing loss: "
            "transformers collects the router logits in hooks inside each layer, where a compiled layer's graph "
            "breaks (a tiny Mixtral on the CPU: 17 graph breaks and 30 recompiles in 3 steps); --torch-compile "
            "compiles it anyway"
        )
        return None
    backbone = decoder_body(model)
    layers = getattr(backbone, "layers", None)
    if layers is None or len(layers) == 0:
        say(
            f"--torch-compile: {type(model).__name__} has no decoder layers (`layers` of its backbone or language "
            "model); running eagerly"
        )
        return None
    if mode in CUDA_GRAPH_MODES:
        mode = _cuda_graph_mode(mode, static, device, engine, say, getattr(config, "gradient_checkpointing", False))
    static_layouts = static or mode in CUDA_GRAPH_MODES  # (a CUDA graph mode's, not where the engine ruled it out)
    stats = CompileStats(backbone, say, mode, wrap_layer, static_layouts)
    _raise_recompile_limit(STATIC_RECOMPILE_LIMIT if static else DYNAMIC_RECOMPILE_LIMIT)
    for index, layer in enumerate(layers):
        layer.compile(backend=BACKEND, dynamic=False if static else None, **_mode_option(mode))
        compiled = _guarded(layer._call_impl, layer._compiled_call_impl, stats)
        if checkpointing(model):
            compiled = _filing_once_under_checkpoints(compiled, layer)
        layer._compiled_call_impl = stats.wrapped(compiled, index)
    if stats.cuda_graphs:
        backbone.register_forward_pre_hook(_new_step_of_graphs)
    setattr(backbone, COMPILED_LAYERS, True)
    setattr(backbone, STATIC_LAYERS, static_layouts)
    setattr(scorable(model), STATS, stats)
    why = "" if asked else f" (on by default on {device.type}; --no-torch-compile runs eagerly)"
    say(f"{stats}{why}")
    return stats


_RAISED: set[int] = set()  # the recompile limits `_raise_recompile_limit` set


def _raise_recompile_limit(to: int) -> None:
    """Dynamo's recompile limit (`torch._dynamo.config.recompile_limit`, per compiled function: the graphs it keeps
    before new shapes run eagerly) raised to `to`, where it is torch's own or one this module set; a limit the user
    set (in code or the environment) stays as it is."""
    import torch._dynamo

    config = torch._dynamo.config
    is_default = getattr(config, "_is_default", lambda name: False)  # (a private helper: where missing, keep theirs)
    if (is_default("recompile_limit") or config.recompile_limit in _RAISED) and config.recompile_limit < to:
        config.recompile_limit = to
        _RAISED.add(to)


def _cuda_graph_mode(
    mode: str, static_asked: bool, device, engine, say: Callable[[str], None], checkpointing: bool = False
) -> str:
    """The mode the layers compile in, where `mode` replays CUDA graphs: the same where the engine keeps the
    parameters in place (the packed forwards then take static shapes; on a CPU too, which runs the same path
    without the graphs), else the mode without CUDA graphs; what it implies, said. Not under gradient
    checkpointing either: the backward recomputes each layer, and a checkpoint around a layer recorded as a CUDA
    graph fails in torch's CUDA graph trees (pytorch/pytorch#154306, open; transformers 5.17 checkpoints the
    layer's whole call, the compiled one included). Never tried on a GPU here."""
    if checkpointing:
        why = (
            "gradient checkpointing recomputes each layer in the backward, which CUDA graph trees cannot replay "
            "around a recorded layer (pytorch/pytorch#154306)"
        )
    elif not engine.fixed_parameter_addresses:
        why = f"{engine.name} may move the parameters between forwards, which recorded CUDA graphs cannot follow"
    else:
        why = None
    if why is not None:
        say(f"--torch-compile-mode {mode}: {why}; compiling in {WITHOUT_CUDA_GRAPHS[mode]} mode")
        return WITHOUT_CUDA_GRAPHS[mode]
    if not static_asked:
        say(
            f"--torch-compile-mode {mode}: a CUDA graph is recorded for each shape, so the packed forwards take a few "
            "fixed shapes (as under --static-shapes; the layers compile once for all of them)"
        )
    if device.type != "cuda":
        say(
            f"--torch-compile-mode {mode}: CUDA graphs replay on CUDA GPUs only; on {device.type} the layers run as "
            "compiled kernels, in the same fixed shapes"
        )
    return mode


def _mode_option(mode: str) -> dict:
    """torch.compile's `mode` argument: none for the default, nor for a backend other than inductor (which takes no
    mode: its graphs then run as that backend makes them, in the mode's fixed shapes)."""
    return {} if mode == "default" or BACKEND != "inductor" else {"mode": mode}


def _new_step_of_graphs(backbone, args) -> None:
    """Before a forward of a model whose layers replay CUDA graphs: a new step for CUDA graph trees
    (`torch.compiler.cudagraph_mark_step_begin`), so that the layers' graphs of one forward chain into one recorded
    path and what an earlier step's graphs returned may be overwritten. Not before training's KL forward (in training
    mode, without gradients): its micro-batch's backward, which reads the first forward's graphs' outputs, is still to
    run."""
    import torch

    if backbone.training and not torch.is_grad_enabled():
        return
    torch.compiler.cudagraph_mark_step_begin()


def _filing_once_under_checkpoints(call, layer):
    """A compiled layer's call under gradient checkpointing, where it checkpoints inside its graph: the keys/values it
    hands a `KeptKeysValues` (`update` notes them: a Python side effect within the checkpoint) are noted once, by
    the forward, and the backward's recomputation (in the compiled graph) notes nothing, as the eager layer's
    recomputation files nothing in a closed cache (`close_keys_values`). Dynamo graph-breaks on a side effect within
    a checkpoint unless told that this is so (`skip_fwd_side_effects_in_bwd_under_checkpoint`, which torchtitan
    sets too; read while tracing); a torch without that switch keeps no keys/values under checkpointing (the layer
    does not take the cache along: the KL completions run with their prompts again)."""
    import torch._dynamo

    if not hasattr(torch._dynamo.config, SIDE_EFFECTS_ONCE):
        layer._can_checkpoint_with_cache = False
        return call

    def call_noting_once(*args, **kwargs):
        with torch._dynamo.config.patch(**{SIDE_EFFECTS_ONCE: True}):
            return call(*args, **kwargs)

    return call_noting_once


def _guarded(eager_call, compiled_call, stats: CompileStats):
    """A region's compiled call; where compiling fails, every region runs eagerly from then on. Dynamo raises before
    the graph runs, so the call that failed runs again eagerly, nothing of it done twice."""
    from torch._dynamo.exc import TorchDynamoException

    def call(*args, **kwargs):
        if stats.eager_fallback is None:
            try:
                return compiled_call(*args, **kwargs)
            except TorchDynamoException as error:
                stats.fall_back(error)
        return eager_call(*args, **kwargs)

    return call


def compiled_region(owner, fn: Callable) -> Callable:
    """`fn` (the log-prob head, a loss) as a compiled region of the run where `owner`'s model was compiled by region
    (`owner`: the model, or a scorer wrapping it, as an engine may have wrapped it again), else `fn` itself."""
    stats = stats_of(owner)
    return fn if stats is None else stats.region(fn)


def stats_of(owner) -> CompileStats | None:
    """The CompileStats of the model `owner` is or wraps (a scorer, an engine's wrapper), where it was compiled by
    region."""
    from torch.nn import Module

    while hasattr(owner, "module"):  # DistributedDataParallel, DeepSpeed's engine
        owner = owner.module
    stats = getattr(scorable(owner), STATS, None)
    if stats is None and isinstance(getattr(owner, "model", None), Module):  # a scorer, or a causal LM's backbone
        stats = getattr(scorable(owner.model), STATS, None)
    return stats


def replays_cuda_graphs(owner) -> bool:
    """Whether the layers of the model `owner` is or wraps replay CUDA graphs (`--torch-compile-mode`)."""
    stats = stats_of(owner)
    return stats is not None and stats.cuda_graphs


def _dynamic_first_dims(*args) -> None:
    """The first dimension of every tensor argument dynamic from the first call (scored tokens, rows, pairs: a new
    count every batch), rather than from the first recompile."""
    import torch

    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(arg, 0)


# torch's timers of compiling (`compilation_time_metrics`): Dynamo's compiles (each graph traced and lowered, the
# forward's with them), and the backward graphs, which AOT autograd lowers lazily at their first backward, outside
# Dynamo's (on a cold cache about as long again)
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def _counts() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],  # graphs of a CUDA graph mode run without them
        # the inputs (not parameters or buffers) of the CUDA graphs recorded: grows with each one recorded; a skip
        # can go uncounted (inductor's graph partitions turn CUDA graphs off without one), this cannot
        "cudagraph_recorded": counters["inductor"]["cudagraph_recorded_non_static_inputs"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],  # compilations of a frame: a region's first, then its recompiles
        "seconds": sum(sum(compilation_time_metrics.get(key, ())) for key in COMPILE_TIMERS),
    }


class CompileStats:
    """Dynamo's counters from its making on (a process may compile before: FlexAttention's kernel, another stage),
    over the compiled regions: the decoder layers of `backbone`, then the head's and the loss's functions (`region`).
    `regions`: the distinct regions called (a layer forward counts once for every layer of its kind). `mode`: the
    layers' torch.compile mode; the head and the loss compile in it without CUDA graphs (their shapes change from
    batch to batch, and their outputs outlive a step's graphs: the metrics)."""

    def __init__(
        self,
        backbone,
        say: Callable[[str], None] = print,
        mode: str = "default",
        wrap_layer: WrapLayer | None = None,
        static_layouts: bool = False,
    ):
        self.backbone, self.say, self.mode = backbone, say, mode
        self.wrap_layer = wrap_layer  # each layer's call wrapped (`compile_layers`)
        self.static_layouts = static_layouts  # whether the packed layouts take static shapes (a graph each)
        self.layers, self.regions = len(backbone.layers), len({type(layer).forward for layer in backbone.layers})
        self.eager_fallback: str | None = None
        self.recompile_limit: str | None = None
        self.cudagraph_skip_reasons: list[str] = []  # inductor's reasons for running a graph without CUDA graphs
        self.cudagraph_sizes: int | None = None  # where inductor warned: the most sizes a function recorded
        self.compiled_regions: dict[Callable, Callable] = {}  # the head and the loss, each compiled once (`region`)
        self.start = _counts()
        self.compiling_steps: list[int] = []  # training's optimizer steps that compiled (`step_ended`)
        self._seen = (self.start["frames"], self.start["cudagraph_recorded"])  # at the last step's end
        _Heard.watch(_Heard.RECOMPILES, self.recompiled)
        _Heard.watch(_Heard.CUDA_GRAPHS, self.cuda_graphs_said)

    def wrapped(self, call: Callable, index: int) -> Callable:
        """Layer `index`'s `call` as the layers run it: wrapped by `wrap_layer` where there is one."""
        return call if self.wrap_layer is None else self.wrap_layer(call, index)

    @property
    def cuda_graphs(self) -> bool:
        """The layers replay CUDA graphs (where the device has them)."""
        return self.mode in CUDA_GRAPH_MODES

    def __str__(self) -> str:
        mode = "" if self.mode == "default" else f", mode {self.mode}"
        return f"torch.compile: {self.layers} decoder layers, {self.regions} compiled region(s){mode}"

    def region(self, fn: Callable) -> Callable:
        """`fn` compiled (once for the stage), with a fallback to `fn` itself, and every region eager, where compiling
        fails; `fn` itself once the stage runs eagerly."""
        if self.eager_fallback is not None:
            return fn
        if fn not in self.compiled_regions:
            import torch

            mode = _mode_option(WITHOUT_CUDA_GRAPHS.get(self.mode, self.mode))
            compiled, called = torch.compile(fn, backend=BACKEND, **mode), False

            def compiled_call(*args, **kwargs):
                nonlocal called
                if not called:  # a region counts from its first call (a stage may never call one: no backward)
                    self.regions, called = self.regions + 1, True
                _dynamic_first_dims(*args, *kwargs.values())
                return compiled(*args, **kwargs)

            call = _guarded(fn, compiled_call, self)
            self.compiled_regions[fn] = call
        return self.compiled_regions[fn]

    def fall_back(self, error: Exception) -> None:
        """Every region eager from now on (the layers' calls still wrapped by `wrap_layer`: training's
        files the keys/values a `KeptKeysValues` keeps, which the forward under way may hold)."""
        reason = " ".join(str(error).split())[:400] or type(error).__name__
        self.eager_fallback = f"{type(error).__name__}: {reason}"
        for index, layer in enumerate(self.backbone.layers):
            layer._compiled_call_impl = self.wrapped(layer._call_impl, index)
        setattr(self.backbone, STATIC_LAYERS, False)  # eager: the next forwards keep keys/values whatever the shapes
        self.say(f"--torch-compile: compiling failed; running eagerly ({self.eager_fallback})")

    def recompiled(self, message: str) -> None:
        """Dynamo's warning: where it passed its recompile limit, new shapes run eagerly (the same numbers, slower);
        the last reason, said and recorded."""
        if "recompile_limit" not in message and "cache_size_limit" not in message:
            return
        lines = [line.strip() for line in message.splitlines()]
        reason = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("last reason")), message)
        self.recompile_limit = reason
        import torch._dynamo

        limit = torch._dynamo.config.recompile_limit
        self.say(
            f"--torch-compile: a compiled region recompiled past torch's recompile limit ({limit}, "
            f"torch._dynamo.config.recompile_limit); new shapes now run eagerly. Last reason: {reason}"
        )

    def cuda_graphs_said(self, message: str) -> None:
        """Inductor's warnings about CUDA graphs: that a function recorded a graph for many distinct sizes (the
        number, kept), or that a graph of a CUDA device runs without CUDA graphs and why (an input on the CPU, a
        mutated input, an operation a graph cannot capture, too many re-recordings): each reason recorded once."""
        sizes = re.search(r"observed (\d+) distinct sizes", message)
        if sizes:
            self.cudagraph_sizes = max(self.cudagraph_sizes or 0, int(sizes.group(1)))
            return
        reason = re.sub(r" ?\(\d+ instances?\)", "", " ".join(message.split()))[:300]
        if reason not in self.cudagraph_skip_reasons:
            self.cudagraph_skip_reasons.append(reason)

    def step_ended(self, step: int) -> None:
        """Training's optimizer step `step` has ended: it is one that compiled where a region compiled (a first
        graph or a recompile) or a CUDA graph was recorded (a function's second call, each new size after) since
        the last step ended (an evaluation run between two steps counts for the next). A benchmark leaves those
        steps out of its median."""
        now = _counts()
        seen, self._seen = self._seen, (now["frames"], now["cudagraph_recorded"])
        if self._seen != seen:  # (counters: they only grow)
            self.compiling_steps.append(step)

    def report(self) -> dict:
        """{graphs, graph_breaks, recompiles, seconds} since the layers were compiled; with `eager_fallback` and
        `recompile_limit` where they happened; in another mode than default, `mode`, and where it replays CUDA
        graphs, `cudagraph_skips` (graphs that run without them: on a CPU every one), their reasons,
        `cudagraph_recorded_inputs` (the inputs of the graphs recorded: 0, none recorded) and `cudagraph_sizes` (a
        GPU's); in training, `compiling_steps` (the optimizer steps that compiled or recorded a CUDA graph);
        `backend` where it is not inductor."""
        now = {k: v - self.start[k] for k, v in _counts().items()}
        out: dict = {
            "graphs": int(now["graphs"]),
            "graph_breaks": int(now["graph_breaks"]),
            "recompiles": int(max(now["frames"] - self.regions, 0)),
            "seconds": round(now["seconds"], 3),
        }
        if self.mode != "default":
            out["mode"] = self.mode
        if BACKEND != "inductor":  # (a name, or a function's)
            out["backend"] = BACKEND if isinstance(BACKEND, str) else getattr(BACKEND, "__name__", repr(BACKEND))
        if self.cuda_graphs:
            out["cudagraph_skips"] = int(now["cudagraph_skips"])
            out["cudagraph_recorded_inputs"] = int(now["cudagraph_recorded"])
        extra = {
            "eager_fallback": self.eager_fallback,
            "recompile_limit": self.recompile_limit,
            "cudagraph_skip_reasons": self.cudagraph_skip_reasons,
            "cudagraph_sizes": self.cudagraph_sizes,
            "compiling_steps": self.compiling_steps,
        }
        return out | {k: v for k, v in extra.items() if v}


class _Heard(logging.Handler):
    """A torch logger's warnings handed to the stage's CompileStats (one stage at a time: a process's later stage
    replaces an earlier one's): Dynamo's recompiles, inductor's graphs compiled without CUDA graphs."""

    RECOMPILES = "torch._dynamo.convert_frame"
    CUDA_GRAPHS = "torch._inductor.cudagraph_utils.__cudagraphs"  # torch's `cudagraphs` logging artifact

    def __init__(self, hear: Callable[[str], None]):
        super().__init__(logging.WARNING)
        self.hear = hear

    @classmethod
    def watch(cls, name: str, hear: Callable[[str], None]) -> None:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, cls)]:
            logger.removeHandler(handler)
        logger.addHandler(cls(hear))

    def emit(self, record: logging.LogRecord) -> None:
        self.hear(record.getMessage())
