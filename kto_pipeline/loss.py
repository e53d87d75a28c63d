"""The KTO loss as a pure function of tensors.

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

import torch
import torch.nn.functional as F

from kto_pipeline.config import LOSS_TYPES


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
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
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
