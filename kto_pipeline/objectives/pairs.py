"""trl.DPOTrainer's pair losses (DPO and its variants, and their weighted sums) on the (chosen, rejected) pairs of a
paired cache.

Per forward pass, with trl.DPOTrainer's numbers:
  1. score both answers of every pair with grad: each pair one tree, its prompt once and its chosen and rejected
     answers after it, trees packed side by side in a few rows (`PairCollator`), or padded sequences;
  2. `loss.pair_loss` against the cached reference log-probs of both answers. No KL forward: pair losses have none.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kto_pipeline.errors import KTOPipelineError, check_option
from kto_pipeline.objectives.base import Objective, StepOut, masked_sums, share_of_loss, step_totals

# trl.DPOTrainer's (1.16) names, and what each is called where it was published
PAIR_LOSS_NAMES = {
    "sigmoid": "DPO",
    "hinge": "SLiC (hinge)",
    "ipo": "IPO",
    "exo_pair": "EXO",
    "nca_pair": "NCA",
    "robust": "robust DPO",
    "bco_pair": "BCO",
    "sppo_hard": "SPPO (hard)",
    "aot": "AOT",
    "aot_unpaired": "AOT (unpaired)",
    "apo_zero": "APO-zero",
    "apo_down": "APO-down",
    "discopop": "DiscoPOP",
    "sft": "SFT (NLL of the chosen answers)",
    "sigmoid_norm": "length-normalized DPO",
}
PAIR_LOSS_TYPES = tuple(PAIR_LOSS_NAMES)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the pair losses that take another f-divergence than reverse KL (trl: the others have no valid generalization)
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


@dataclass(frozen=True)
class PairSettings:
    """What the pair losses' forward, collator and evaluation read of a run's config (trl.DPOConfig's names)."""

    loss_types: tuple[str, ...]  # the --loss-type terms, summed
    weights: tuple[float, ...]  # each term's weight
    beta: float
    label_smoothing: float
    f_divergence_type: str
    f_alpha_divergence_coef: float
    discopop_tau: float
    ld_alpha: float | None


class Pairs(Objective):
    name = "pairs"
    loss_types = PAIR_LOSS_TYPES
    combines = True
    unit = "pairs"
    options = {
        "loss_weights": None,
        "label_smoothing": 0.0,
        "f_divergence_type": "reverse_kl",
        "f_alpha_divergence_coef": 0.5,
        "discopop_tau": 0.05,
        "ld_alpha": None,
    }
    loss_noun = "pair loss"
    describes = "pair losses"
    ids_are = "of the chosen answers "

    def check(self, config) -> None:
        types = config.loss_types
        if config.loss_weights is not None:
            try:
                weights = config.weights
            except ValueError:
                raise KTOPipelineError(
                    f"--loss-weights: cannot read {config.loss_weights!r} as comma-separated numbers"
                ) from None
            check_option(
                len(weights) == len(types),
                "loss_weights",
                f"{len(weights)} weights for the {len(types)} terms of --loss-type {config.loss_type}",
            )
        check_option(
            config.f_divergence_type in F_DIVERGENCE_TYPES,
            "f_divergence_type",
            f"must be one of {', '.join(F_DIVERGENCE_TYPES)}",
        )
        check_option(
            config.f_divergence_type == "reverse_kl" or set(types) <= set(F_DIVERGENCE_LOSS_TYPES),
            "f_divergence_type",
            f"{config.f_divergence_type} applies to {', '.join(F_DIVERGENCE_LOSS_TYPES)} only (the other losses have "
            f"no valid f-divergence generalization); --loss-type {config.loss_type} needs reverse_kl",
        )
        smoothing = config.label_smoothing
        check_option(0 <= smoothing < 1, "label_smoothing", f"must be in [0, 1), got {smoothing}")
        check_option(
            "exo_pair" not in types or smoothing > 0,
            "label_smoothing",
            "must be > 0 with exo_pair (the EXO paper uses 1e-3)",
        )
        check_option(
            "robust" not in types or smoothing < 0.5,
            "label_smoothing",
            f"must be in [0, 0.5) with robust, got {smoothing}",
        )
        check_option(config.discopop_tau > 0, "discopop_tau", f"must be > 0, got {config.discopop_tau}")
        alpha = config.ld_alpha
        check_option(alpha is None or 0 <= alpha <= 1, "ld_alpha", f"must be in [0, 1], got {alpha}")

    def settings(self, config) -> PairSettings:
        return PairSettings(
            config.loss_types,
            config.weights,
            config.beta,
            config.label_smoothing,
            config.f_divergence_type,
            config.f_alpha_divergence_coef,
            config.discopop_tau,
            config.ld_alpha,
        )

    def requires(self, manifest, loss_type: str, flag: str, path: str) -> str | None:
        if manifest.paired:
            return None
        if manifest.format_version < 2:
            why = (
                f"it was written in cache format version {manifest.format_version}, which does not record which rows "
                "form a pair"
            )
        else:
            why = "its rows come from unpaired data (prompt/completion/label), so no row has a pair partner"
        return (
            f"--loss-type {loss_type} trains on (chosen, rejected) pairs, and {flag} {path} holds none: "
            f"{why}. Precompute paired data (prompt/chosen/rejected, or chosen/rejected) with this version into a "
            "new --output (add --pairs-only to skip the KL completions only KTO needs), or train KTO on this cache "
            "(--loss-type kto)."
        )

    def dataset(self, cache, max_length: int) -> CachePairs:
        return CachePairs(cache, max_length)

    def collator(self, pad_id: int, packed: bool, attention, settings: PairSettings) -> PairCollator:
        return PairCollator(pad_id, packed, attention, settings.ld_alpha)

    def items_from_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rows as the pairs `CachePairs` yields: the completion chosen, the KL completion (another row's)
        rejected."""
        return [
            {
                "prompt_ids": r["prompt_ids"],
                "chosen_ids": r["completion_ids"],
                "rejected_ids": r["kl_completion_ids"],
                "ref_chosen_token_logps": [],
                "ref_rejected_token_logps": [],
                "ref_chosen_logp": r["ref_logp"],
                "ref_rejected_logp": r["ref_kl_logp"],
                "chosen_id": 2 * i,
                "rejected_id": 2 * i + 1,
                **({"pixels": r["pixels"]} if "pixels" in r else {}),
            }
            for i, r in enumerate(rows)
        ]

    def tokens_with_grad(self, item: dict[str, Any]) -> int:
        return len(item["prompt_ids"]) + len(item["chosen_ids"]) + len(item["rejected_ids"])

    def forward(self, accelerator, scorer, batch, settings, with_stats, output_router_logits=False, real=None):
        """Both answers of each pair scored by the policy (with grad), then `pair_loss`."""
        import torch

        from kto_pipeline.objectives.loss import length_desensitized, pair_loss
        from kto_pipeline.runtime.compiled import compiled_region

        pair_loss = compiled_region(scorer, pair_loss)  # (with --torch-compile: a region of its own)
        scored = scorer(batch, False, with_stats, output_router_logits)
        scores = scored.completions
        logps = scores.logps
        if settings.ld_alpha is not None:
            lengths = (batch["chosen_length"], batch["rejected_length"])
            logps = length_desensitized(scores.token_logps, scores.sequence, *lengths, settings.ld_alpha)
        chosen, rejected = logps[0::2], logps[1::2]
        loss, losses, chosen_rewards, rejected_rewards = pair_loss(
            chosen,
            rejected,
            batch["ref_chosen_logp"],
            batch["ref_rejected_logp"],
            settings.beta,
            settings.loss_types,
            settings.weights,
            label_smoothing=settings.label_smoothing,
            f_divergence_type=settings.f_divergence_type,
            f_alpha_divergence_coef=settings.f_alpha_divergence_coef,
            discopop_tau=settings.discopop_tau,
            chosen_lengths=batch["chosen_length"].to(logps),
            rejected_lengths=batch["rejected_length"].to(logps),
            chosen_token_logps=scores.token_logps[scores.sequence % 2 == 0],
        )
        if real is not None:
            loss = share_of_loss(accelerator, losses, real)
        rewards = torch.stack([chosen_rewards, rejected_rewards], dim=1).reshape(-1)  # 2i chosen, 2i + 1 rejected
        labels = torch.arange(len(rewards), device=rewards.device) % 2 == 0
        kl = torch.zeros((), device=accelerator.device)
        return StepOut(loss, losses, scored, logps, rewards, labels, kl, batch["chosen_id"])

    def metrics(self, accelerator, out: StepOut, real=None) -> dict[str, float]:
        """trl.DPOTrainer's metrics for one forward pass, over the global batch (the pairs accelerate repeats to even
        out the last batch left out, `real`)."""
        import torch

        scores = out.scored.completions
        chosen_rewards, rejected_rewards = out.rewards[0::2], out.rewards[1::2]
        kept = torch.ones_like(chosen_rewards, dtype=torch.bool) if real is None else real.bool()
        tokens = kept.repeat_interleave(2)[scores.sequence]  # each scored token of a real pair
        chosen_tokens = tokens & (scores.sequence % 2 == 0)
        rejected_tokens = tokens & (scores.sequence % 2 == 1)

        margins, logps = chosen_rewards - rejected_rewards, out.logps
        pairs = [torch.ones_like(margins), chosen_rewards, rejected_rewards, margins > 0, margins, logps[0::2]]
        pairs = masked_sums([*pairs, logps[1::2]], [kept])
        per_token = [torch.ones_like(scores.entropy), scores.mean_logits, scores.entropy]
        per_token = masked_sums(per_token, [chosen_tokens, rejected_tokens, tokens])
        names = ["pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
        names += ["logps/chosen", "logps/rejected"]
        names += [f"{v}/{k}" for v in ("tokens", "logits", "entropy") for k in ("chosen", "rejected", "all")]
        sums = torch.cat([pairs.flatten(), per_token.flatten(), out.loss.detach().float().reshape(1)])
        t = step_totals(accelerator, [*names, "loss"], sums, local={})
        metrics = {"loss": t["loss"] / accelerator.num_processes}
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
            metrics[name] = t[name] / t["pairs"]
        metrics |= {name: t[name] / t["pairs"] for name in ("logps/chosen", "logps/rejected")}
        for name in ("chosen", "rejected"):
            n_tok = t[f"tokens/{name}"]
            metrics[f"logits/{name}"] = t[f"logits/{name}"] / n_tok if n_tok > 0 else 0.0
        metrics["entropy"] = t["entropy/all"] / t["tokens/all"] if t["tokens/all"] > 0 else 0.0
        return metrics

    def evaluate(self, accelerator, scorer, loader, settings, batch_size: int) -> dict[str, float]:
        """trl.DPOTrainer's names with an `eval_` prefix, computed over all pairs at once (not averaged over
        batches), plus what every loss reports alike (KTO's evaluation too): `eval_pair_accuracy` (=
        `eval_rewards/accuracies`: how often the chosen answer's reward beats the rejected one's),
        `eval_reward_accuracy` (the fraction of answers whose reward has the sign of their label: chosen > 0 >
        rejected), `eval_pairs` and `eval_rows`.

        Per-pair values are gathered across processes (dropping the pairs accelerate repeats to even out the last
        batch), so the result does not depend on the number of processes or the eval batch size, except for the
        losses that look across a batch (aot, aot_unpaired, sft), whose per-pair losses are their batch's."""
        import torch

        from kto_pipeline.objectives.items import real_rows

        was_training = scorer.training
        scorer.eval()
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for i, batch in enumerate(loader):
                last = i == len(loader) - 1
                real = real_rows(accelerator, batch_size, len(loader.dataset), last)
                out = self.forward(accelerator, scorer, batch, settings, with_stats=False, real=real)
                values = {"losses": out.losses, "chosen_logps": out.logps[0::2], "rejected_logps": out.logps[1::2]}
                values |= {"chosen_rewards": out.rewards[0::2], "rejected_rewards": out.rewards[1::2]}
                for name, value in values.items():
                    parts[name].append(accelerator.gather_for_metrics(value.detach().float()))
        scorer.train(was_training)
        values = {k: torch.cat(v) for k, v in parts.items()}
        chosen, rejected = values["chosen_rewards"], values["rejected_rewards"]
        margins = chosen - rejected
        return {
            "eval_loss": values["losses"].mean().item(),
            "eval_rewards/chosen": chosen.mean().item(),
            "eval_rewards/rejected": rejected.mean().item(),
            "eval_rewards/accuracies": (margins > 0).float().mean().item(),
            "eval_rewards/margins": margins.mean().item(),
            "eval_logps/chosen": values["chosen_logps"].mean().item(),
            "eval_logps/rejected": values["rejected_logps"].mean().item(),
            "eval_reward_accuracy": torch.cat([chosen > 0, rejected < 0]).float().mean().item(),
            "eval_rows": 2 * len(chosen),
            "eval_pair_accuracy": (margins > 0).float().mean().item(),
            "eval_pairs": len(chosen),
        }

    def kl_forward(self, settings: PairSettings, on_cached_prompt: bool) -> str:
        return "none (pair loss: each pair one tree, prompt once)"


