"""`--torch-compile`: the decoder layer compiled once for every layer, and what compiling cost.

Compilation by region, as torchtitan and torchtune compile the repeated block: `nn.Module.compile` on each decoder
layer. With torch's default `inline_inbuilt_nn_modules` a layer's parameters are inputs of its graph, so every layer
runs the graphs compiled for the first one, and compile time does not grow with depth. That holds only where no
layer writes into a key/value cache: a graph that writes into the step's `DynamicCache` at its layer index
specialises on it, one graph per layer (measured: the recompile limit reached at 4 layers). So training's forward
keeps no keys/values under compiled layers (`models.keeps_keys_values`), and the KL completions run with their
prompts again, without gradients (more FLOPs, as under gradient checkpointing). The log-prob head's math of a chunk
(`scoring.head.softmax_stats` and `logits_grad`, in both stages) and training's loss (each family's loss
function, from its objective's forward) are regions of their own (`compiled_region`), with the number of tokens, rows
or pairs dynamic from the first call, so that a new batch size compiles nothing (but a size of 1, which Dynamo
specialises); the embedding, the layouts' gathers, the head's matmuls and the optimizer run eagerly.

Under gradient checkpointing a layer checkpoints inside its graph (`attention.enable_checkpointing`: while compiling,
without the eager recomputation's attention context, the attention being traced into the graph).

Unset, training compiles on CUDA (measured on one H100: the step 2.03x the eager one's) and nowhere else (on the
CPU its steps were slower); the reference pass compiles only when asked (never timed on a GPU). Where compiling
fails (a model without decoder layers, a backend that cannot build its kernels, Dynamo meeting what it cannot
trace), every region runs eagerly from then on, the run says why, and the numbers are the eager run's.

`CompileStats` reads Dynamo's counters over a stage: graphs compiled, graph breaks, recompiles (the layer compiled
again for new guards: grad mode, a new shape) and seconds spent compiling; trainer_state.json and the cache's
manifest record them as `compile`, with `eager_fallback` (why the layers ran eagerly) and `recompile_limit`
(the shapes that passed Dynamo's recompile limit, after which new shapes run eagerly) where they happened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kto_pipeline.models import COMPILED_LAYERS, backbone_of, scorable

BACKEND = "inductor"  # torch.compile's backend for the layers (the tests swap in one that fails)
TRAIN_COMPILES_ON = ("cuda",)  # device types where training compiles when --torch-compile is unset
STATIC_RECOMPILE_LIMIT = 64  # with --static-shapes, Dynamo's recompile limit is raised to this (a graph per shape)
STATS = "_kto_compile_stats"  # on a model compiled by region: its CompileStats (the head and the loss ask it)


def compile_layers(
    model, asked: bool | None, device, say: Callable[[str], None], by_default=(), static: bool = False
) -> CompileStats | None:
    """Compile each decoder layer of `model` (`backbone.layers`) in place where `asked` (unset: where `device`'s
    type is in `by_default`); Dynamo's counters from then on. None where the layers run eagerly. `static`
    (`--static-shapes`): the model's packed layouts take static shapes, and each compiles as a static graph."""
    from kto_pipeline.scoring.attention import request_static_shapes

    request_static_shapes(model, static)
    if not (asked if asked is not None else device.type in by_default):
        return None
    backbone = backbone_of(model)
    layers = getattr(backbone, "layers", None)
    if layers is None or len(layers) == 0:
        say(
            f"--torch-compile: {type(model).__name__} has no decoder layers (`layers` of its backbone); running eagerly"
        )
        return None
    stats = CompileStats(backbone, say)
    if static:  # a graph per shape: up to STATIC_RECOMPILE_LIMIT of them before new shapes run eagerly
        import torch._dynamo

        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, STATIC_RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile(backend=BACKEND, dynamic=False if static else None)
        layer._compiled_call_impl = _guarded(layer._call_impl, layer._compiled_call_impl, stats)
    setattr(backbone, COMPILED_LAYERS, True)
    setattr(scorable(model), STATS, stats)
    why = "" if asked else f" (on by default on {device.type}; --no-torch-compile runs eagerly)"
    say(f"{stats}{why}")
    return stats


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
    from torch.nn import Module

    while hasattr(owner, "module"):  # DistributedDataParallel, DeepSpeed's engine
        owner = owner.module
    stats = getattr(scorable(owner), STATS, None)
    if stats is None and isinstance(getattr(owner, "model", None), Module):  # a scorer, or a causal LM's backbone
        stats = getattr(scorable(owner.model), STATS, None)
    return fn if stats is None else stats.region(fn)


