"""Stage 2's data: cache rows -> micro-batches -> the policy's scores.

`CacheRows` reads rows of the memory-mapped cache (truncated to the train-time max length), or, for a pair
loss, `CachePairs` reads its (chosen, rejected) pairs; `EpochSampler` orders them reproducibly from (seed,
epoch); `Collator` (`PairCollator`) lays a micro-batch out packed (`scoring/packing.py`: each row's prompt,
completion and KL completion as one tree, or each pair's prompt, chosen and rejected answers, no padding) or
padded for models that take no packed layout; and `PolicyScorer` scores a batch through the model's `forward`,
so that DDP and FSDP wrappers see the call. `real_rows` tells which rows of an uneven last batch are real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset, Sampler

from kto_pipeline.cache import NO_PAIR, CacheTable, completion_room, token_sum
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.loss import length_desensitized
from kto_pipeline.scoring.logprobs import PolicyScores, pad_sequences, score_layout, score_policy, score_sequences
from kto_pipeline.scoring.packing import AttentionCosts, Layout, layout_trees, pack_rows


class CacheRows(Dataset):
    """Rows of a memory-mapped cache, truncated to a train-time `max_length`.

    Truncating at L < the cached max length gives exactly what precomputing at L would have: the
    first L - len(prompt) completion tokens, and as reference log-prob the sum of their cached
    per-token values (a causal model's log-prob of a token does not depend on what follows it).
    Rows whose prompt reaches L are dropped, as precompute would drop them.
    """

    def __init__(self, cache: CacheTable, max_length: int):
        self.table = cache.table
        self.max_length = max_length
        self.truncate = max_length < cache.manifest.max_length
        prompt_lens = pc.list_value_length(self.table.column("prompt_ids")).to_numpy()
        self.indices = np.flatnonzero(prompt_lens < max_length)
        self.labels = self.table.column("label").to_numpy(zero_copy_only=False)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def lengths(self) -> np.ndarray:
        """Tokens of each row's prompt + completion (truncated at max_length): for grouping by length."""
        take = self.table.select(["prompt_ids", "completion_ids"]).take(self.indices)
        total = sum(pc.list_value_length(take.column(c)).to_numpy().astype(np.int64) for c in take.column_names)
        return np.minimum(total, self.max_length)

    def prompt_groups(self) -> dict[int, int]:
        """example_id -> a number shared by every row with the same prompt (for pairwise metrics)."""
        groups: dict[tuple[int, ...], int] = {}
        out = {}
        rows = self.table.select(["example_id", "prompt_ids"]).take(self.indices)
        for example_id, prompt in zip(
            rows.column("example_id").to_pylist(), rows.column("prompt_ids").to_pylist(), strict=True
        ):
            out[example_id] = groups.setdefault(tuple(prompt), len(groups))
        return out

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.table.slice(int(self.indices[i]), 1).to_pylist()[0]
        return truncated(row, self.max_length, with_kl=True) if self.truncate else row


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


class CachePairs(Dataset):
    """The (chosen, rejected) pairs of a paired cache (format version 2 records each row's partner), what a pair
    loss trains on: one item a pair, in the order of the source rows, each answer truncated to a train-time
    `max_length` as `CacheRows` truncates a row (trl.DPOTrainer's `keep_start`). Pairs whose prompt reaches
    `max_length` are dropped, as trl drops them."""

    def __init__(self, cache: CacheTable, max_length: int):
        # the columns a pair needs (not the KL completions', which a pair loss never reads)
        self.table = cache.table.select(["example_id", "label", "prompt_ids", "pair_example_id", *COMPLETION])
        self.max_length = max_length
        self.truncate = max_length < cache.manifest.max_length
        ids = self.table.column("example_id").to_numpy()
        partner = self.table.column("pair_example_id").to_numpy()
        label = self.table.column("label").to_numpy(zero_copy_only=False)
        prompt_lens = pc.list_value_length(self.table.column("prompt_ids")).to_numpy()
        order = np.argsort(ids, kind="stable")
        chosen = np.flatnonzero((partner != NO_PAIR) & label & (prompt_lens < max_length))
        rejected = order[np.searchsorted(ids, partner[chosen], sorter=order)]
        first = np.argsort(np.minimum(ids[chosen], ids[rejected]), kind="stable")  # the source rows' order
        self.chosen, self.rejected = chosen[first], rejected[first]

    def __len__(self) -> int:
        return len(self.chosen)

    def lengths(self) -> np.ndarray:
        """Tokens of each pair's longer sequence, prompt + answer (truncated at max_length): for grouping by
        length on the padded path."""

        def total(rows):
            take = self.table.select(["prompt_ids", "completion_ids"]).take(rows)
            return sum(pc.list_value_length(take.column(c)).to_numpy().astype(np.int64) for c in take.column_names)

        return np.minimum(np.maximum(total(self.chosen), total(self.rejected)), self.max_length)

    def _row(self, index: int) -> dict[str, Any]:
        row = self.table.slice(int(index), 1).to_pylist()[0]
        return truncated(row, self.max_length, with_kl=False) if self.truncate else row

    def __getitem__(self, i: int) -> dict[str, Any]:
        chosen, rejected = self._row(self.chosen[i]), self._row(self.rejected[i])
        if chosen["prompt_ids"] != rejected["prompt_ids"]:  # (precompute pairs only rows whose prompts tokenized alike)
            raise KTOPipelineError(
                f"examples {chosen['example_id']} and {rejected['example_id']} are recorded as a pair but their "
                "prompts tokenized differently. Precompute the data again with this version."
            )
        return {
            "prompt_ids": chosen["prompt_ids"],
            "chosen_ids": chosen["completion_ids"],
            "rejected_ids": rejected["completion_ids"],
            "ref_chosen_token_logps": chosen["ref_token_logps"],
            "ref_rejected_token_logps": rejected["ref_token_logps"],
            "ref_chosen_logp": chosen["ref_logp"],
            "ref_rejected_logp": rejected["ref_logp"],
            "chosen_id": chosen["example_id"],
            "rejected_id": rejected["example_id"],
        }


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


@dataclass
class Collator:
    """Rows -> one micro-batch. `packed`: the rows' `(prompt, [completion, KL completion])` trees side by side in
    rows (`packing.pack_rows`), prompts and completions first and the KL completions
    after them (`layout_trees(split_last=True)`); else padded sequences, completions and KL completions apart."""

    pad_id: int
    packed: bool = True
    attention: AttentionCosts | None = None  # `packing.attention_costs` of the model: how wide packed rows should be

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        if self.packed:
            trees = [(r["prompt_ids"], [r["completion_ids"], r["kl_completion_ids"]]) for r in rows]
            sizes = [len(p) + len(c) for p, (c, _) in trees]  # the KL completions run apart, in one unpadded row
            layout = layout_trees(trees, pack_rows(sizes, None, self.attention), self.pad_id, split_last=True)
            batch.update({LAYOUT_KEY + k: v for k, v in vars(layout).items() if isinstance(v, torch.Tensor)})
            batch[LAYOUT_KEY + "split"] = torch.tensor(layout.split)
        else:
            prompt_lens = [len(r["prompt_ids"]) for r in rows]
            for prefix, key in (("", "completion_ids"), ("kl_", "kl_completion_ids")):
                padded = pad_sequences([r["prompt_ids"] + r[key] for r in rows], prompt_lens, self.pad_id)
                names = (f"{prefix}input_ids", f"{prefix}attention_mask", f"{prefix}completion_mask")
                batch.update(zip(names, padded, strict=True))
        needed = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) + len(r["kl_completion_ids"]) for r in rows)
        return {
            **batch,
            "label": torch.tensor([r["label"] for r in rows], dtype=torch.bool),
            "ref_logp": torch.tensor([r["ref_logp"] for r in rows], dtype=torch.float32),
            "ref_kl_logp": torch.tensor([r["ref_kl_logp"] for r in rows], dtype=torch.float32),
            "example_id": torch.tensor([r["example_id"] for r in rows], dtype=torch.long),
            "tokens_needed": torch.tensor(needed),  # each prompt once, no padding
        }


