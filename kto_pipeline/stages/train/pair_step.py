"""One forward pass of a pair loss (trl.DPOTrainer's: DPO and its variants) and its metrics, shared by training
and evaluation. `kto_step.py` is its counterpart for KTO's losses.

Per forward pass, with trl.DPOTrainer's numbers:
  1. score both answers of every pair with grad: each pair one tree, its prompt once and its chosen and rejected
     answers after it, trees packed side by side in a few rows (`PairCollator`), or padded sequences;
  2. `pair_loss` against the cached reference log-probs of both answers. No KL forward: pair losses have none.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch

from kto_pipeline.config import TrainConfig
from kto_pipeline.loss import length_desensitized, pair_loss
from kto_pipeline.scoring.logprobs import PolicyScores
from kto_pipeline.stages.train.batches import real_rows


class PairForward(NamedTuple):
    scored: PolicyScores  # sequence 2i: pair i's chosen answer, 2i + 1: its rejected one
    loss: torch.Tensor  # this process's share of the batch's loss
    losses: torch.Tensor  # (P,) per pair
    chosen_logps: torch.Tensor  # (P,) the policy's (length-desensitized with --ld-alpha)
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor  # (P,) detached beta * log ratios
    rejected_rewards: torch.Tensor


def pair_forward(
    accelerator, scorer, batch, config: TrainConfig, with_stats: bool, output_router_logits: bool = False, real=None
) -> PairForward:
    """Both answers of each pair scored by the policy (with grad), then `pair_loss`. `real`: see
    `batches.real_rows` (None: every pair of the global batch is real)."""
    scored = scorer(batch, False, with_stats, output_router_logits)
    scores = scored.completions
    logps = scores.logps
    if config.ld_alpha is not None:
        lengths = (batch["chosen_length"], batch["rejected_length"])
        logps = length_desensitized(scores.token_logps, scores.sequence, *lengths, config.ld_alpha)
    chosen, rejected = logps[0::2], logps[1::2]
    loss, losses, chosen_rewards, rejected_rewards = pair_loss(
        chosen,
        rejected,
        batch["ref_chosen_logp"],
        batch["ref_rejected_logp"],
        config.beta,
        config.loss_types,
        config.weights,
        label_smoothing=config.label_smoothing,
        f_divergence_type=config.f_divergence_type,
        f_alpha_divergence_coef=config.f_alpha_divergence_coef,
        discopop_tau=config.discopop_tau,
        chosen_lengths=batch["chosen_length"].to(logps),
        rejected_lengths=batch["rejected_length"].to(logps),
        chosen_token_logps=scores.token_logps[scores.sequence % 2 == 0],
    )
    if real is not None:
        # each process's share of the mean over the global batch's real pairs (gradients are averaged over processes)
        loss = (losses * real).sum() * accelerator.num_processes / accelerator.gather(real.sum().reshape(1)).sum()
    return PairForward(scored, loss, losses, chosen, rejected, chosen_rewards, rejected_rewards)


def pair_metrics(accelerator, out: PairForward, real=None) -> dict[str, float]:
    """trl.DPOTrainer's metrics for one forward pass, over the global batch (the pairs accelerate repeats to even
    out the last batch left out, `real`)."""
    scores = out.scored.completions
    kept = torch.ones_like(out.chosen_rewards, dtype=torch.bool) if real is None else real.bool()
    tokens = kept.repeat_interleave(2)[scores.sequence]  # each scored token of a real pair
    chosen_tokens = tokens & (scores.sequence % 2 == 0)
    rejected_tokens = tokens & (scores.sequence % 2 == 1)

    def total(x: torch.Tensor) -> float:
        return accelerator.gather(x.detach().float().sum().reshape(1)).sum().item()

    pairs = total(kept)
    margins = out.chosen_rewards - out.rejected_rewards
    metrics = {
        "loss": accelerator.gather(out.loss.detach().reshape(1)).mean().item(),
        "rewards/chosen": total(out.chosen_rewards[kept]) / pairs,
        "rewards/rejected": total(out.rejected_rewards[kept]) / pairs,
        "rewards/accuracies": total((margins > 0)[kept]) / pairs,
        "rewards/margins": total(margins[kept]) / pairs,
        "logps/chosen": total(out.chosen_logps.detach()[kept]) / pairs,
        "logps/rejected": total(out.rejected_logps.detach()[kept]) / pairs,
    }
    mean_logits = scores.mean_logits.detach()
    for name, sel in (("chosen", chosen_tokens), ("rejected", rejected_tokens)):
        n_tok = total(sel)
        metrics[f"logits/{name}"] = total(mean_logits[sel]) / n_tok if n_tok > 0 else 0.0
    n_tok = total(tokens)
    metrics["entropy"] = total(scores.entropy[tokens]) / n_tok if n_tok > 0 else 0.0
    return metrics


@torch.no_grad()
def evaluate_pairs(accelerator, scorer, loader, config: TrainConfig) -> dict[str, float]:
    """Metrics over the whole eval set of pairs: trl.DPOTrainer's names with an `eval_` prefix, computed over all
    pairs at once (not averaged over batches), plus what every loss reports alike (KTO's evaluation too):
    `eval_pair_accuracy` (= `eval_rewards/accuracies`: how often the chosen answer's reward beats the rejected
    one's), `eval_reward_accuracy` (the fraction of answers whose reward has the sign of their label: chosen > 0 >
    rejected), `eval_pairs` and `eval_rows`.

    Per-pair values are gathered across processes (dropping the pairs accelerate repeats to even out the last
    batch), so the result does not depend on the number of processes or the eval batch size, except for the
    losses that look across a batch (aot, aot_unpaired, sft), whose per-pair losses are their batch's."""
    was_training = scorer.training
    scorer.eval()
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    for i, batch in enumerate(loader):
        real = real_rows(accelerator, config.per_device_eval_batch_size, len(loader.dataset), i == len(loader) - 1)
        out = pair_forward(accelerator, scorer, batch, config, with_stats=False, real=real)
        for name in ("losses", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards"):
            parts[name].append(accelerator.gather_for_metrics(getattr(out, name).detach().float()))
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
