"""The losses as pure functions of tensors: KTO's, and trl.DPOTrainer's pair losses (below).

KTO (Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306, eq. 7) scores each completion by its
implicit reward r = beta * (log pi(y|x) - log pi_ref(y|x)) relative to a reference point z0, an
estimate of KL(pi || pi_ref) from mismatched (prompt, other completion) pairs:

    desirable:    1 - sigmoid(beta * (logratio - z0))
    undesirable:  1 - sigmoid(beta * (z0 - logratio))

`apo_zero_unpaired` (D'Oosterlinck et al. 2024, https://arxiv.org/abs/2408.06266) needs no z0:

    desirable:    1 - sigmoid(beta * logratio)
    undesirable:  sigmoid(beta * logratio)

z0 is computed by the caller (it is a mean over the *global* batch, so it needs a collective, and
collectives do not belong in a loss function). Semantics match trl.KTOTrainer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kto_pipeline.scoring.logprobs import sequence_sums


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO loss of a batch of unpaired examples.

    Args:
        policy_logps: (B,) summed completion log-probs under the policy (with grad).
        ref_logps: (B,) the same under the reference model.
        labels: (B,) bool, True = desirable.
        kl: scalar z0 >= 0, already detached and clamped (ignored by `apo_zero_unpaired`).
        beta: lower beta means we care less about staying close to the reference.

    Returns:
        loss: scalar, mean over the batch of the weighted per-example losses;
        losses: (B,) weighted per-example losses;
        rewards: (B,) detached implicit rewards beta * (policy_logps - ref_logps).
    """
    if loss_type not in ("kto", "apo_zero_unpaired"):
        raise ValueError(f"unknown loss_type {loss_type!r}; expected kto or apo_zero_unpaired")
    if policy_logps.shape[0] == 0:
        raise ValueError("kto_loss needs at least one example")
    labels = labels.to(device=policy_logps.device, dtype=torch.bool)
    logratios = policy_logps - ref_logps.to(policy_logps)  # (B,)
    kl = torch.as_tensor(kl, dtype=logratios.dtype, device=logratios.device)
    if loss_type == "kto":
        desirable = 1 - F.sigmoid(beta * (logratios - kl))
        undesirable = 1 - F.sigmoid(beta * (kl - logratios))
    else:
        desirable = 1 - F.sigmoid(beta * logratios)
        undesirable = F.sigmoid(beta * logratios)
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses.mean(), losses, beta * logratios.detach()


# ------------------------------------------------------------------------------------------ pair losses
#
# The losses of trl.DPOTrainer (1.16), for (prompt, chosen, rejected) pairs, with trl's names, defaults and
# formulas (its `_compute_loss`). Each pair's sequence log-probs under the policy and the reference give the log
# ratios; an f-divergence turns them into scores (reverse KL: the log ratios themselves, standard DPO).


def f_divergence_scores(logratios: torch.Tensor, f_divergence_type: str, alpha: float = 0.5) -> torch.Tensor:
    """f'(policy / reference) of each log ratio: the score DPO's margin compares (trl's `f_divergence_type`)."""
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":  # f'(t) = 1 - 1/t
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":  # f'(t) = log(2t / (t + 1))
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":  # f'(t) = (t^(alpha - 1) - 1) / (alpha - 1)
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        t = (alpha - 1.0) * logratios
        clamp = {torch.float16: 11.0}.get(t.dtype, 80.0)  # exp(.) representable after the cast back
        return (torch.exp(torch.clamp(t.float(), max=clamp)) - 1.0).to(t.dtype) / (alpha - 1.0)
    raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}")


