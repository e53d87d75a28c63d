"""KTO's losses: each row alone, its completion desirable or undesirable, against the KL reference point z0.

Per forward pass, with trl.KTOTrainer's numbers:
  1. score the completions with grad: the micro-batch's prompts and completions packed side by side in a few rows,
     almost no padding (`scoring/packing.py`), their keys/values kept;
  2. score the KL completions (prompt_i + completion of partner) without grad, all in one unpadded row, on
     prompt_i's cached keys/values: z0 = clamp(mean over the global batch of (policy_kl_logp - ref_kl_logp), min=0);
  3. `loss.kto_loss` against the cached reference log-probs.
The KL all-reduce lives here, in the step, never in the loss (`loss.py` is a pure tensor function).
`apo_zero_unpaired` needs no z0, so no KL forward runs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kto_pipeline.errors import check_option
from kto_pipeline.objectives.base import Objective, StepOut, masked_sums, share_of_loss, step_totals


@dataclass(frozen=True)
class KTOSettings:
    """What KTO's forward, collator and evaluation read of a run's config."""

    loss_type: str  # kto, or apo_zero_unpaired (no KL reference point)
    beta: float
    desirable_weight: float
    undesirable_weight: float

    @property
    def with_kl(self) -> bool:
        """Whether the loss has a KL reference point z0 (the KL completions run)."""
        return self.loss_type == "kto"


class KTO(Objective):
    name = "kto"
    loss_types = ("kto", "apo_zero_unpaired")
    unit = "rows"
    options = {"desirable_weight": 1.0, "undesirable_weight": 1.0}
    loss_noun = "KTO loss"
    describes = "KTO"

    def check(self, config) -> None:
        if config.loss_type == "kto":
            check_option(
                config.per_device_train_batch_size > 1,
                "per_device_train_batch_size",
                "must be > 1 with --loss-type kto: with one row the KL estimate is that row's own reward "
                "(use >= 4, or --loss-type apo_zero_unpaired)",
            )

    def settings(self, config) -> KTOSettings:
        return KTOSettings(config.loss_type, config.beta, config.desirable_weight, config.undesirable_weight)

    def requires(self, manifest, loss_type: str, flag: str, path: str) -> str | None:
        if manifest.has_kl:
            return None
        return (
            f"{flag} {path} was written by `precompute --pairs-only`: it holds no KL completions, which KTO's loss "
            "needs. Precompute the data again without --pairs-only (another --output), or train a pair loss on it "
            "(--loss-type sigmoid for DPO, or another of trl.DPOTrainer's)."
        )

    def dataset(self, cache, max_length: int) -> CacheRows:
        return CacheRows(cache, max_length)

    def data_warning(self, dataset: CacheRows, settings: KTOSettings) -> str | None:
        n_desirable = int(dataset.labels.sum())
        n_undesirable = len(dataset) - n_desirable
        return imbalance_warning(n_desirable, n_undesirable, settings.desirable_weight, settings.undesirable_weight)

    def collator(self, pad_id: int, packed: bool, attention, settings: KTOSettings) -> Collator:
        return Collator(pad_id, packed, attention)

    def items_from_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return rows

    def tokens_with_grad(self, item: dict[str, Any]) -> int:
        return len(item["prompt_ids"]) + len(item["completion_ids"])  # the KL completion runs without

    def forward(self, accelerator, scorer, batch, settings, with_stats, output_router_logits=False, real=None):
        """The completions scored (policy, with grad), z0 from the KL completions (policy, no grad, averaged over the
        global batch before the clamp), `kto_loss`."""
        import torch

        from kto_pipeline.objectives.loss import kto_loss
        from kto_pipeline.runtime.compiled import compiled_region

        kto_loss = compiled_region(scorer, kto_loss)  # (with --torch-compile: a region of its own)
        with_kl = settings.with_kl
        scored = scorer(batch, with_kl, with_stats, output_router_logits)
        z0 = torch.zeros((), device=accelerator.device)
        if with_kl:
            delta = (scored.kl.logps - batch["ref_kl_logp"]).detach()
            if real is None:
                z0 = accelerator.gather(delta.mean().reshape(1)).mean()
            else:  # the mean over the global batch's real rows
                z0 = (
                    accelerator.gather((delta * real).sum().reshape(1)).sum()
                    / accelerator.gather(real.sum().reshape(1)).sum()
                )
            z0 = z0.clamp(min=0)
        loss, losses, rewards = kto_loss(
            scored.completions.logps,
            batch["ref_logp"],
            batch["label"],
            z0,
            beta=settings.beta,
            loss_type=settings.loss_type,
            desirable_weight=settings.desirable_weight,
            undesirable_weight=settings.undesirable_weight,
        )
        if real is not None:
            loss = share_of_loss(accelerator, losses, real)
        logps, labels = scored.completions.logps, batch["label"].bool()
        return StepOut(loss, losses, scored, logps, rewards, labels, z0, batch["example_id"])

    def metrics(self, accelerator, out: StepOut, real=None) -> dict[str, float]:
        """trl.KTOTrainer's metrics for one forward pass, summed across processes before dividing (the repeated
        rows of an uneven last batch left out, `real`)."""
        import torch

        scores, labels = out.scored.completions, out.labels
        token_labels = labels[scores.sequence]  # each scored token's row label
        if real is not None:
            kept = real.bool()
            labels, token_labels = labels & kept, token_labels & kept[scores.sequence]
            rejected, token_rejected = ~labels & kept, ~token_labels & kept[scores.sequence]
        else:
            rejected, token_rejected = ~labels, ~token_labels
        kept_tokens = torch.ones_like(token_labels) if real is None else real.bool()[scores.sequence]
        rows = masked_sums([torch.ones_like(out.rewards), out.rewards, out.logps], [labels, rejected])
        per_token = [torch.ones_like(scores.entropy), scores.mean_logits, scores.entropy]
        per_token = masked_sums(per_token, [token_labels, token_rejected, kept_tokens])
        names = [f"{v}/{k}" for v in ("n", "rewards", "logps") for k in ("chosen", "rejected")]
        names += [f"{v}/{k}" for v in ("tokens", "logits", "entropy") for k in ("chosen", "rejected", "all")]
        sums = torch.cat([rows.flatten(), per_token.flatten(), out.loss.detach().float().reshape(1)])
        t = step_totals(accelerator, [*names, "loss"], sums, local={"kl": out.kl})
        metrics = {"loss": t["loss"] / accelerator.num_processes, "kl": t["kl"]}
        for name in ("chosen", "rejected"):
            if t[f"n/{name}"] > 0:
                metrics[f"rewards/{name}"] = t[f"rewards/{name}"] / t[f"n/{name}"]
                metrics[f"logps/{name}"] = t[f"logps/{name}"] / t[f"n/{name}"]
                if t[f"tokens/{name}"] > 0:
                    metrics[f"logits/{name}"] = t[f"logits/{name}"] / t[f"tokens/{name}"]
        if t["n/chosen"] > 0 and t["n/rejected"] > 0:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        metrics["entropy"] = t["entropy/all"] / max(t["tokens/all"], 1)
        return metrics

    def evaluate(self, accelerator, scorer, loader, settings, batch_size: int) -> dict[str, float]:
        """trl's metrics with an `eval_` prefix, plus `eval_reward_accuracy`: the fraction of rows whose implicit
        reward has the sign of its label (desirable > 0 > undesirable), and, where prompts have both a desirable and
        an undesirable row (paired data), `eval_pair_accuracy`: how often the desirable answer's reward beats the
        undesirable one's (see `pair_accuracy`).

        Per-row values are gathered across processes (dropping the rows accelerate repeats to even out the last
        batch), so the result does not depend on the number of processes or the eval batch size; only z0 is per
        batch, as in training."""
        import torch

        from kto_pipeline.objectives.items import real_rows

        was_training = scorer.training
        scorer.eval()
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        kls = []
        with torch.no_grad():
            for i, batch in enumerate(loader):
                last = i == len(loader) - 1
                real = real_rows(accelerator, batch_size, len(loader.dataset), last)
                out = self.forward(accelerator, scorer, batch, settings, with_stats=False, real=real)
                kls.append(out.kl.item())
                for name, value in (("loss", out.losses), ("reward", out.rewards), ("logp", out.logps)):
                    parts[name].append(accelerator.gather_for_metrics(value.detach().float()))
                parts["label"].append(accelerator.gather_for_metrics(batch["label"].detach().float()))
                parts["example_id"].append(accelerator.gather_for_metrics(batch["example_id"]))
        scorer.train(was_training)
        loss, reward, logp = (torch.cat(parts[k]) for k in ("loss", "reward", "logp"))
        label = torch.cat(parts["label"]).bool()
        results = {"eval_loss": loss.mean().item(), "eval_kl": sum(kls) / max(len(kls), 1)}
        for name, sel in (("chosen", label), ("rejected", ~label)):
            if sel.any():
                results[f"eval_rewards/{name}"] = reward[sel].mean().item()
                results[f"eval_logps/{name}"] = logp[sel].mean().item()
        if label.any() and (~label).any():
            results["eval_rewards/margins"] = results["eval_rewards/chosen"] - results["eval_rewards/rejected"]
        results["eval_reward_accuracy"] = torch.where(label, reward > 0, reward < 0).float().mean().item()
        results["eval_rows"] = int(label.numel())
        groups = loader.dataset.prompt_groups()
        group = torch.tensor([groups[int(i)] for i in torch.cat(parts["example_id"]).tolist()])
        accuracy, pairs = pair_accuracy(reward.cpu(), label.cpu(), group)
        if pairs:
            results["eval_pair_accuracy"], results["eval_pairs"] = accuracy, pairs
        return results

    def kl_forward(self, settings: KTOSettings, on_cached_prompt: bool) -> str:
        if on_cached_prompt:
            return "on the prompts' cached keys/values"
        return "with the prompts run again" if settings.with_kl else "none (loss without KL)"


# ------------------------------------------------------------------------------------------- the data


class CacheRows:
    """Rows of a memory-mapped cache, truncated to a train-time `max_length` (a map-style dataset).

    Truncating at L < the cached max length gives exactly what precomputing at L would have: the
    first L - len(prompt) completion tokens, and as reference log-prob the sum of their cached
    per-token values (a causal model's log-prob of a token does not depend on what follows it).
    Rows whose prompt reaches L are dropped, as precompute would drop them.
    """

    def __init__(self, cache, max_length: int):
        import numpy as np
        import pyarrow.compute as pc

        from kto_pipeline.objectives.items import cache_images

        self.table = cache.table
        self.max_length = max_length
        prompt_lens = pc.list_value_length(self.table.column("prompt_ids")).to_numpy()
        self.indices = np.flatnonzero(prompt_lens < max_length)
        self.labels = self.table.column("label").to_numpy(zero_copy_only=False)[self.indices]
        self._groups: dict[int, int] | None = None
        self.images = cache_images(cache)

    def __len__(self) -> int:
        return len(self.indices)

    def lengths(self):
        """Tokens of each row's prompt + completion (truncated at max_length): for grouping by length."""
        import numpy as np
        import pyarrow.compute as pc

        take = self.table.select(["prompt_ids", "completion_ids"]).take(self.indices)
        total = sum(pc.list_value_length(take.column(c)).to_numpy().astype(np.int64) for c in take.column_names)
        return np.minimum(total, self.max_length)

    def prompt_groups(self) -> dict[int, int]:
        """example_id -> a number shared by every row with the same prompt (for pairwise metrics); read once, as
        every evaluation asks."""
        if self._groups is not None:
            return self._groups
        groups: dict[tuple, int] = {}
        out = {}
        # rows with images: the same prompt text over another picture is another prompt (its image tokens alike)
        images = ["image_hashes"] if "image_hashes" in self.table.column_names else []
        rows = self.table.select(["example_id", "prompt_ids", *images]).take(self.indices)
        pictures = rows.column("image_hashes").to_pylist() if images else [()] * rows.num_rows
        for example_id, prompt, hashes in zip(
            rows.column("example_id").to_pylist(), rows.column("prompt_ids").to_pylist(), pictures, strict=True
        ):
            out[example_id] = groups.setdefault((tuple(prompt), tuple(hashes)), len(groups))
        self._groups = out
        return out

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]

    def __getitems__(self, positions: list[int]) -> list[dict[str, Any]]:
        """A micro-batch's rows in one read of the table (the loader asks for a batch at once)."""
        from kto_pipeline.objectives.items import cache_rows

        rows = cache_rows(self.table, self.indices[list(positions)], self.max_length, with_kl=True)
        for row in rows if self.images is not None else ():
            row["pixels"] = self.images.pixels(row["image_row"])
        return rows


