"""The one exception type a user sees: it says what is wrong and what to do, and the CLI prints it
without a traceback. Anything else escaping is a bug and keeps its traceback."""


class KTOPipelineError(Exception):
    """A problem with the user's input, files or settings, with a message that names the fix."""


def decided_by_main_process(state, decide) -> dict:
    """Run `decide()` (returning a picklable dict) on the main process only and hand its answer to every process.

    A KTOPipelineError it raises is raised by every process, so that under `accelerate launch` a refusal stops the
    whole run instead of leaving the other processes waiting in a collective. `state`: accelerate's PartialState.
    """
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
