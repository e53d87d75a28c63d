"""The launch: how many processes, their process group, who prints and who decides.

Both stages run once per process under `accelerate launch` or torchrun. accelerate's `PartialState` sets up the
process group from the launcher's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, ...) with a short
timeout, so that a process whose peers died stops instead of waiting for half an hour. Without a GPU the group
runs on the CPU over gloo. `print0` prints from the main process only (nanochat's `print0`); `main_decides` lets
the main process make a decision (take a lock, read the data, plan the output directory) and hands its answer, or
its refusal, to every process.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kto_pipeline.errors import KTOPipelineError


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean variable of the launch environment, read as accelerate reads its own."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env(name, default)


def launched_processes() -> int:
    """How many processes the launcher started (torchrun and accelerate launch set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def deepspeed_launch() -> bool:
    """`accelerate launch` with a DeepSpeed config (configs/accelerate/deepspeed_zero*.yaml) exports this. The
    process group depends on it (below); which engine runs is `engines.engine_for`'s choice."""
    return env_flag("ACCELERATE_USE_DEEPSPEED")


def use_cpu() -> bool:
    """Whether accelerate must run on the CPU: asked for (ACCELERATE_USE_CPU=1), or several processes launched on
    a machine without a GPU. Without the second, accelerate gives each torchrun process a world of its own.
    Never under DeepSpeed: accelerate's CPU mode silently drops DeepSpeed (the model would be DDP-wrapped);
    DeepSpeed runs on its own CPU accelerator, over gloo (`process_group_kwargs`)."""
    if deepspeed_launch():
        return False
    return env_flag("ACCELERATE_USE_CPU") or (launched_processes() > 1 and not torch.cuda.is_available())


def process_group_kwargs(timeout_seconds: int) -> dict:
    """What the process group is created with: how long a process waits for the others in a collective, and, for
    DeepSpeed on a machine without a GPU, gloo (accelerate would otherwise find no backend and give every process
    a world of its own)."""
    from datetime import timedelta

    kwargs: dict = {"timeout": timedelta(seconds=timeout_seconds)}
    if deepspeed_launch() and not torch.cuda.is_available():
        kwargs["backend"] = "gloo"
    return kwargs


def process_state(timeout_seconds: int = 1800):
    """accelerate's PartialState: one process, or one per device under accelerate launch / torchrun (without a GPU:
    the CPU and gloo). The first call in a process sets the process group up; later calls return the same state.
    A launch whose processes do not see each other is refused."""
    from accelerate import PartialState

    _join_restarted_group(timeout_seconds)
    state = PartialState(cpu=use_cpu(), **process_group_kwargs(timeout_seconds))
    check_process_group(state)
    return state


def _join_restarted_group(timeout_seconds: int) -> None:
    """Workers that torchrun restarted (`--max-restarts`) set their process group up in a key space of their own.

    torchrun's agent serves one key-value store to its workers and keeps it across restarts
    (`DynamicRendezvousHandler` shares its TCPStore; `torch.distributed.rendezvous` then connects the workers to it
    without a per-attempt prefix), so a restarted worker that asks for a peer's address before that peer has
    registered again reads the address the peer had in the failed attempt, and waits on a dead port until the
    group's timeout (measured here: gloo "Connect timeout" after 5 minutes, in one restart of two). Here the
    restarted workers build the group themselves on the same store under the prefix of their attempt, before
    accelerate, which then uses it."""
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_seconds)
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    backend = "gloo" if deepspeed_launch() and not torch.cuda.is_available() else None  # None: gloo, + nccl on GPUs
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"kto-pipeline/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        timeout=timeout,
    )


def check_process_group(state) -> None:
    """Refuse a launch whose processes do not see each other (each would believe it is alone and write the same
    output), naming how to launch instead."""
    if launched_processes() > 1 and state.num_processes == 1:
        raise KTOPipelineError(
            f"{launched_processes()} processes were launched (WORLD_SIZE), but accelerate set up a world of one: "
            "each process would run the whole stage alone. Launch with `accelerate launch` or torchrun; on a "
            "machine without a GPU export ACCELERATE_USE_CPU=1 (gloo)."
        )


def print0(state, text: str) -> None:
    """Print `text` on the main process only, flushed (progress bars share the terminal). `state`: accelerate's
    PartialState or an Accelerator."""
    if state.is_main_process:
        print(text, flush=True)


def shows_progress(state) -> bool:
    """Whether this process draws progress bars: the main process only, and none where TQDM_DISABLE is set (the
    variable tqdm and the HF libraries honour)."""
    return state.is_main_process and not env_flag("TQDM_DISABLE")


def main_decides(state, decide: Callable[[], dict]) -> dict:
    """Run `decide()` (returning a picklable dict) on the main process only and hand its answer to every process.

    If it fails, every process fails: the main process raises its own exception, the others a KTOPipelineError
    with its message, so that under `accelerate launch` a refusal stops the whole run instead of leaving the other
    processes waiting in a collective."""
    answer: list[dict] = [{}]
    failure = None
    if state.is_main_process:
        try:
            answer = [decide()]
        except Exception as exc:  # any failure: the other processes must not wait for the main one
            answer, failure = [{"error": str(exc)}], exc
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(answer)
    if failure is not None:
        raise failure
    if "error" in answer[0]:
        raise KTOPipelineError(answer[0]["error"])
    return answer[0]


def most_of_all(count: int, device: torch.device) -> int:
    """The largest `count` of any process (all processes call this together)."""
    import torch.distributed as dist

    n = torch.tensor([count], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())