def _dynamic_first_dims(*args) -> None:
    """The first dimension of every tensor argument dynamic from the first call (scored tokens, rows, pairs: a new
    count every batch), rather than from the first recompile."""
    import torch

    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(arg, 0)


def _counts() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],  # compilations of a frame: a region's first, then its recompiles
        "seconds": sum(compilation_time_metrics.get("_compile.compile_inner", ())),
    }


class CompileStats:
    """Dynamo's counters from its making on (a process may compile before: FlexAttention's kernel, another stage),
    over the compiled regions: the decoder layers of `backbone`, then the head's and the loss's functions (`region`).
    `regions`: the distinct regions called (a layer forward counts once for every layer of its kind)."""

    def __init__(self, backbone, say: Callable[[str], None] = print):
        self.backbone, self.say = backbone, say
        self.layers, self.regions = len(backbone.layers), len({type(layer).forward for layer in backbone.layers})
        self.eager_fallback: str | None = None
        self.recompile_limit: str | None = None
        self.compiled_regions: dict[Callable, Callable] = {}  # the head and the loss, each compiled once (`region`)
        self.start = _counts()
        _RecompileLimit.watch(self)

    def __str__(self) -> str:
        return f"torch.compile: {self.layers} decoder layers, {self.regions} compiled region(s)"

    def region(self, fn: Callable) -> Callable:
        """`fn` compiled (once for the stage), with a fallback to `fn` itself, and every region eager, where compiling
        fails; `fn` itself once the stage runs eagerly."""
        if self.eager_fallback is not None:
            return fn
        if fn not in self.compiled_regions:
            import torch

            compiled, called = torch.compile(fn, backend=BACKEND), False

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
        """Every region eager from now on, and the key/value cache kept again, as in an eager run."""
        reason = " ".join(str(error).split())[:400] or type(error).__name__
        self.eager_fallback = f"{type(error).__name__}: {reason}"
        for layer in self.backbone.layers:
            layer._compiled_call_impl = None
        setattr(self.backbone, COMPILED_LAYERS, False)
        self.say(f"--torch-compile: compiling failed; running eagerly ({self.eager_fallback})")

    def limit_reached(self, message: str) -> None:
        """Dynamo passed its recompile limit: new shapes run eagerly (the same numbers, slower); the last reason."""
        lines = [line.strip() for line in message.splitlines()]
        reason = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("last reason")), message)
        self.recompile_limit = reason
        import torch._dynamo

        limit = torch._dynamo.config.recompile_limit
        self.say(
            f"--torch-compile: a compiled region recompiled past torch's recompile limit ({limit}, "
            f"torch._dynamo.config.recompile_limit); new shapes now run eagerly. Last reason: {reason}"
        )

    def report(self) -> dict:
        """{graphs, graph_breaks, recompiles, seconds} since the layers were compiled; with `eager_fallback` and
        `recompile_limit` where they happened."""
        now = {k: v - self.start[k] for k, v in _counts().items()}
        out: dict = {
            "graphs": int(now["graphs"]),
            "graph_breaks": int(now["graph_breaks"]),
            "recompiles": int(max(now["frames"] - self.regions, 0)),
            "seconds": round(now["seconds"], 3),
        }
        extra = {"eager_fallback": self.eager_fallback, "recompile_limit": self.recompile_limit}
        return out | {k: v for k, v in extra.items() if v}


class _RecompileLimit(logging.Handler):
    """Dynamo's warning that a frame passed its recompile limit, handed to the stage's CompileStats (one at a time:
    a process's later stage replaces an earlier one's)."""

    LOGGER = "torch._dynamo.convert_frame"

    def __init__(self, stats: CompileStats):
        super().__init__(logging.WARNING)
        self.stats = stats

    @classmethod
    def watch(cls, stats: CompileStats) -> None:
        logger = logging.getLogger(cls.LOGGER)
        for handler in [h for h in logger.handlers if isinstance(h, cls)]:
            logger.removeHandler(handler)
        logger.addHandler(cls(stats))

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.stats.limit_reached(message)
