"""Each process's peak memory, recorded by both stages (manifest.json's timing, trainer_state.json), so that a user
sees how the memory was spread over the processes and where it was not.

Per process, from the start of the stage:
  - `host_private_mib`: the peak of its private resident memory (`RssAnon` in /proc/self/status, sampled every
    10 ms by a daemon thread). Weights memory-mapped from the page cache (safetensors) are shared between
    processes and not counted: this is the memory a process adds to the machine's.
  - `loaded_host_private_mib`: the same peak up to the moment the model was loaded and placed by the engine (read,
    then sharded or partitioned, with what the engine allocates for it up front: DeepSpeed builds its optimizer
    state there, torch's AdamW at the first step), before any batch ran: what loading cost, apart from the stage's
    own work (a pass's gathered layers and activations, a step's gradients and optimizer state).
  - `host_rss_mib`: its peak resident set as the kernel tracks it (`VmHWM`), file-backed pages included.
  - `accelerator_mib`: torch's peak allocated accelerator memory (`torch.cuda.max_memory_allocated`), None on
    the CPU.
"""

from __future__ import annotations

import threading

import torch

MIB = 1 << 20
THREAD_NAME = "kto-pipeline peak memory"  # the sampling thread's


def _status_kib(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status, in KiB ({} where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {key: int(fields[key].split()[0]) for key in keys if key in fields}


class PeakMemory:
    """Samples this process's private memory while the `with` block runs: a stage holds one from its first check to
    its end, whichever way it ends (an error, an append with no new rows), so no sampling thread outlives it."""

    def __init__(self, interval_seconds: float = 0.01):
        if torch.cuda.is_initialized():  # from the start of the stage, not of the process (an earlier stage's peak)
            torch.cuda.reset_peak_memory_stats()
        self.peak_private_kib = _status_kib("RssAnon").get("RssAnon", 0)
        self.loaded_private_kib: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval_seconds,), name=THREAD_NAME, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._now()

    def _now(self) -> int:
        """The peak so far, this moment included."""
        self.peak_private_kib = max(self.peak_private_kib, _status_kib("RssAnon").get("RssAnon", 0))
        return self.peak_private_kib

    def loaded(self) -> None:
        """The model is loaded: the peak so far is loading's."""
        self.loaded_private_kib = self._now()

    def mine(self, rank: int) -> dict:
        """This process's peaks so far."""
        self._now()
        loaded = self.loaded_private_kib
        accelerator = torch.cuda.max_memory_allocated() / MIB if torch.cuda.is_initialized() else None
        return {
            "rank": rank,
            "host_private_mib": round(self.peak_private_kib / 1024, 1),
            "loaded_host_private_mib": None if loaded is None else round(loaded / 1024, 1),
            "host_rss_mib": round(_status_kib("VmHWM").get("VmHWM", 0) / 1024, 1),
            "accelerator_mib": None if accelerator is None else round(accelerator, 1),
        }

    def per_process(self, state) -> list[dict]:
        """Every process's peaks, by rank (a collective: all processes call it)."""
        from accelerate.utils import gather_object

        mine = self.mine(state.process_index)
        return sorted(gather_object([mine]) if state.num_processes > 1 else [mine], key=lambda m: m["rank"])


def describe(peaks: list[dict]) -> str:
    """ "rank 0 1234 MiB (loading 1100), rank 1 567 MiB (loading 500)" (private host memory; accelerator memory
    after a slash where there is one)."""

    def one(m: dict) -> str:
        accelerator = "" if m["accelerator_mib"] is None else f" / {m['accelerator_mib']:.0f} on the accelerator"
        loading = "" if m.get("loaded_host_private_mib") is None else f" (loading {m['loaded_host_private_mib']:.0f})"
        return f"rank {m['rank']} {m['host_private_mib']:.0f} MiB{loading}{accelerator}"

    return ", ".join(one(m) for m in peaks)
