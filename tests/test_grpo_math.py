"""GRPO formulas and flow-control rules, checked against hand computations."""

import math
import pickle

import numpy as np
import pytest
import torch

from reprorl.grpo import AsyncGRPOConfig
from reprorl.grpo.batching import TokenBudgetBatcher, pad_collate
from reprorl.grpo.flow import has_room
from reprorl.grpo.metrics import MetricsWindow, rule
from reprorl.grpo.sample_queue import is_stale
from reprorl.grpo.samples import Sample, TrainingSequence, TurnRecord, reconcile_turns
from reprorl.grpo.worker import request_seed
from reprorl.model.grpo_losses import (
    centered_score_loss,
    clip_fractions,
    clipped_surrogate_loss,
    group_advantages,
    group_is_dropped,
    importance_weights,
    token_mean,
)


def test_advantages_standardise_within_the_group():
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    expected = (rewards - 0.5) / (np.std(rewards, ddof=1) + 1e-4)
    np.testing.assert_allclose(group_advantages(rewards), expected)
    assert abs(group_advantages(rewards).sum()) < 1e-12


def test_nan_rewards_get_zero_and_stay_out_of_mean_and_std():
    rewards = np.array([2.0, math.nan, 0.0, 1.0])
    scored = np.array([2.0, 0.0, 1.0])
    advantages = group_advantages(rewards)
    assert advantages[1] == 0.0
    np.testing.assert_allclose(advantages[[0, 2, 3]],
                               (scored - 1.0) / (scored.std(ddof=1) + 1e-4))


@pytest.mark.parametrize("rewards, dropped", [
    ([1.0, 1.0, 1.0, 1.0], True),  # all solved
    ([0.0, 0.0, math.nan, 0.0], True),  # equal among the scored
    ([math.nan, math.nan, 1.0, math.nan], True),  # fewer than two scored
    ([math.nan] * 4, True),
    ([0.0, 1.0, math.nan, 0.0], False),
])
def test_group_dropping(rewards, dropped):
    assert group_is_dropped(np.array(rewards)) is dropped
    if dropped:  # a dropped group's advantages are zero anyway (or NaN-free)
        assert not np.isnan(group_advantages(np.array(rewards))).any()


def test_masked_importance_sampling_bounds_are_inclusive():
    sampler = torch.zeros(5)
    logp = torch.log(torch.tensor([0.49, 0.5, 1.0, 5.0, 5.01]))
    ratio, keep = importance_weights(logp, sampler, 0.5, 5.0)
    torch.testing.assert_close(ratio, torch.tensor([0.49, 0.5, 1.0, 5.0, 5.01]))
    assert keep.tolist() == [False, True, True, True, False]


def _toy(vocab=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocab, generator=generator, requires_grad=True)
    mu = torch.softmax(torch.randn(vocab, generator=generator), -1)
    return theta, mu


def _expected_centered_gradient(theta, mu, support):
    """E_{y ~ mu restricted to `support`} of the gradient of the centered score (A=1, w=1)."""
    logpi = torch.log_softmax(theta, -1)
    probs = mu[support] / mu[support].sum()
    total = torch.zeros_like(theta)
    for y, p in zip(support, probs):
        grad, = torch.autograd.grad(
            logpi[y] - (probs * logpi[support]).sum(), theta, retain_graph=True)
        total += p * grad
    return total


def test_centered_score_has_zero_expectation_under_the_sampler():
    theta, mu = _toy()
    full = list(range(5))
    torch.testing.assert_close(_expected_centered_gradient(theta, mu, full),
                               torch.zeros(5), atol=1e-7, rtol=0)
    # with a truncated K (renormalised weights): zero under the sampler restricted to K
    top3 = mu.argsort(descending=True)[:3].tolist()
    torch.testing.assert_close(_expected_centered_gradient(theta, mu, top3),
                               torch.zeros(5), atol=1e-7, rtol=0)
    # the uncentered score does not average to zero under mu when pi != mu
    logpi = torch.log_softmax(theta, -1)
    raw = sum(mu[y] * torch.autograd.grad(logpi[y], theta, retain_graph=True)[0] for y in full)
    assert raw.abs().max() > 1e-2


