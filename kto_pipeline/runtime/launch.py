"""The launch: how many processes, their process group, who prints and who decides.

Both stages run once per process under `accelerate launch` or torchrun. accelerate's `PartialState` sets up the
process group from the launcher's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, ...) with a short
timeout, so that a process whose peers died stops instead of waiting for half an hour. Without a GPU the group
runs on the CPU over gloo. `print0` prints from the main process only (nanochat's `print0`); `main_decides` lets
the main process make a decision (take a lock, read the data, plan the output directory) and hands its answer, or
its refusal, to every process. `check_same_directory` stops a run on several machines whose output directory is not
on storage they all see.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kto_pipeline.errors import KTOPipelineError


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean variable of the launch environment, read as accelerate reads its own."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env(name, default)


def launched_processes() -> int:
    """How many processes the launcher started (torchrun and accelerate launch set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def one_process_device(command: str, why: str) -> torch.device:
    """The device of a command that runs in one process (`generate`): the GPU where there is one, else the CPU. A
    launch of several processes is refused, `why` saying what one process does that several would repeat."""
    if launched_processes() > 1:  # no collectives there: each process would do all of it
        raise KTOPipelineError(
            f"{command} runs in one process (this launch started {launched_processes()}): {why}. Run "
            f"`kto-pipeline {command} ...` without torchrun or accelerate launch."
        )
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


SHARED_CHECK_FILE = ".kto-pipeline.shared-check"


def where_this_runs() -> str:
    """This process as a multi-machine launch knows it: its rank, its node's rank (GROUP_RANK, which torchrun and
    accelerate launch set) and its host."""
    node = os.environ.get("GROUP_RANK")
    return ", ".join(
        [f"rank {os.environ.get('RANK', 0)}", *([f"node rank {node}"] if node is not None else [])]
        + [f"host {socket.gethostname()}"]
    )


def check_same_directory(state, path: str | Path, label: str) -> None:
    """Stop every process together unless each one sees the directory the main process has just prepared at `path`
    (`label`: the flag that names it, for the message).

    Every process writes into a stage's output directory (its cache shards, its part of a sharded checkpoint) and
    relies on what the main process wrote there, so on several machines it must be storage they all see, at the
    same path. A node-local path would give a cache or a checkpoint in pieces across machines, found out late or
    never. The main process writes a random token into PATH/.kto-pipeline.shared-check and broadcasts it; every
    other process reads that file at its own PATH; a gather tells every process who did not find the token, so
    all stop at once, the process that does not see the directory naming its node and path, the others naming it.
    The file is deleted again before anything else is written."""
    if state.num_processes == 1:
        return
    from accelerate.utils import gather_object

    path = Path(path)
    check_file = path / SHARED_CHECK_FILE

    def write_token() -> dict:
        import secrets

        token = secrets.token_hex(16)
        with open(check_file, "w") as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())  # so that another NFS client reads it (close-to-open)
        return {"token": token, "path": str(path.resolve()), "where": where_this_runs()}

    try:
        mark = main_decides(state, write_token)
        found = "the token" if state.is_main_process else _read_token(check_file, mark["token"])
        missing = [where for where in gather_object([None if found == "the token" else where_this_runs()]) if where]
    finally:
        if state.is_main_process:
            check_file.unlink(missing_ok=True)
    if not missing:
        return
    shared = (
        f"Every process writes into {label}, so on several machines it must be on storage every node sees, at the "
        f"same path: a shared filesystem (NFS, Lustre, GPFS, ...), not a node-local disk such as /tmp. Point {label} "
        "at such a path on every node."
    )
    if found != "the token":
        raise KTOPipelineError(
            f"{label} {path}: this process ({where_this_runs()}) does not see the directory the main process "
            f"({mark['where']}) writes into, {mark['path']}: the file it has just written there is {found} at "
            f"{check_file.resolve()} on this node. {shared}"
        )
    raise KTOPipelineError(
        f"{label} {mark['path']}: {len(missing)} process(es) do not see this directory, which the main process "
        f"({mark['where']}) writes into: {'; '.join(missing)} (each one's log names the path it sees). {shared}"
    )


def _read_token(check_file: Path, token: str, wait_seconds: float = 2.0) -> str:
    """What this process finds at `check_file`: "the token", "missing", "another run's" or "unreadable (why)" (read
    again for a short while: a network filesystem may show a new file to another machine with a delay). Never
    raises: every process must reach the gather that follows."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            found = "the token" if check_file.read_text() == token else "another run's"
        except (FileNotFoundError, NotADirectoryError):
            found = "missing"
        except (OSError, UnicodeDecodeError) as exc:
            found = f"unreadable ({getattr(exc, 'strerror', None) or exc})"
        if found == "the token" or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
