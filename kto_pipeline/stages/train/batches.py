"""Stage 2's data: cache rows -> micro-batches -> the policy's scores.

`CacheRows` reads rows of the memory-mapped cache (truncated to the train-time max length), `EpochSampler`
orders them reproducibly from (seed, epoch), `Collator` lays a micro-batch out packed (`scoring/packing.py`:
each row's prompt, completion and KL completion as one tree, no padding) or padded for models that take no
packed layout, and `PolicyScorer` scores a batch through the model's `forward`, so that DDP and FSDP wrappers
see the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset, Sampler

from kto_pipeline.cache import CacheTable, completion_room, token_sum
from kto_pipeline.scoring.logprobs import PolicyScores, pad_sequences, score_policy, score_sequences
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
        if self.truncate:
            room = completion_room(row["prompt_ids"], self.max_length)
            for ids, logps, total in (
                ("completion_ids", "ref_token_logps", "ref_logp"),
                ("kl_completion_ids", "ref_kl_token_logps", "ref_kl_logp"),
            ):
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


def batch_layout(batch: dict[str, torch.Tensor]) -> Layout | None:
    """The packed layout a `Collator(packed=True)` batch carries (None for a padded batch)."""
    if LAYOUT_KEY + "input_ids" not in batch:
        return None
    fields = {k.removeprefix(LAYOUT_KEY): v for k, v in batch.items() if k.startswith(LAYOUT_KEY)}
    fields["split"] = int(fields["split"])
    return Layout(**fields, num_trees=len(batch["label"]), branches=2)


class PolicyScorer(torch.nn.Module):
    """Wraps the causal LM so that scoring goes through `forward` (and thus through DDP/FSDP wrappers)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # FSDP's transformer-based auto wrap looks for the layer classes here
        self._no_split_modules = getattr(model, "_no_split_modules", None)

    def forward(self, batch, with_kl: bool = True, with_stats: bool = True, output_router_logits: bool = False):
        """Completion scores (with grad) and, with `with_kl`, KL completion scores (no grad): `PolicyScores`."""
        layout = batch_layout(batch)
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
        if with_kl:
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
