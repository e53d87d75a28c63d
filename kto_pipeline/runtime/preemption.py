"""Preemption: a scheduler asks a run to stop, and the run stops where it can continue.

A scheduler that takes the machines back sends SIGTERM and kills the job some seconds later (SLURM with
`--signal=USR1@SECONDS` sends SIGUSR1 first; torchrun forwards SIGTERM to its workers, and SIGUSR1 too when told
to with `--signals-to-handle`, then waits `--shutdown-timeout` seconds, 30 by default). While a stage runs, both
signals only note the request (`StopRequests`). At each step boundary (train: every optimizer step; precompute:
every round of shards) the processes agree whether any of them was asked, in one small collective, so that all
stop at the same step: train writes a checkpoint there, precompute keeps the shards written so far, and the
stage ends with `errors.Preempted`, which the command line turns into exit status 75 (`PREEMPTED_EXIT`) and a
message with the command that continues the run. Training takes Ctrl-C (SIGINT) as a stop request too (exit
status 130, as an interrupted command's), where it would otherwise lose the steps since the last checkpoint.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from pathlib import Path

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
INTERRUPT_NOTE = (
    b"\nCtrl-C: stopping after this step, with a checkpoint to continue from. Ctrl-C again stops at once, losing "
    b"the steps since the last checkpoint.\n"
)


class StopRequests:
    """Within `with StopRequests() as stop:` SIGTERM and SIGUSR1 are noted instead of ending the process (their
    previous handlers come back on exit). `stop.agreed(device)` is a collective: every process calls it at the same
    step boundary and gets the signal any of them received (its name), or None.

    `interactive` (training, where an interruption would lose every step since the last checkpoint): Ctrl-C
    (SIGINT) is a stop request too, said at once; a second Ctrl-C stops at once (KeyboardInterrupt)."""

    def __init__(self, interactive: bool = False) -> None:
        self.received: int = 0  # the first signal's number; 0: none
        self.signals = (*STOP_SIGNALS, signal.SIGINT) if interactive else STOP_SIGNALS
        self._ctrl_c = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # Python handles signals in the main thread only
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            if self._ctrl_c:
                raise KeyboardInterrupt
            self._ctrl_c = True
            if os.environ.get("RANK", "0") == "0":  # (a terminal's Ctrl-C reaches every process of a launch)
                os.write(2, INTERRUPT_NOTE)  # (a signal handler may not use sys.stderr's buffer)
        self.received = self.received or signum

    def agreed(self, device: torch.device) -> str | None:
        """The stop signal any process received (all processes call this together), or None."""
        import torch.distributed as dist

        received = self.received
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([received], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            received = int(flag.item())
        return signal.Signals(received).name if received else None


def continue_command(add: str | None = None, unless: tuple[str, ...] = ()) -> str:
    """How to continue this run: the command line it was started with (`kto-pipeline ARGS`), with the flag `add`
    unless it or one of `unless` is there already; under a launcher, the same launch. Called from Python: the
    same call, with the flag's keyword."""
    args = sys.argv[1:]
    if add and any(flag in args for flag in (add, *unless)):
        add = None
    program = Path(sys.argv[0])
    if program.name != "kto-pipeline" and program.parts[-2:] != ("kto_pipeline", "__main__.py"):
        return "the same call again" + (f" with {add.removeprefix('--').replace('-', '_')}=True" if add else "")
    if add:
        args = [*args, add]
    command = shlex.join(["kto-pipeline", *args])
    return f"the same launch of `{command}`" if _launched() else f"`{command}`"


def _launched() -> bool:
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1
