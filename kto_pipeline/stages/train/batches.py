"""Stage 2's batches: the order of the items.

A loss family (`kto_pipeline/objectives`) reads its items from the memory-mapped cache (rows, or pairs) and
collates them (`objectives/items.py`). `EpochSampler` orders the items reproducibly from (seed, epoch); the
policy scores a batch through `step.PolicyScorer`.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Sampler


class EpochSampler(Sampler[int]):
    """Seeded shuffle that changes each epoch (or dataset order): reproducible from (seed, epoch).

    The epoch is set with `use_epoch`, not `set_epoch`: accelerate calls `set_epoch` with its own count of
    iterations of a loader, which restarts at 0 for the fresh loader of a resumed run.

    With `lengths` (the padded path), each run of `group` shuffled rows is sorted longest first, so that a
    batch holds rows of similar lengths and little padding (transformers' `group_by_length`).
    """

    def __init__(self, n: int, seed: int, shuffle: bool, lengths: np.ndarray | None = None, group: int = 0):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0
        self.lengths, self.group = lengths, group

    def use_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)  # 8 bytes a row, not a list
        if self.lengths is not None and self.group > 1:
            for start in range(0, self.n, self.group):
                chunk = order[start : start + self.group]
                order[start : start + self.group] = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
        return (int(i) for i in order)
