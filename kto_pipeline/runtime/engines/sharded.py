"""What the sharded engines (FSDP2, DeepSpeed ZeRO-3) share: glibc told to return the whole tensors a sharded load
gathers and frees at once, and the largest count over the processes (every process runs as many collective forwards
as the one with the most)."""

from __future__ import annotations

import os

import torch

MMAP_THRESHOLD = 128 << 10  # glibc's M_MMAP_THRESHOLD for a sharded load: what MALLOC_MMAP_THRESHOLD_=131072 sets
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_freed_buffers() -> bool:
    """Have glibc hand every freed buffer of 128 KiB or more back to the system at once: a sharded load broadcasts and
    all-gathers whole tensors that are freed a moment later, and glibc's default (a threshold that rises with the
    largest buffer freed) keeps them in the heap, where the process's memory grows by more than the model. The same as
    MALLOC_MMAP_THRESHOLD_=131072, which a user's own setting of it overrides; nothing outside glibc (True: set)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl, ...): its allocator decides
        return False


def most_of_all(count: int, device: torch.device) -> int:
    """The largest `count` of any process (all processes call this together)."""
    import torch.distributed as dist

    n = torch.tensor([count], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())