@dataclass
class PairCollator:
    """Pairs -> one micro-batch of a pair loss. `packed`: each pair one tree, its prompt then its chosen and its
    rejected answer, both continuing the prompt (`layout_trees`), trees side by side in rows (`pack_rows`); else
    padded sequences, prompt + chosen and prompt + rejected, pair by pair (trl.DPOTrainer runs the prompt twice
    so). Sequence 2i is pair i's chosen answer, 2i + 1 its rejected one, in both layouts.

    `ld_alpha` (LD-DPO): the reference log-probs are recomputed from the cached per-token values as the policy's
    will be (`loss.length_desensitized`), so that a policy equal to the reference still gives rewards of 0."""

    pad_id: int
    packed: bool = True
    attention: AttentionCosts | None = None
    ld_alpha: float | None = None

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        if self.packed:
            trees = [(p["prompt_ids"], [p["chosen_ids"], p["rejected_ids"]]) for p in pairs]
            sizes = [len(prompt) + sum(map(len, answers)) for prompt, answers in trees]
            layout = layout_trees(trees, pack_rows(sizes, None, self.attention), self.pad_id)
            batch.update({LAYOUT_KEY + k: v for k, v in vars(layout).items() if isinstance(v, torch.Tensor)})
            batch[LAYOUT_KEY + "split"] = torch.tensor(layout.split)
        else:
            seqs = [p["prompt_ids"] + p[key] for p in pairs for key in ("chosen_ids", "rejected_ids")]
            prompt_lens = [len(p["prompt_ids"]) for p in pairs for _ in range(2)]
            padded = pad_sequences(seqs, prompt_lens, self.pad_id)
            batch.update(zip(("input_ids", "attention_mask", "completion_mask"), padded, strict=True))
        chosen_lengths = torch.tensor([len(p["chosen_ids"]) for p in pairs])
        rejected_lengths = torch.tensor([len(p["rejected_ids"]) for p in pairs])
        ref = {
            side: torch.tensor([p[f"ref_{side}_logp"] for p in pairs], dtype=torch.float32)
            for side in ("chosen", "rejected")
        }
        if self.ld_alpha is not None:
            tokens = [p[f"ref_{k}_token_logps"] for p in pairs for k in ("chosen", "rejected")]
            sequence = torch.arange(len(tokens)).repeat_interleave(torch.tensor([len(t) for t in tokens]))
            values = torch.tensor([v for t in tokens for v in t], dtype=torch.float32)
            weighted = length_desensitized(values, sequence, chosen_lengths, rejected_lengths, self.ld_alpha)
            ref = {"chosen": weighted[0::2], "rejected": weighted[1::2]}
        needed = sum(len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
        return {
            **batch,
            "ref_chosen_logp": ref["chosen"],
            "ref_rejected_logp": ref["rejected"],
            "chosen_length": chosen_lengths,
            "rejected_length": rejected_lengths,
            "chosen_id": torch.tensor([p["chosen_id"] for p in pairs], dtype=torch.long),
            "rejected_id": torch.tensor([p["rejected_id"] for p in pairs], dtype=torch.long),
            "tokens_needed": torch.tensor(needed),  # each prompt once, no padding
        }


def is_pair_batch(batch: dict[str, torch.Tensor]) -> bool:
    """Whether a micro-batch holds (chosen, rejected) pairs (`PairCollator`), not rows (`Collator`)."""
    return "chosen_id" in batch


def batch_layout(batch: dict[str, torch.Tensor]) -> Layout | None:
    """The packed layout a packed `Collator` or `PairCollator` batch carries (None for a padded batch)."""
    if LAYOUT_KEY + "input_ids" not in batch:
        return None
    fields = {k.removeprefix(LAYOUT_KEY): v for k, v in batch.items() if k.startswith(LAYOUT_KEY)}
    fields["split"] = int(fields["split"])
    num_trees = len(batch["chosen_id"] if is_pair_batch(batch) else batch["label"])
    return Layout(**fields, num_trees=num_trees, branches=2)


class PolicyScorer(torch.nn.Module):
    """Wraps the causal LM so that scoring goes through `forward` (and thus through DDP/FSDP wrappers)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # FSDP's transformer-based auto wrap looks for the layer classes here
        self._no_split_modules = getattr(model, "_no_split_modules", None)

    def forward(self, batch, with_kl: bool = True, with_stats: bool = True, output_router_logits: bool = False):
        """Completion scores (with grad) and, with `with_kl`, KL completion scores (no grad): `PolicyScores`. For a
        batch of pairs, the scores of both answers (with grad), sequence 2i pair i's chosen, 2i + 1 its rejected."""
        layout, pairs = batch_layout(batch), is_pair_batch(batch)
        if layout is not None and pairs:  # one forward over the pairs' trees: each prompt once
            scores = score_layout(self.model, layout, with_stats=with_stats, output_router_logits=output_router_logits)
            return PolicyScores(scores, None, layout.input_ids.numel(), kl_on_cached_prompt=False)
        if layout is not None:
            return score_policy(
                self.model, layout, with_kl, with_stats=with_stats, output_router_logits=output_router_logits
            )
        # padded: the rows' completions, or both answers of each pair
        completions = score_sequences(
            self.model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            with_stats=with_stats,
            output_router_logits=output_router_logits,
        )
        kl, executed = None, batch["input_ids"].numel()
        if with_kl and not pairs:
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