def test_centered_score_loss_matches_the_formula():
    theta, mu = _toy(vocab=6, seed=3)
    scores = torch.log_softmax(theta, -1)
    top = mu.argsort(descending=True)[:4]
    y = int(top[1])
    logp = scores[y].reshape(1, 1)
    topk_logp = scores[top].reshape(1, 1, 4)
    sampler_topk = mu[top].log().reshape(1, 1, 4)
    ratio = torch.tensor([[1.5]])
    keep = torch.tensor([[True]])
    advantage = torch.tensor([0.7])
    loss = centered_score_loss(logp, topk_logp, sampler_topk, advantage, ratio, keep)
    weights = mu[top] / mu[top].sum()
    expected = -0.7 * 1.5 * (scores[y] - (weights * scores[top]).sum())
    torch.testing.assert_close(loss[0, 0], expected)
    masked = centered_score_loss(logp, topk_logp, sampler_topk, advantage, ratio,
                                 torch.tensor([[False]]))
    assert float(masked.detach()) == 0.0
    # the importance weight is a constant: no gradient flows through it
    ratio_param = torch.tensor([[1.5]], requires_grad=True)
    assert not centered_score_loss(logp.detach(), topk_logp.detach(), sampler_topk, advantage,
                                   ratio_param, keep).requires_grad


def test_clipped_surrogate_signs_and_clipping():
    sampler = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.1]])).requires_grad_(True)
    keep = torch.ones(1, 4, dtype=torch.bool)
    for advantage in (1.0, -1.0):
        loss = clipped_surrogate_loss(logp, sampler, torch.tensor([advantage]), keep, 0.2, 0.28)
        grad, = torch.autograd.grad(loss.sum(), logp)
        g = grad[0].tolist()
        if advantage > 0:  # descent raises log pi (negative gradient) unless clipped above
            assert g[0] < 0 and g[3] < 0 and g[2] < 0
            assert g[1] == 0.0  # rho = 1.5 > 1.28: clipped, no gradient
        else:  # descent lowers log pi unless clipped below
            assert g[0] > 0 and g[1] > 0 and g[3] > 0
            assert g[2] == 0.0  # rho = 0.5 < 0.8: clipped, no gradient
    masked = clipped_surrogate_loss(logp, sampler, torch.tensor([1.0]),
                                    torch.zeros(1, 4, dtype=torch.bool), 0.2, 0.2)
    assert float(masked.detach().abs().sum()) == 0.0


def test_token_mean_and_clip_fractions():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    trained = torch.tensor([[False, True, True], [True, False, False]])
    assert float(token_mean(per_token, trained)) == pytest.approx((2 + 3 + 4) / 3)
    ratio = torch.tensor([[0.5, 1.5, 1.0], [0.5, 1.0, 1.0]])
    fractions = clip_fractions(ratio, torch.tensor([1.0, -1.0]), trained, 0.2, 0.2)
    assert fractions["high"].tolist() == [0.5, 0.0]
    assert fractions["low"].tolist() == [0.0, 1.0]


def test_token_allowance_rule():
    assert has_room(0, 0, [], 0)  # nothing queued or in flight: always start
    assert not has_room(0, 1, [], 10_000)  # size unknown until a group finishes
    assert has_room(100, 1, [100.0], 300)  # 100 queued + 2 x 100 <= 300
    assert not has_room(101, 1, [100.0], 300)
    assert not has_room(250, 0, [100.0], 300)


def test_staleness_rule():
    assert not is_stale(5, 1, 4)
    assert is_stale(6, 1, 4)
    assert is_stale(1, 0, 0) and not is_stale(0, 0, 0)


def test_metric_window_rules():
    assert rule("sample/dropped_stale_count") == "sum"
    assert rule("completions/max_length") == "max"
    assert rule("completions/mean_terminated_length") == "mean"  # 'terminated' is not 'min'
    assert rule("clip_ratio/low_min") == "min"
    assert rule("rollout/generated_tokens_per_s") == "rate"
    window = MetricsWindow()
    for value in (1, 2, 3):
        window.add("sample/dropped_stale_count", value)
        window.add("sample/staleness_max", value)
        window.add("completions/min_length", value)
        window.add("reward", value)
    window.add_rate("rollout/generated_tokens_per_s", 100, 1.0)
    window.add_rate("rollout/generated_tokens_per_s", 300, 3.0)
    assert window.reduce() == {"completions/min_length": 1, "reward": 2,
                               "rollout/generated_tokens_per_s": 100.0,
                               "sample/dropped_stale_count": 6, "sample/staleness_max": 3}
    with pytest.raises(ValueError):
        window.add("perf/wall_clock_trained_tokens_per_s", 1.0)