@dataclass
class Collator:
    """Rows -> one micro-batch. `packed`: the rows' `(prompt, [completion, KL completion])` trees side by side in
    rows (`packing.pack_rows`), prompts and completions first and the KL completions after them
    (`layout_trees(split_last=True)`); else padded sequences, completions and KL completions apart."""

    pad_id: int
    packed: bool = True
    attention: Any = None  # `attention.attention_costs` of the model: how wide packed rows should be

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        from kto_pipeline.objectives.items import packed_batch, padded_batch
        from kto_pipeline.scoring.packing import tree_tokens

        if self.packed:
            trees = [(r["prompt_ids"], [r["completion_ids"], r["kl_completion_ids"]]) for r in rows]
            sizes = [tree_tokens([len(p), len(c)], self.attention) for p, (c, _) in trees]  # KL completions apart
            batch = packed_batch(trees, sizes, self.pad_id, self.attention, split_last=True, items=rows)
        else:
            batch = padded_batch(rows, ("completion_ids",), self.pad_id)
            batch.update(padded_batch(rows, ("kl_completion_ids",), self.pad_id, prefix="kl_"))
        needed = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) + len(r["kl_completion_ids"]) for r in rows)
        return {
            **batch,
            "label": torch.tensor([r["label"] for r in rows], dtype=torch.bool),
            "ref_logp": torch.tensor([r["ref_logp"] for r in rows], dtype=torch.float32),
            "ref_kl_logp": torch.tensor([r["ref_kl_logp"] for r in rows], dtype=torch.float32),
            "example_id": torch.tensor([r["example_id"] for r in rows], dtype=torch.long),
            "tokens_needed": needed,  # each prompt once, no padding (an int: it stays on the host)
        }


