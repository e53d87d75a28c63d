"""`--torch-compile`: the decoder layer compiled once for every layer, and what compiling cost.

Compilation by region, as torchtitan and torchtune compile the repeated block: `nn.Module.compile` on each decoder
layer. With torch's default `inline_inbuilt_nn_modules` a layer's parameters are inputs of its graph, so every layer
runs the graphs compiled for the first one, and compile time does not grow with depth. That holds only where no
layer writes into a key/value cache: a graph that writes into the step's `DynamicCache` at its layer index
specialises on it, one graph per layer (measured: the recompile limit reached at 4 layers). So training's forward
keeps no keys/values under compiled layers (`models.keeps_keys_values`), and the KL completions run with their
prompts again, without gradients (more FLOPs, as under gradient checkpointing). The embedding, the log-prob head,
the loss and the optimizer run eagerly.

`CompileStats` reads Dynamo's counters over a stage: graphs compiled, graph breaks, recompiles (the layer compiled
again for new guards: grad mode, a new shape) and seconds spent compiling; trainer_state.json and the cache's
manifest record them as `compile`.
"""

from __future__ import annotations

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.models import COMPILED_LAYERS, backbone_of


def compile_layers(model) -> CompileStats:
    """Compile each decoder layer of `model` (`backbone.layers`) in place; Dynamo's counters from then on."""
    backbone = backbone_of(model)
    layers = getattr(backbone, "layers", None)
    if layers is None or len(layers) == 0:
        raise KTOPipelineError(
            f"--torch-compile: {type(model).__name__} has no decoder layers (`layers` of its backbone) to compile; "
            "run without --torch-compile"
        )
    stats = CompileStats(len(layers), len({type(layer).forward for layer in layers}))
    for layer in layers:
        layer.compile()
    setattr(backbone, COMPILED_LAYERS, True)
    return stats


def _counts() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],  # compilations of a frame: a region's first, then its recompiles
        "seconds": sum(compilation_time_metrics.get("_compile.compile_inner", ())),
    }


class CompileStats:
    """Dynamo's counters from its making on (a process may compile before: FlexAttention's kernel, another stage).
    `regions`: the distinct layer forwards compiled, each once for every layer of its kind."""

    def __init__(self, layers: int, regions: int):
        self.layers, self.regions = layers, regions
        self.start = _counts()

    def __str__(self) -> str:
        return f"torch.compile: {self.layers} decoder layers, {self.regions} compiled region(s)"

    def report(self) -> dict[str, float]:
        """{graphs, graph_breaks, recompiles, seconds} since the layers were compiled."""
        now = {k: v - self.start[k] for k, v in _counts().items()}
        return {
            "graphs": int(now["graphs"]),
            "graph_breaks": int(now["graph_breaks"]),
            "recompiles": int(max(now["frames"] - self.regions, 0)),
            "seconds": round(now["seconds"], 3),
        }
