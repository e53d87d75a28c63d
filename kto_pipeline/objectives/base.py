"""What a loss family is to the stages: one `Objective` each (`kto.py`, `pairs.py`), chosen once from --loss-type
(`objective_for`, the registry in `__init__.py`), and one `StepOut` from every family's forward pass.

The train stage, `memory/`, `sweep.py` and `model_card.py` ask the objective: what the family requires of a cache,
its dataset and collator, its forward, metrics and evaluation, its unit (rows or pairs) and its options (what a
model card says of a family is `model_card.py`'s). None of them asks which family runs.

A family's module imports nothing heavy at import time (the command line builds its options from the names here
without loading torch); what computes imports torch where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kto_pipeline.cache import CacheTable, Manifest
    from kto_pipeline.scoring.logprobs import PolicyScores


@dataclass
class StepOut:
    """One forward pass of any family, over this process's part of the micro-batch.

    Each scored sequence s (a KTO row's completion; a pair's chosen answer at 2i, its rejected one at 2i + 1) has a
    log-prob `logps[s]` under the policy, a reward `rewards[s]` (beta x its log ratio to the reference, detached)
    and a label `labels[s]` (desirable, or chosen)."""

    loss: torch.Tensor  # this process's share of the global batch's loss (what the backward takes)
    losses: torch.Tensor  # (items,) each row's or pair's loss
    scored: PolicyScores  # the policy's scores: token statistics, tokens run, MoE aux loss
    logps: torch.Tensor  # (sequences,) with grad
    rewards: torch.Tensor  # (sequences,) detached
    labels: torch.Tensor  # (sequences,) bool
    kl: torch.Tensor  # the KL reference point z0 (0 for a family without one)
    ids: torch.Tensor  # (items,) the example ids an error message names


class Objective:
    """A loss family: its names and options (declared as class attributes) and what it does at each point of a
    run. Subclasses implement every method that raises here. `config` is the run's `TrainConfig` (config imports
    the registry to check a --loss-type, so nothing here imports config), read only by `check` and `settings`; the
    other methods take what `settings(config)` returns."""

    name: str  # the family: "kto", "pairs"
    loss_types: tuple[str, ...]  # the --loss-type names it trains
    combines: bool = False  # whether its terms join with + (trl's MPO combinations)
    unit: str  # what --per-device-train-batch-size counts: "rows" or "pairs"
    describes: str  # the family in messages: "KTO", "pair losses"
    loss_noun: str  # one of its losses in messages: "KTO loss", "pair loss"
    options: dict[str, Any]  # its own options and their defaults: refused with another family's losses
    ids_are: str = ""  # what an error's example ids are ("", "of the chosen answers ")

    # ---------------------------------------------------------------------------------- settings and data

    def check(self, config) -> None:
        """Reject the family's options where they are wrong (KTOPipelineError naming the flag)."""

    def settings(self, config):
        """The family's settings of this run, typed (a frozen dataclass of the family's own), made once from the
        `TrainConfig`: what its collator, forward, evaluation and notes read, rather than the whole config."""
        raise NotImplementedError

    def requires(self, manifest: Manifest, loss_type: str, flag: str, path: str) -> str | None:
        """Why the cache at `path` (given as `flag`) cannot train `loss_type`, or None where it can."""
        raise NotImplementedError

    def dataset(self, cache: CacheTable, max_length: int):
        """The items a loader draws (map-style: `len`, `[i]`, `lengths()`), truncated at `max_length`."""
        raise NotImplementedError

    def data_warning(self, dataset, settings) -> str | None:
        """A warning about the training data under these `settings` (`self.settings`), or None."""
        return None

    def collator(self, pad_id: int, packed: bool, attention, settings):
        """Items -> one micro-batch: packed (`packed`, `attention`: the model's `AttentionCosts`) or padded."""
        raise NotImplementedError

    def items_from_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The items of this family made of cache rows (what `CacheRows` yields): `estimate-memory`'s batches."""
        raise NotImplementedError

    def tokens_with_grad(self, item: dict[str, Any]) -> int:
        """The tokens of an item its forward runs with gradients (`estimate-memory`'s floor)."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------- a forward pass

    def forward(
        self,
        accelerator,
        scorer,
        batch: dict[str, torch.Tensor],
        settings,
        with_stats: bool,
        output_router_logits: bool = False,
        real: torch.Tensor | None = None,
    ) -> StepOut:
        """One forward pass and the loss, shared by training and evaluation. `real`: `items.real_rows` (None:
        every item of the global batch is real)."""
        raise NotImplementedError

    def metrics(self, accelerator, out: StepOut, real: torch.Tensor | None = None) -> dict[str, float]:
        """trl's metrics of one forward pass, over the global batch."""
        raise NotImplementedError

    def evaluate(self, accelerator, scorer, loader, settings, batch_size: int) -> dict[str, float]:
        """Metrics over the whole eval set (`batch_size` items a process a batch), trl's names with an `eval_`
        prefix."""
        raise NotImplementedError

    def kl_forward(self, settings, on_cached_prompt: bool) -> str:
        """How the run's KL forward ran, for trainer_state.json."""
        raise NotImplementedError


def share_of_loss(accelerator, losses, real):
    """This process's share of the mean loss over the global batch's real items (gradients are averaged over the
    processes)."""
    return (losses * real).sum() * accelerator.num_processes / accelerator.gather(real.sum().reshape(1)).sum()


def masked_sums(values: list, masks: list):
    """(len(values), len(masks)) float32: each of `values`' sums over each boolean mask's elements, all at once (no
    boolean indexing: on an accelerator, indexing by a mask waits for the device to count it)."""
    import torch

    v = torch.stack([x.detach().float() for x in values])[:, None, :]
    return torch.where(torch.stack(masks)[None], v, 0.0).sum(-1)


def step_totals(accelerator, names: list[str], sums, local: dict[str, Any]) -> dict[str, float]:
    """A step's metrics in one collective and one copy to the host: `sums` (one value per name, float32) summed over
    every process, and each scalar of `local` as this process has it."""
    import torch

    values = accelerator.gather(sums.reshape(1, -1)).sum(0)
    if local:
        values = torch.cat([values, torch.stack([x.detach().float().reshape(()) for x in local.values()])])
    return dict(zip([*names, *local], values.tolist(), strict=True))