# ------------------------------------------------------------------------------------------- the data


class CachePairs:
    """The (chosen, rejected) pairs of a paired cache (format version 2 records each row's partner), what a pair
    loss trains on: one item a pair, in the order of the source rows, each answer truncated to a train-time
    `max_length` as `CacheRows` truncates a row (trl.DPOTrainer's `keep_start`). Pairs whose prompt reaches
    `max_length` are dropped, as trl drops them."""

    def __init__(self, cache, max_length: int):
        import numpy as np
        import pyarrow.compute as pc

        from kto_pipeline.cache import NO_PAIR
        from kto_pipeline.objectives.items import COMPLETION, cache_images

        # the columns a pair needs (not the KL completions', which a pair loss never reads)
        self.images = cache_images(cache)
        image_row = ["image_row"] if self.images is not None else []
        self.table = cache.table.select(
            ["example_id", "label", "prompt_ids", "pair_example_id", *COMPLETION, *image_row]
        )
        self.max_length = max_length
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

    def lengths(self):
        """Tokens of each pair's longer sequence, prompt + answer (truncated at max_length): for grouping by
        length on the padded path."""
        import numpy as np
        import pyarrow.compute as pc

        def total(rows):
            take = self.table.select(["prompt_ids", "completion_ids"]).take(rows)
            return sum(pc.list_value_length(take.column(c)).to_numpy().astype(np.int64) for c in take.column_names)

        return np.minimum(np.maximum(total(self.chosen), total(self.rejected)), self.max_length)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]

    def __getitems__(self, positions: list[int]) -> list[dict[str, Any]]:
        """A micro-batch's pairs in one read of the table (the loader asks for a batch at once)."""
        import numpy as np

        from kto_pipeline.objectives.items import cache_rows

        positions = list(positions)
        both = np.concatenate([self.chosen[positions], self.rejected[positions]])
        rows = cache_rows(self.table, both, self.max_length, with_kl=False)
        return [self._pair(c, r) for c, r in zip(rows[: len(positions)], rows[len(positions) :], strict=True)]

    def _pair(self, chosen: dict[str, Any], rejected: dict[str, Any]) -> dict[str, Any]:
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
            **({"pixels": self.images.pixels(chosen["image_row"])} if self.images is not None else {}),
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
    attention: Any = None
    ld_alpha: float | None = None

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        from kto_pipeline.objectives.items import packed_batch, padded_batch
        from kto_pipeline.objectives.loss import length_desensitized
        from kto_pipeline.scoring.packing import tree_tokens

        if self.packed:
            trees = [(p["prompt_ids"], [p["chosen_ids"], p["rejected_ids"]]) for p in pairs]
            sizes = [tree_tokens([len(prompt), *map(len, answers)], self.attention) for prompt, answers in trees]
            batch = packed_batch(trees, sizes, self.pad_id, self.attention, items=pairs)
        else:
            batch = padded_batch(pairs, ("chosen_ids", "rejected_ids"), self.pad_id)
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
            "tokens_needed": needed,  # each prompt once, no padding (an int: it stays on the host)
        }
