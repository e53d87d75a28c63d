"""kto_loss: hand-worked values, gradients, and edge cases."""

import math

import pytest
import torch

from kto_pipeline.objectives.loss import kto_loss


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_hand_worked_kto_values():
    policy = torch.tensor([-10.0, -12.0, -8.0])
    ref = torch.tensor([-11.0, -11.0, -9.0])  # logratios +1, -1, +1
    labels = torch.tensor([True, False, False])
    loss, losses, rewards = kto_loss(policy, ref, labels, kl=0.5, beta=0.1, desirable_weight=2.0)
    expected = [2.0 * (1 - sig(0.1 * (1 - 0.5))), 1 - sig(0.1 * (0.5 + 1)), 1 - sig(0.1 * (0.5 - 1))]
    torch.testing.assert_close(losses, torch.tensor(expected))
    torch.testing.assert_close(loss, torch.tensor(sum(expected) / 3))
    torch.testing.assert_close(rewards, torch.tensor([0.1, -0.1, 0.1]))


def test_hand_worked_apo_zero_values_ignore_kl():
    policy, ref = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])  # logratios +1, -2
    labels = torch.tensor([True, False])
    loss, losses, _ = kto_loss(
        policy, ref, labels, kl=123.0, beta=0.5, loss_type="apo_zero_unpaired", undesirable_weight=3.0
    )
    torch.testing.assert_close(losses, torch.tensor([1 - sig(0.5), 3.0 * sig(-1.0)]))


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_gradient_matches_analytic(loss_type):
    policy = torch.tensor([-5.0, -6.0], requires_grad=True)
    ref = torch.tensor([-5.5, -5.0])
    labels = torch.tensor([True, False])
    beta, kl = 0.2, 0.3
    loss, _, _ = kto_loss(policy, ref, labels, kl, beta, loss_type)
    loss.backward()
    r = (policy - ref).detach()
    z = kl if loss_type == "kto" else 0.0
    # d/dr [1 - sig(b(r - z))] = -b s(1-s); undesirable kto: d/dr [1 - sig(b(z - r))] = +b s(1-s);
    # apo undesirable: d/dr sig(b r) = b s (1-s). Mean over 2 rows.
    s0 = sig(beta * (r[0].item() - z))
    s1 = sig(beta * (z - r[1].item())) if loss_type == "kto" else sig(beta * r[1].item())
    expected = torch.tensor([-beta * s0 * (1 - s0) / 2, beta * s1 * (1 - s1) / 2])
    torch.testing.assert_close(policy.grad, expected)


def test_kl_is_not_differentiated():
    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl = (policy * 0 + 0.7).mean().detach()
    loss, _, _ = kto_loss(policy, torch.zeros(2), torch.tensor([True, False]), kl, 0.1)
    loss.backward()
    assert torch.isfinite(policy.grad).all()


@pytest.mark.parametrize("labels", [[True, True, True], [False, False, False], [True]])
def test_single_sided_and_single_row_batches(labels):
    n = len(labels)
    policy = torch.linspace(-3, -1, n).requires_grad_()
    loss, losses, rewards = kto_loss(policy, torch.full((n,), -2.0), torch.tensor(labels), 0.0, 0.1)
    assert torch.isfinite(loss) and losses.shape == (n,) and rewards.shape == (n,)
    loss.backward()
    assert torch.isfinite(policy.grad).all() and policy.grad.abs().sum() > 0
    sign = -1 if labels[0] else 1  # desirable: raising logp lowers the loss
    assert (torch.sign(policy.grad) == sign).all()


def test_equal_policy_and_reference_give_half_loss_and_zero_reward():
    p = torch.tensor([-4.0, -7.0])
    loss, _, rewards = kto_loss(p, p.clone(), torch.tensor([True, False]), 0.0, 0.1)
    assert loss.item() == pytest.approx(0.5)
    assert rewards.abs().max() == 0


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="loss_type"):
        kto_loss(torch.zeros(1), torch.zeros(1), torch.tensor([True]), 0.0, 0.1, loss_type="sigmoid")
    with pytest.raises(ValueError, match="at least one"):
        kto_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), 0.0, 0.1)


def test_sequence_sums_do_not_depend_on_the_order_of_the_additions():
    """Training's sums of token log-probs (`sequence_sums`) equal the cache's (`token_sum`) in any order of the
    additions, as a GPU's index_add makes them: float64 accumulation rounded once. Summed in float32, the same values
    in another order give other sums (the test's power)."""
    import numpy as np

    from kto_pipeline.cache import token_sum
    from kto_pipeline.scoring.logprobs import sequence_sums

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 600, (200,), generator=generator)
    values = torch.log(torch.rand(int(lengths.sum()), generator=generator)) * 3  # log-prob like: -3 * Exp(1)
    sequence = torch.arange(len(lengths)).repeat_interleave(lengths)
    cached = [token_sum(v.numpy()) for v in values.split(lengths.tolist())]
    in_float32 = []
    for seed in range(5):
        order = torch.randperm(len(values), generator=torch.Generator().manual_seed(seed))
        sums = sequence_sums(values[order], sequence[order], len(lengths))
        assert sums.dtype == torch.float32 and sums.tolist() == cached
        in_float32.append(torch.zeros(len(lengths)).index_add(0, sequence[order], values[order]))
    assert any(not torch.equal(in_float32[0], other) for other in in_float32[1:])
    assert np.float32(cached[0]) == cached[0] and sequence_sums(values[:0], sequence[:0], 2).tolist() == [0.0, 0.0]
