"""One KTO forward pass and its metrics, shared by training and evaluation (`pair_step.py` is its counterpart for
the pair losses).

Per forward pass, with trl.KTOTrainer's numbers:
  1. score the completions with grad: the micro-batch's prompts and completions packed side by side in
     a few rows, almost no padding (`scoring/packing.py`), their keys/values kept;
  2. score the KL completions (prompt_i + completion of partner) without grad, all in one unpadded row, on
     prompt_i's cached keys/values: z0 = clamp(mean over the global batch of (policy_kl_logp - ref_kl_logp), min=0);
  3. `kto_loss` against the cached reference log-probs.
The KL all-reduce lives here, in the step, never in the loss (`loss.py` is a pure tensor function).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from kto_pipeline.config import TrainConfig
from kto_pipeline.loss import kto_loss
from kto_pipeline.stages.train.batches import real_rows


def kto_forward(
    accelerator, scorer, batch, config: TrainConfig, with_stats: bool, output_router_logits: bool = False, real=None
):
    """One KTO forward pass, shared by training and evaluation: the completions scored (policy, with grad),
    z0 from the KL completions (policy, no grad, averaged over the global batch before the clamp), `kto_loss`.
    `real`: see `batches.real_rows` (None: every row of the global batch is real).

    Returns (z0, scored: PolicyScores, loss, losses, rewards)."""
    with_kl = config.loss_type == "kto"
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
        beta=config.beta,
        loss_type=config.loss_type,
        desirable_weight=config.desirable_weight,
        undesirable_weight=config.undesirable_weight,
    )
    if real is not None:
        # each process's share of the mean over the global batch's real rows (gradients are averaged over processes)
        loss = (losses * real).sum() * accelerator.num_processes / accelerator.gather(real.sum().reshape(1)).sum()
    return z0, scored, loss, losses, rewards


class MetricLog:
    """Per-forward-pass metric values, averaged over the forward passes of each logging interval (as trl)."""

    def __init__(self):
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, name: str, value: float) -> None:
        self.values[name].append(value)

    def flush(self) -> dict[str, float]:
        out = {k: sum(v) / len(v) for k, v in self.values.items() if v}
        self.values.clear()
        return out


def batch_metrics(accelerator, loss, z0, labels, logps, rewards, scores, real=None) -> dict[str, float]:
    """TRL's metrics for one forward pass, summed across processes before dividing. `real`: see `batches.real_rows`
    (the repeated rows of an uneven last batch are left out)."""
    labels = labels.bool()
    token_labels = labels[scores.sequence]  # each scored token's row label
    if real is not None:
        kept = real.bool()
        labels, token_labels = labels & kept, token_labels & kept[scores.sequence]
        rejected, token_rejected = ~labels & kept, ~token_labels & kept[scores.sequence]
    else:
        rejected, token_rejected = ~labels, ~token_labels
    mean_logits = scores.mean_logits.detach()

    def total(x: torch.Tensor) -> float:
        return accelerator.gather(x.detach().float().reshape(1)).sum().item()

    n_chosen, n_rejected = total(labels.sum()), total(rejected.sum())
    out = {"loss": accelerator.gather(loss.detach().reshape(1)).mean().item(), "kl": z0.item()}
    for name, sel, n in (("chosen", labels, n_chosen), ("rejected", rejected, n_rejected)):
        if n > 0:
            out[f"rewards/{name}"] = total(rewards[sel].sum()) / n
            out[f"logps/{name}"] = total(logps.detach()[sel].sum()) / n
            tokens = token_labels if name == "chosen" else token_rejected
            n_tok = total(tokens.sum())
            if n_tok > 0:
                out[f"logits/{name}"] = total(mean_logits[tokens].sum()) / n_tok
    if n_chosen > 0 and n_rejected > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    entropy = scores.entropy if real is None else scores.entropy[real.bool()[scores.sequence]]
    n_tok = total(torch.tensor(entropy.numel(), device=labels.device))
    out["entropy"] = total(entropy.sum()) / max(n_tok, 1)
    return out


def pair_accuracy(reward: torch.Tensor, label: torch.Tensor, group: torch.Tensor) -> tuple[float, int]:
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


@torch.no_grad()
def evaluate(accelerator, scorer, loader, config: TrainConfig, groups: dict[int, int]) -> dict[str, float]:
    """Metrics over the whole eval set, TRL's names with an `eval_` prefix, plus `eval_reward_accuracy`:
    the fraction of rows whose implicit reward has the sign of its label (desirable > 0 > undesirable),
    and, where prompts have both a desirable and an undesirable row (paired data), `eval_pair_accuracy`:
    how often the desirable answer's reward beats the undesirable one's (see `pair_accuracy`).

    Per-row values are gathered across processes (dropping the rows accelerate repeats to even out the
    last batch), so the result does not depend on the number of processes or the eval batch size;
    only z0 is per batch, as in training.
    """
    was_training = scorer.training
    scorer.eval()
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    kls = []
    for i, batch in enumerate(loader):
        real = real_rows(accelerator, config.per_device_eval_batch_size, len(loader.dataset), i == len(loader) - 1)
        z0, scored, _, losses, rewards = kto_forward(accelerator, scorer, batch, config, with_stats=False, real=real)
        kls.append(z0.item())
        logps = scored.completions.logps
        for name, value in (("loss", losses), ("reward", rewards), ("logp", logps), ("label", batch["label"])):
            parts[name].append(accelerator.gather_for_metrics(value.detach().float()))
        parts["example_id"].append(accelerator.gather_for_metrics(batch["example_id"]))
    scorer.train(was_training)
    loss, reward, logp = (torch.cat(parts[k]) for k in ("loss", "reward", "logp"))
    label = torch.cat(parts["label"]).bool()
    out = {"eval_loss": loss.mean().item(), "eval_kl": sum(kls) / max(len(kls), 1)}
    for name, sel in (("chosen", label), ("rejected", ~label)):
        if sel.any():
            out[f"eval_rewards/{name}"] = reward[sel].mean().item()
            out[f"eval_logps/{name}"] = logp[sel].mean().item()
    if label.any() and (~label).any():
        out["eval_rewards/margins"] = out["eval_rewards/chosen"] - out["eval_rewards/rejected"]
    out["eval_reward_accuracy"] = torch.where(label, reward > 0, reward < 0).float().mean().item()
    out["eval_rows"] = int(label.numel())
    group = torch.tensor([groups[int(i)] for i in torch.cat(parts["example_id"]).tolist()])
    accuracy, pairs = pair_accuracy(reward.cpu(), label.cpu(), group)
    if pairs:
        out["eval_pair_accuracy"], out["eval_pairs"] = accuracy, pairs
    return out
