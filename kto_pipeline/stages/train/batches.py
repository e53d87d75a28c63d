"""Stage 2's data: cache items -> micro-batches -> the policy's scores.

A loss family (`kto_pipeline/objectives`) reads its items from the memory-mapped cache (rows, or pairs) and
collates them with the helpers here: `packed_batch` lays trees out side by side in rows (`scoring/packing.py`,
no padding), `padded_batch` pads sequences for models that take no packed layout. `EpochSampler` orders the items
reproducibly from (seed, epoch), and `PolicyScorer` scores a batch through the model's `forward`, so that DDP and
FSDP wrappers see the call: what it runs follows from the batch's layout alone. `real_rows` tells which items of
an uneven last batch are real.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from kto_pipeline.cache import completion_room, token_sum
from kto_pipeline.scoring.logprobs import PolicyScores, pad_sequences, score_layout, score_policy, score_sequences
from kto_pipeline.scoring.packing import AttentionCosts, Layout, layout_trees, pack_rows

# a cache row's sequences after its prompt: (token ids, per-token reference log-probs, their sum)
COMPLETION = ("completion_ids", "ref_token_logps", "ref_logp")
KL_COMPLETION = ("kl_completion_ids", "ref_kl_token_logps", "ref_kl_logp")


def truncated(row: dict[str, Any], max_length: int, with_kl: bool) -> dict[str, Any]:
    """A cache row cut at a train-time `max_length`: each sequence after the prompt keeps the room the prompt leaves,
    its reference log-prob the sum of the kept tokens' cached values (what precomputing at that length gives)."""
    room = completion_room(row["prompt_ids"], max_length)
    for ids, logps, total in (COMPLETION, KL_COMPLETION) if with_kl else (COMPLETION,):
        if len(row[ids]) > room:
            row[ids] = row[ids][:room]
            row[logps] = row[logps][:room]
            row[total] = token_sum(row[logps])
    return row


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


LAYOUT_KEY = "layout_"  # batch keys of a packed layout's tensors


def packed_batch(trees, sizes: list[int], pad_id: int, attention: AttentionCosts | None, split_last: bool = False):
    """The batch tensors of `(prompt, [continuation, ...])` trees packed side by side in rows (`pack_rows` by
    `sizes`, `attention`: the model's costs); with `split_last`, each row's last continuations after the others
    (`layout_trees`), to run apart without gradients on the prompts' cached keys/values."""
    layout = layout_trees(trees, pack_rows(sizes, None, attention), pad_id, split_last=split_last)
    batch = {LAYOUT_KEY + k: v for k, v in vars(layout).items() if isinstance(v, torch.Tensor)}
    batch[LAYOUT_KEY + "num_trees"] = torch.tensor(layout.num_trees)
    batch[LAYOUT_KEY + "branches"] = torch.tensor(layout.branches)
    if split_last:
        batch[LAYOUT_KEY + "split"] = torch.tensor(layout.split)
    return batch


def padded_batch(items: list[dict[str, Any]], keys: tuple[str, ...], pad_id: int, prefix: str = ""):
    """`PREFIXinput_ids`, `PREFIXattention_mask` and `PREFIXcompletion_mask` of prompt + continuation sequences,
    item by item, each item's `keys` in order (a row's completion; a pair's chosen then rejected answer)."""
    seqs = [item["prompt_ids"] + item[key] for item in items for key in keys]
    prompt_lens = [len(item["prompt_ids"]) for item in items for _ in keys]
    padded = pad_sequences(seqs, prompt_lens, pad_id)
    names = (f"{prefix}input_ids", f"{prefix}attention_mask", f"{prefix}completion_mask")
    return dict(zip(names, padded, strict=True))


def batch_layout(batch: dict[str, torch.Tensor]) -> Layout | None:
    """The packed layout a packed batch carries (None for a padded batch)."""
    if LAYOUT_KEY + "input_ids" not in batch:
        return None
    fields = {k.removeprefix(LAYOUT_KEY): v for k, v in batch.items() if k.startswith(LAYOUT_KEY)}
    for name in ("num_trees", "branches"):
        fields[name] = int(fields[name])
    fields["split"] = int(fields["split"]) if "split" in fields else fields["input_ids"].shape[1]
    return Layout(**fields)


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
        layout = batch_layout(batch)
        if layout is not None and LAYOUT_KEY + "split" not in batch:  # every continuation with grad
            scores = score_layout(self.model, layout, with_stats=with_stats, output_router_logits=output_router_logits)
            return PolicyScores(scores, None, layout.input_ids.numel(), kl_on_cached_prompt=False)
        if layout is not None:
            return score_policy(
                self.model, layout, with_kl, with_stats=with_stats, output_router_logits=output_router_logits
            )
        completions = score_sequences(
            self.model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            with_stats=with_stats,
            output_router_logits=output_router_logits,
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
                )
            executed += batch["kl_input_ids"].numel()
        return PolicyScores(completions, kl, executed, kl_on_cached_prompt=False)


def real_rows(accelerator, batch_size: int, dataset_rows: int, last_batch: bool) -> torch.Tensor | None:
    """(B,) 1.0 for this process's real rows (pairs, for a pair loss), 0.0 for the rows accelerate repeats so that
    every process gets a full last batch (`even_batches`); None when the global batch has no repeated row.
    `batch_size`: the loader's per-process batch size. The same on every process, so that all take the same
    collectives. (Computed here: accelerate's own remainder is lost in a loader resumed with skip_first_batches.)"""
    remainder = dataset_rows % (batch_size * accelerator.num_processes)
    if accelerator.num_processes == 1 or not last_batch or remainder == 0:
        return None
    first = accelerator.process_index * batch_size  # the gathered global batch: process 0's rows, then 1's, ...
    positions = torch.arange(first, first + batch_size, device=accelerator.device)
    return (positions < remainder).float()