def test_turns_continue_or_fork_into_training_sequences():
    first = TurnRecord([1, 2], [3, 4], [-0.1, -0.2])
    follow = TurnRecord([1, 2, 3, 4, 9], [5], [-0.3])  # extends the history: same sequence
    fork = TurnRecord([1, 7], [8], [-0.4])  # history rewritten: a new sequence
    sequences = reconcile_turns([first, follow, fork])[0]
    assert [s.input_ids for s in sequences] == [[1, 2, 3, 4, 9, 5], [1, 7, 8]]
    assert sequences[0].trained == [0, 0, 1, 1, 0, 1]
    assert sequences[0].sampler_logprobs == [0, 0, -0.1, -0.2, 0, -0.3]
    # one drift per transition: 0 for the continuation; the fork keeps [1] and re-renders the
    # 5 retained tokens after it
    assert reconcile_turns([first, follow, fork])[1] == [0, 5]
    assert reconcile_turns([first])[1] == []


def test_request_seeds_depend_on_the_rollout_not_on_a_counter():
    seeds = {request_seed(42, key, n) for key in range(50) for n in (1, 2)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 - 1 for s in seeds)
    assert request_seed(42, 7, 1) == request_seed(42, 7, 1) != request_seed(43, 7, 1)
    assert request_seed(-3, None, 1) not in seeds and request_seed(42, None, 1) not in seeds


def _sample(tokens: int, trained: int = 2) -> Sample:
    ids = list(range(1, tokens + 1))
    flags = [0] * (tokens - trained) + [1] * trained
    sequence = TrainingSequence(ids, flags, [-0.5 * f for f in flags],
                                [{ids[i]: -0.5, 0: -1.0} if f else None
                                 for i, f in enumerate(flags)])
    return Sample(sequence, 1.0, 1.0, {}, 1.0, {}, 0, 0, 0, 1, tokens, 0.0, "id", "")


def test_padded_layout_and_the_token_budget():
    batch = pad_collate([_sample(3), _sample(5, trained=3)], top_k=2, pad_id=0)
    (forward,) = batch.forwards
    assert forward.input_ids.tolist() == [[0, 0, 1, 2, 3], [1, 2, 3, 4, 5]]
    assert batch.trained.tolist() == [[False, True, True], [True] * 3]
    assert batch.top_sampler_logp[0, 1].tolist() == [-0.5, -1.0]
    assert forward.keep.tolist() == [1, 2, 3] and batch.padding == 2  # column c: one before
    batcher = TokenBudgetBatcher(token_budget=12, rows=1, top_k=2, pad_id=0)
    assert batcher.oversize(_sample(13)) and not batcher.oversize(_sample(12))
    assert batcher.fits([_sample(4)], _sample(12))  # its first 4 tokens are shared: 12 in all
    assert not batcher.fits([_sample(4)], _sample(13))


def test_config_defaults_and_refusals():
    config = AsyncGRPOConfig()
    assert (config.num_generations, config.max_staleness, config.num_sampler_logprobs,
            config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max,
            config.max_concurrent_rollouts, config.learning_rate, config.epsilon_high) == (
        8, 4, 8, 0.5, 5.0, 512, 1e-6, 0.2)
    assert all(AsyncGRPOConfig.help().values())
    pickle.dumps(config)
    with pytest.raises(ValueError, match="need top_k > 0"):
        AsyncGRPOConfig(top_p=0.9)
    with pytest.raises(ValueError, match="need top_k > 0"):
        AsyncGRPOConfig(min_p=0.1)
    assert AsyncGRPOConfig(top_p=0.9, top_k=20).truncated_sampling
    assert not AsyncGRPOConfig().truncated_sampling
    with pytest.raises(ValueError, match="max_steps"):
        AsyncGRPOConfig(lr_scheduler_type="linear")
    assert (config.gradient_checkpointing, config.bf16, config.ignore_data_skip, config.optim,
            config.train_sampling_strategy, config.disable_tqdm, config.dtype) == (
        True, None, True, "adamw_torch_fused", "random", None, "float32")
    assert AsyncGRPOConfig(max_steps=10, logging_steps=0.25).steps_of("logging_steps") == 3
    assert AsyncGRPOConfig(logging_steps=5.0).steps_of("logging_steps") == 5
    with pytest.raises(ValueError, match="fraction of max_steps"):
        AsyncGRPOConfig(save_steps=0.5).steps_of("save_steps")
    assert AsyncGRPOConfig(chat_template_kwargs='{"x": 1}').chat_template_kwargs == {"x": 1}
    for bad, match in (({"ignore_data_skip": False}, "replay"), ({"dtype": "fp8"}, "dtype"),
                       ({"logging_steps": 2.5}, "whole number"),
                       ({"save_steps": float("inf")}, "number > 0")):
        with pytest.raises(ValueError, match=match):
            AsyncGRPOConfig(**bad)
