"""How a process runs, decided in one place; the stages ask, never decide.

    launch.py     the process group from the launch environment (torchrun, `accelerate launch`), its short
                  timeout, `print0`, and `main_decides`: the main process decides, every process follows
    precision.py  the precision regime, resolved once from the config and the device; autocast; the mismatch check;
                  the layers' weights cast once a step
    compiled.py   `--torch-compile`: the decoder layer compiled once for every layer; what compiling cost
    engines/      one class per engine behind one interface (`engines/base.py`); `engine_for` picks one from the
                  launch environment: one process or DDP, FSDP2, DeepSpeed ZeRO-2/3

As Lightning Fabric's `Strategy` and torchtune's `training.shard_model`: a stage asks its engine to prepare the
model, step and save; it never tests which engine runs.
"""

# what `--torch-compile` says (both stages), here so that the command line reads it without loading torch
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that replay CUDA graphs
STATIC_SHAPES_HELP = (
    "Pad every packed forward to one of a few fixed shapes (rows a power of two; width 64, 80, 96, 112, 128, 160, "
    "...: 4 sizes a doubling, at most 25% padding, counted in the token efficiency). With compiled layers each shape "
    "compiles as one static graph (no dynamic shapes), what CUDA graphs need. Off by default."
)
TORCH_COMPILE_HELP = (
    "Compile the decoder layer once for every layer, the log-prob head's softmax and the loss (torch.compile, by "
    "region): fewer ops dispatched a step. The first steps pay the compile; under static shapes (--static-shapes, or a "
    "CUDA graph --torch-compile-mode) training's KL completions run with their prompts again (alone, each of their "
    "shapes would compile a graph). Unset: train "
    "compiles on CUDA GPUs (measured 2x faster steps on an H100) and not on the CPU (there the compile costs more "
    "than it saves); precompute only when asked. Where compiling fails the run says why and runs eagerly."
)
TORCH_COMPILE_MODE_HELP = (
    "torch.compile's mode for the decoder layers (transformers' torch_compile_mode): default, reduce-overhead (the "
    "layers replayed as CUDA graphs on a CUDA GPU: a launch a layer call; the packed forwards take --static-shapes' "
    "few shapes, a graph recorded for each, compiled once for all unless --static-shapes is given), max-autotune "
    "(autotuned kernels and CUDA graphs), max-autotune-no-cudagraphs. A mode other than default turns --torch-compile "
    "on. CUDA graphs run on one process or DDP (not under FSDP2, which gathers the parameters anew, DeepSpeed, or "
    "gradient checkpointing) and have never run on a GPU here; elsewhere the layers run as compiled kernels. "
    "trainer_state.json and the manifest count the graphs that ran without CUDA graphs, with torch's reasons."
)
