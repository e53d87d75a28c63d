"""Stage 2's batches: the order of the items and the policy's scores of a micro-batch.

A loss family (`kto_pipeline/objectives`) reads its items from the memory-mapped cache (rows, or pairs) and
collates them (`objectives/items.py`). `EpochSampler` orders the items reproducibly from (seed, epoch), and
`PolicyScorer` scores a batch through the model's `forward`, so that DDP and FSDP wrappers see the call: what it
runs follows from the batch's layout alone.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Sampler

from kto_pipeline.objectives.items import LAYOUT_KEY, batch_images, batch_layout
from kto_pipeline.scoring.logprobs import PolicyScores, score_layout, score_policy, score_sequences


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


class PolicyScorer(torch.nn.Module):
    """Wraps the causal LM so that scoring goes through `forward` (and thus through DDP/FSDP wrappers)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # FSDP's transformer-based auto wrap looks for the layer classes here
        self._no_split_modules = getattr(model, "_no_split_modules", None)

    def forward(self, batch, with_kl: bool = True, with_stats: bool = True, output_router_logits: bool = False):
        """The scores of the batch's sequences (with grad) and, with `with_kl` where the batch holds KL
        completions (laid out apart: `packed_batch(split_last=True)`, or `kl_` padded sequences), theirs without
        grad: `PolicyScores`. A packed batch without KL completions runs as one forward over its trees, each
        prompt once."""
        layout, images = batch_layout(batch), batch_images(batch)
        routed = {"output_router_logits": output_router_logits}
        if layout is not None and LAYOUT_KEY + "split" not in batch:  # every continuation with grad
            scores = score_layout(self.model, layout, with_stats=with_stats, images=images, **routed)
            return PolicyScores(scores, None, layout.input_ids.numel(), kl_on_cached_prompt=False)
        if layout is not None:
            return score_policy(self.model, layout, with_kl, with_stats=with_stats, images=images, **routed)
        completions = score_sequences(
            self.model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            with_stats=with_stats,
            output_router_logits=output_router_logits,
            images=images,
        )
        kl, executed = None, batch["input_ids"].numel()
        if with_kl and "kl_input_ids" in batch:
            with torch.no_grad():
                kl = score_sequences(
                    self.model,
                    batch["kl_input_ids"],
                    batch["kl_attention_mask"],
                    batch["kl_completion_mask"],
                    with_stats=False,
                    images=images,
                )
            executed += batch["kl_input_ids"].numel()
        return PolicyScores(completions, kl, executed, kl_on_cached_prompt=False)
