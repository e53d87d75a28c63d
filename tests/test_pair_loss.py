"""The pair losses (`loss.pair_loss`) against trl.DPOTrainer 1.16's own loss code, on the same log-probs.

trl computes its losses inside `DPOTrainer._compute_loss`, after its model's forward. Here that method runs on a
stand-in trainer whose "model" returns given per-token log-probs, with `precompute_ref_log_probs=True` (the
reference values come with the batch, as from a cache): every loss type, f-divergence and option is compared with
`pair_loss` on the same numbers, and the metrics trl logs with the rewards `pair_loss` returns.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from kto_pipeline.objectives.loss import pair_loss
from kto_pipeline.objectives.pairs import F_DIVERGENCE_TYPES, PAIR_LOSS_TYPES

PAIRS, WIDTH = 6, 12


def batch(seed: int = 0):
    """trl's batch layout: P chosen rows then P rejected rows, prompt then completion, right-padded; the per-token
    log-probs trl's fused head would return (0 off the completions), and reference sequence log-probs."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * PAIRS
    completion_mask = torch.zeros(rows, WIDTH, dtype=torch.long)
    attention_mask = torch.zeros(rows, WIDTH, dtype=torch.long)
    for r in range(rows):
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        length = int(torch.randint(2, WIDTH - prompt + 1, (1,), generator=g))
        attention_mask[r, : prompt + length] = 1
        completion_mask[r, prompt : prompt + length] = 1
    shift = completion_mask[:, 1:]
    log_probs = (-torch.rand(rows, WIDTH - 1, generator=g) * 3).requires_grad_()
    ref = -torch.rand(rows, generator=g) * 3 * shift.sum(1)
    return dict(
        input_ids=torch.randint(3, 50, (rows, WIDTH), generator=g),
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        ref_chosen_logps=ref[:PAIRS],
        ref_rejected_logps=ref[PAIRS:],
    ), log_probs


def trl_loss(inputs: dict, log_probs: torch.Tensor, **settings):
    """trl.DPOTrainer._compute_loss on a stand-in trainer: (loss, its logged metrics)."""
    from trl import DPOTrainer

    shift = inputs["completion_mask"][:, 1:]
    outputs = SimpleNamespace(
        log_probs=log_probs * shift,
        entropy=torch.zeros_like(log_probs),
        mean_logits=torch.zeros_like(log_probs),
        is_top1=torch.zeros_like(shift, dtype=torch.bool),
        log_sum_sq_probs=torch.zeros_like(log_probs),
    )
    metrics = {"train": {}}

    class Metrics(dict):
        def __missing__(self, key):
            self[key] = []
            return self[key]

    metrics["train"] = Metrics()
    loss_type = settings.pop("loss_type", ["sigmoid"])
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=settings.pop("ld_alpha", None),
        f_divergence_type=settings.pop("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=settings.pop("f_alpha_divergence_coef", 0.5),
        loss_types=loss_type,
        loss_weights=settings.pop("loss_weights", None) or [1.0] * len(loss_type),
        beta=settings.pop("beta", 0.1),
        label_smoothing=settings.pop("label_smoothing", 0.0),
        args=SimpleNamespace(discopop_tau=settings.pop("discopop_tau", 0.05)),
        use_weighting=False,
        _metrics=metrics,
        _total_train_tokens=0,
        _tp_size=1,
    )
    assert not settings
    loss = DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}


def ours(inputs: dict, log_probs: torch.Tensor, beta: float = 0.1, **options):
    shift = inputs["completion_mask"][:, 1:]
    token = log_probs * shift
    logps = token.sum(1)
    lengths = inputs["completion_mask"].sum(1).float()
    chosen_tokens = log_probs[:PAIRS][shift[:PAIRS].bool()]
    return pair_loss(
        logps[:PAIRS],
        logps[PAIRS:],
        inputs["ref_chosen_logps"],
        inputs["ref_rejected_logps"],
        beta,
        chosen_lengths=lengths[:PAIRS],
        rejected_lengths=lengths[PAIRS:],
        chosen_token_logps=chosen_tokens,
        **options,
    )


CASES = [
    *[dict(loss_types=[t]) for t in PAIR_LOSS_TYPES if t not in ("exo_pair", "robust")],
    dict(loss_types=["exo_pair"], label_smoothing=1e-3),  # trl's documented value for EXO
    dict(loss_types=["robust"], label_smoothing=0.2),
    dict(loss_types=["aot"], label_smoothing=0.1),
    dict(loss_types=["sigmoid"], beta=0.5),
    *[dict(loss_types=["sigmoid"], f_divergence_type=f) for f in F_DIVERGENCE_TYPES],
    dict(loss_types=["sigmoid"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    dict(loss_types=["discopop"], discopop_tau=0.2),
    dict(loss_types=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),  # MPO
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_pair_loss_equals_trls(case):
    inputs, log_probs = batch(seed=len(str(case)))
    options = dict(case)
    trl_options = {("loss_type" if k == "loss_types" else k): v for k, v in options.items()}
    want, metrics = trl_loss(inputs, log_probs, **trl_options)
    (want_grad,) = torch.autograd.grad(want, log_probs)
    loss, losses, chosen_rewards, rejected_rewards = ours(inputs, log_probs, **options)
    (grad,) = torch.autograd.grad(loss, log_probs)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert losses.shape == (PAIRS,) and math.isclose(float(losses.mean()), float(loss), rel_tol=1e-6)
    assert math.isclose(float(chosen_rewards.mean()), metrics["rewards/chosen"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(float(rejected_rewards.mean()), metrics["rewards/rejected"], rel_tol=1e-5, abs_tol=1e-7)
    margins = chosen_rewards - rejected_rewards
    assert math.isclose(float(margins.mean()), metrics["rewards/margins"], rel_tol=1e-5, abs_tol=1e-7)
    accuracy = float((chosen_rewards > rejected_rewards).float().mean())
    assert math.isclose(accuracy, metrics["rewards/accuracies"], abs_tol=1e-7)


def test_pair_loss_refuses_what_it_cannot_compute():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="unknown pair loss type 'kto'"):
        pair_loss(x, x, x, x, 0.1, ["kto"])
    with pytest.raises(ValueError, match="'ipo' needs completion lengths"):
        pair_loss(x, x, x, x, 0.1, ["ipo"])
    with pytest.raises(ValueError, match="2 loss weights for 1 loss types"):
        pair_loss(x, x, x, x, 0.1, ["sigmoid"], [1.0, 2.0])
    with pytest.raises(ValueError, match="unknown f_divergence_type"):
        pair_loss(x, x, x, x, 0.1, f_divergence_type="kl")
