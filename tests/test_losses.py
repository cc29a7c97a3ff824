"""The training objectives (SFT, Bradley-Terry, PPO) against hand-computed values."""

import math

import pytest
import torch

from reprorl.model import losses


def test_gae_on_a_hand_computed_three_step_episode():
    rewards = torch.tensor([[0.1, -0.2, 1.0]])
    values = torch.tensor([[0.5, 0.3, 0.4]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages, returns = losses.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # delta2 = 1.0 - 0.4; delta1 = -0.2 + 0.4 - 0.3; delta0 = 0.1 + 0.3 - 0.5
    a2 = 0.6
    a1 = -0.1 + 0.95 * a2
    a0 = -0.1 + 0.95 * a1
    assert advantages[0].tolist() == pytest.approx([a0, a1, a2])
    assert returns[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.3, a2 + 0.4])


def test_terminal_score_once_at_the_last_token_and_cut_penalty():
    logp_old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    logp_ref = torch.tensor([[-1.5, -2.0, -0.5], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    scores = torch.tensor([2.0, 3.0])
    cut = torch.tensor([False, True])
    rewards = losses.token_rewards(logp_old, logp_ref, mask, scores, cut, kl_coef=0.02,
                                     cut_penalty=1.0)
    assert rewards[0].tolist() == pytest.approx([-0.02 * 0.5, 0.0, 2.0])
    assert rewards[1].tolist() == pytest.approx([0.02 * 0.5, 3.0 - 1.0, 0.0])


def test_no_bootstrap_past_the_end():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    small = torch.tensor([[0.2, 0.1, 0.0]])
    huge = torch.tensor([[0.2, 0.1, 1000.0]])  # a value after the end must not leak in
    a_small, _ = losses.gae(rewards, small, mask)
    a_huge, _ = losses.gae(rewards, huge, mask)
    assert torch.equal(a_small, a_huge)
    assert a_small[0].tolist() == pytest.approx([(0 + 0.1 - 0.2) + 0.95 * 0.9, 0.9, 0.0])


def test_left_and_right_padding_give_the_same_targets():
    """Responses batched with others (either padding side) get their own targets."""
    r = [[0.1, 0.2, 0.3, 1.0], [0.5, -1.0]]
    v = [[0.0, 0.1, 0.2, 0.3], [0.4, 0.2]]
    alone = [losses.gae(torch.tensor([x]), torch.tensor([y]),
                          torch.ones(1, len(x), dtype=torch.bool))[0][0] for x, y in zip(r, v)]
    right = torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bool)
    left = torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bool)
    for i, (x, y) in enumerate(zip(r, v)):
        n = len(x)
        right[0][i, :n], right[1][i, :n], right[2][i, :n] = torch.tensor(x), torch.tensor(y), 1
        left[0][i, 4 - n:], left[1][i, 4 - n:], left[2][i, 4 - n:] = (
            torch.tensor(x), torch.tensor(y), True)
    a_right, _ = losses.gae(*right)
    a_left, _ = losses.gae(*left)
    for i, expected in enumerate(alone):
        n = len(expected)
        torch.testing.assert_close(a_right[i, :n], expected)
        torch.testing.assert_close(a_left[i, 4 - n:], expected)
    assert a_right[1, 2:].abs().sum() == 0 and a_left[1, :2].abs().sum() == 0


@pytest.mark.parametrize(
    "advantage, ratio, expected",
    [
        (1.0, 1.5, -1.2),  # positive A: gains above 1+eps are clipped
        (1.0, 0.5, -0.5),  # positive A, ratio below: not clipped (pessimistic min)
        (-1.0, 0.5, 0.8),  # negative A: ratio below 1-eps is clipped
        (-1.0, 1.5, 1.5),  # negative A, ratio above: not clipped
    ],
)
def test_clipping_sides(advantage, ratio, expected):
    logp = torch.log(torch.tensor([[ratio]]))
    loss, _ = losses.actor_loss(logp, torch.zeros(1, 1), torch.tensor([[advantage]]),
                                  torch.ones(1, 1, dtype=torch.bool), clip=0.2)
    assert loss.item() == pytest.approx(expected)


def test_actor_and_critic_gradients_match_hand_values():
    # response 0: 2 tokens, response 1: 1 token (+1 padding)
    mask = torch.tensor([[True, True], [True, False]])
    logp_old = torch.zeros(2, 2)
    ratios = torch.tensor([[1.1, 1.5], [0.9, 1.0]])
    advantages = torch.tensor([[2.0, 1.0], [-3.0, 0.0]])
    logp = torch.log(ratios).requires_grad_(True)
    loss, stats = losses.actor_loss(logp, logp_old, advantages, mask, clip=0.2)
    loss.backward()
    # d/dlogp of -A*ratio is -A*ratio where unclipped, 0 where clipped; weight 1/(n_i * B)
    expected = torch.tensor([[-2.0 * 1.1 / 4, 0.0], [3.0 * 0.9 / 2, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    values = torch.tensor([[1.0, 2.0], [0.5, 9.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 1.0], [1.5, 0.0]])
    critic = losses.critic_loss(values, returns, mask)
    assert critic.item() == pytest.approx(((0.5 + 0.5) / 2 + 0.5) / 2)
    critic.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[1.0 / 4, 1.0 / 4], [-1.0 / 2, 0.0]]))


def test_short_and_long_responses_weigh_the_same():
    mask = torch.tensor([[True, False, False, False], [True, True, True, True]])
    per_token = torch.tensor([[4.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # per-response means 4 and 1, averaged: 2.5 (a token mean would give 8/5 = 1.6)
    assert losses.per_response_mean(per_token, mask).item() == pytest.approx(2.5)


def test_sft_loss_is_token_sum_over_token_count():
    # two responses: 1 token and 3 tokens (left padding, as the batches are)
    logprobs = torch.tensor([[0.0, 0.0, -2.0], [-1.0, -1.0, -4.0]])
    mask = torch.tensor([[False, False, True], [True, True, True]])
    loss = losses.sft_loss(logprobs, mask)
    assert loss.item() == pytest.approx((2 + 1 + 1 + 4) / 4)  # 2.0
    mean_of_means = (2 / 1 + 6 / 3) / 2  # what it must not be: 2.0 too here, so check another
    logprobs[0, 2] = -6.0
    assert losses.sft_loss(logprobs, mask).item() == pytest.approx(12 / 4)
    assert losses.sft_loss(logprobs, mask).item() != pytest.approx((6 / 1 + 6 / 3) / 2)
    assert mean_of_means == 2.0


def test_bradley_terry_value_and_gradient():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0])
    loss = losses.bradley_terry_loss(chosen, rejected)
    expected = (math.log1p(math.exp(-1)) + math.log1p(math.exp(1))) / 2
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # d/dc of -log sigmoid(c - r), averaged over 2 pairs
    assert chosen.grad.tolist() == pytest.approx([-(1 - sigmoid(1)) / 2, -(1 - sigmoid(-1)) / 2])