def pair_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_types: tuple[str, ...] | list[str] = ("sigmoid",),
    loss_weights: tuple[float, ...] | list[float] | None = None,
    *,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    chosen_token_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pair loss of a batch of (chosen, rejected) pairs: trl.DPOTrainer's, one loss or a weighted sum of
    several (`loss_weights`, default 1 each: trl's MPO combinations).

    Args:
        chosen_logps, rejected_logps: (P,) summed completion log-probs under the policy (with grad).
        ref_chosen_logps, ref_rejected_logps: (P,) the same under the reference.
        chosen_lengths, rejected_lengths: (P,) completion tokens ("ipo", "sigmoid_norm" average per token).
        chosen_token_logps: (T,) the policy's log-probs of every chosen completion token of the batch ("sft").

    Returns:
        loss: scalar, sum over the losses of weight x mean over pairs;
        losses: (P,) the same per pair (for "sft": its batch mean, repeated);
        chosen_rewards, rejected_rewards: (P,) detached beta * log ratios (trl's `rewards/chosen`, ...).
    """
    loss_weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(loss_weights) != len(loss_types):
        raise ValueError(f"{len(loss_weights)} loss weights for {len(loss_types)} loss types")
    if chosen_logps.shape[0] == 0:
        raise ValueError("pair_loss needs at least one pair")
    chosen_logratios = chosen_logps - ref_chosen_logps.to(chosen_logps)
    rejected_logratios = rejected_logps - ref_rejected_logps.to(rejected_logps)
    chosen_scores = f_divergence_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
    delta = chosen_scores - rejected_scores
    losses = chosen_logps.new_zeros(chosen_logps.shape[0])
    for loss_type, weight in zip(loss_types, loss_weights, strict=True):
        losses = losses + weight * _one_pair_loss(
            loss_type,
            beta,
            delta,
            chosen_logratios,
            rejected_logratios,
            chosen_scores,
            rejected_scores,
            chosen_logps - rejected_logps,
            ref_chosen_logps.to(chosen_logps) - ref_rejected_logps.to(chosen_logps),
            label_smoothing,
            discopop_tau,
            chosen_lengths,
            rejected_lengths,
            chosen_token_logps,
        )
    return losses.mean(), losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def _need(value, loss_type: str, what: str):
    if value is None:
        raise ValueError(f"loss type {loss_type!r} needs {what}")
    return value


def _one_pair_loss(
    loss_type,
    beta,
    delta,
    chosen_logratios,
    rejected_logratios,
    chosen_scores,
    rejected_scores,
    logratios,
    ref_logratios,
    label_smoothing,
    discopop_tau,
    chosen_lengths,
    rejected_lengths,
    chosen_token_logps,
) -> torch.Tensor:
    """(P,) losses of one of trl.DPOTrainer 1.16's loss types, as it computes them."""
    if loss_type == "sigmoid":  # DPO
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":  # SLiC
        return torch.relu(1 - beta * delta)
    if loss_type in ("ipo", "sigmoid_norm"):  # per-token average scores
        chosen = chosen_scores / _need(chosen_lengths, loss_type, "completion lengths").clamp(min=1.0)
        rejected = rejected_scores / _need(rejected_lengths, loss_type, "completion lengths").clamp(min=1.0)
        if loss_type == "ipo":  # eq. 17 of the IPO paper, beta as its tau
            return (chosen - rejected - 1 / (2 * beta)) ** 2
        return -F.logsigmoid(beta * (chosen - rejected))
    if loss_type == "exo_pair":  # EXO-pref, eq. 16 (K = 2)
        epsilon = torch.tensor(label_smoothing, device=delta.device)
        qw, log_qw = torch.sigmoid(beta * delta), F.logsigmoid(beta * delta)
        ql, log_ql = torch.sigmoid(-beta * delta), F.logsigmoid(-beta * delta)
        return qw * (log_qw - torch.log1p(-epsilon)) + ql * (log_ql - torch.log(epsilon))
    if loss_type == "nca_pair":
        chosen, rejected = beta * chosen_logratios, beta * rejected_logratios
        return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    if loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
    if loss_type == "sppo_hard":
        return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):  # sorted across the batch
        if loss_type == "aot":
            d = torch.sort(logratios, dim=0)[0] - torch.sort(ref_logratios, dim=0)[0]
        else:
            d = torch.sort(chosen_logratios, dim=0)[0] - torch.sort(rejected_logratios, dim=0)[0]
        return -F.logsigmoid(beta * d) * (1 - label_smoothing) - F.logsigmoid(-beta * d) * label_smoothing
    if loss_type == "apo_zero":  # eq. 7 of the APO paper
        return (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
    if loss_type == "apo_down":  # eq. 8
        margin = beta * (chosen_logratios - rejected_logratios)
        return torch.sigmoid(beta * chosen_logratios) + (1 - torch.sigmoid(margin))
    if loss_type == "discopop":  # eq. 5 of the DiscoPOP paper
        logits = beta * delta
        modulation = torch.sigmoid(logits / discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    if loss_type == "sft":  # the chosen completions' mean token NLL, the same for every pair
        tokens = _need(chosen_token_logps, loss_type, "the chosen completions' token log-probs")
        return (-tokens.mean()).expand(delta.shape[0])
    raise ValueError(f"unknown pair loss type {loss_type!r}")


def length_desensitized(
    token_logps: torch.Tensor,
    sequence: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    ld_alpha: float,
) -> torch.Tensor:
    """LD-DPO's sequence log-probs (trl's `ld_alpha`) of P pairs' answers: each answer's first tokens, as many as
    its pair's shorter answer has, count once, the tokens beyond them `ld_alpha` times.

    token_logps, sequence: (N,) log-probs of the answers' tokens, ordered by sequence then position, sequence 2i
    pair i's chosen answer and 2i + 1 its rejected one; chosen_lengths, rejected_lengths: (P,) their tokens.
    Returns (2P,), in the same order."""
    num_sequences = 2 * len(chosen_lengths)
    shared = torch.minimum(chosen_lengths, rejected_lengths).repeat_interleave(2)
    counts = torch.bincount(sequence, minlength=num_sequences)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(len(sequence), device=sequence.device) - starts[sequence]
    weight = torch.where(position < shared.to(sequence.device)[sequence], 1.0, ld_alpha).to(token_logps.dtype)
    return sequence_sums(token_logps * weight, sequence, num_sequences)
