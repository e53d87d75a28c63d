"""The two things every process of a multi-process run must agree on: who prints, and who decides.

Under `accelerate launch` or torchrun each stage runs once per process. `print0` prints from the main process
only (nanochat's `print0`); `decided_by_main_process` lets the main process make a decision (read the data, plan
the output directory) and hands its answer, or its refusal, to every process. `state`: accelerate's
`PartialState` or an `Accelerator`.
"""

from __future__ import annotations

from kto_pipeline.errors import KTOPipelineError


def print0(state, text: str) -> None:
    """Print `text` on the main process only, flushed (progress bars share the terminal)."""
    if state.is_main_process:
        print(text, flush=True)


def decided_by_main_process(state, decide) -> dict:
    """Run `decide()` (returning a picklable dict) on the main process only and hand its answer to every process.

    A KTOPipelineError it raises is raised by every process, so that under `accelerate launch` a refusal stops the
    whole run instead of leaving the other processes waiting in a collective."""
    answer: list[dict] = [{}]
    if state.is_main_process:
        try:
            answer = [decide()]
        except KTOPipelineError as exc:
            answer = [{"error": str(exc)}]
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(answer)
    if "error" in answer[0]:
        raise KTOPipelineError(answer[0]["error"])
    return answer[0]