# ------------------------------------------------------------------------------------------- checks and metrics


def imbalance_warning(num_desirable: int, num_undesirable: int, desirable_weight: float, undesirable_weight: float):
    """trl's advice (KTO paper eq. 8): desirable_weight * n_D / (undesirable_weight * n_U) in [1, 4/3]. With rows
    of one kind only, no weight balances them: that is said instead."""
    if min(num_desirable, num_undesirable) == 0:
        missing, present = ("undesirable", "desirable") if num_undesirable == 0 else ("desirable", "undesirable")
        return (
            f"the data has {num_desirable} desirable and {num_undesirable} undesirable rows: with no {missing} "
            f"rows, KTO's {missing} term is absent and training moves only the {present} rows' rewards against the "
            "KL estimate (no weight balances this). Label some rows the other way for KTO's contrast."
        )
    n_d, n_u = num_desirable, num_undesirable
    if n_d == n_u:
        return None
    d_lo = round(n_u * undesirable_weight / n_d, 2)
    d_hi = round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo = round(n_d * desirable_weight / n_u / 1.33, 2)
    u_hi = round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return None
    return (
        f"the data has {num_desirable} desirable and {num_undesirable} undesirable rows, and the weights are "
        f"outside the recommended 1:1 to 4:3 range. Use EITHER --desirable-weight in [{d_lo}, {d_hi}] OR "
        f"--undesirable-weight in [{u_lo}, {u_hi}] (not both)."
    )


def pair_accuracy(reward, label, group) -> tuple[float, int]:
    """(fraction, count) of (desirable, undesirable) row pairs sharing a prompt in which the desirable row has the
    higher reward: DPO's `rewards/accuracies` on paired data, blind to a shift of all rewards. (nan, 0) without pairs.

    reward, label, group: (N,); group numbers the prompts.
    """
    same = group[:, None] == group[None, :]  # (N, N); eval sets are small
    pairs = same & label[:, None] & ~label[None, :]  # [i, j]: i desirable, j undesirable, same prompt
    count = int(pairs.sum())
    if count == 0:
        return float("nan"), 0
    wins = (reward[:, None] > reward[None, :]) & pairs
    return wins.sum().item() / count, count
