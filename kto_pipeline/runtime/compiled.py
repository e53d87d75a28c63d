"""`--torch-compile`: the decoder layer compiled once for every layer, and what compiling cost.

Regional compilation, as torchtitan and torchtune compile: `nn.Module.compile` on each decoder layer. With torch's
default `inline_inbuilt_nn_modules`, a layer's parameters are inputs of its graph, so every layer of a model runs
the graphs compiled for the first one, and compile time does not grow with depth. The rest of a step (embedding,
final norm, the chunked log-prob head, the loss, the optimizer) runs eagerly.

`CompileStats` reads Dynamo's counters over a stage: graphs compiled, graph breaks, recompiles (a code object
compiled again for new guards: another shape, grad mode or cache), and the seconds spent compiling. trainer_state.json
and the cache's manifest record them as `compile`.
"""

from __future__ import annotations

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.models import backbone_of


def compile_layers(model) -> int:
    """Compile each decoder layer of `model` in place (`backbone.layers`); the number of layers."""
    layers = getattr(backbone_of(model), "layers", None)
    if layers is None or len(layers) == 0:
        raise KTOPipelineError(
            f"--torch-compile: {type(model).__name__} has no decoder layers (`layers` of its backbone) to compile; "
            "run without --torch-compile"
        )
    for layer in layers:
        layer.compile()
    return len(layers)


def _counts() -> dict[str, float]:
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import compilation_time_metrics, counters

    codes = getattr(getattr(convert_frame, "input_codes", None), "seen", ())
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],
        "codes": len(codes),
        "seconds": sum(compilation_time_metrics.get("_compile.compile_inner", ())),
    }


class CompileStats:
    """Dynamo's counters from now on (a process may compile before: FlexAttention's kernel, another stage)."""

    def __init__(self):
        self.start = _counts()

    def report(self) -> dict[str, float]:
        """{graphs, graph_breaks, recompiles, seconds} since this object was made."""
        now = {k: v - self.start[k] for k, v in _counts().items()}
        return {
            "graphs": int(now["graphs"]),
            "graph_breaks": int(now["graph_breaks"]),
            "recompiles": int(max(now["frames"] - now["codes"], 0)),
            "seconds": round(now["seconds"], 3),
        }
