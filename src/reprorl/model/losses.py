"""The training objectives as pure functions of tensors (no model in here).

Supervised warm start and reward model:
- SFT: the summed negative log-likelihood of the response tokens of an update's examples over
  their total count (not a mean of per-example means): -sum(mask * logp) / sum(mask);
- Bradley-Terry: -mean(log sigmoid(r_chosen - r_rejected)) over the update's pairs.

PPO targets and losses, on detached rollout tensors:

Layout: (B, T) tensors with `mask` True on each response's tokens, which are contiguous: at the
left (right padding) or at the right (left padding, as model batches come). The done flag is
True at each response's last token: an EOS and a cut at the length limit both end the episode,
and nothing is bootstrapped past it. Positions outside the mask come out as zero.

- token rewards: r_t = -kl_coef * (logp_old_t - logp_ref_t); the reward-model score is added
  once at the last token, and a cut response gets -cut_penalty there as well;
- GAE (gamma, lambda), backwards:  delta_t = r_t + gamma (1 - done_t) V_{t+1} - V_t,
  A_t = delta_t + gamma lambda (1 - done_t) A_{t+1};  returns = A + V_old;
- actor: ratio = exp(logp - logp_old), loss = -min(ratio A, clip(ratio, 1-eps, 1+eps) A);
- critic: 0.5 (V - R)^2;
both reduced as a mean over each response's tokens, then a mean over responses, so a long
response weighs as much as a short one. No advantage whitening, no value clipping, no entropy
bonus (docs/pipeline.md lists where this departs from TRL's PPO).
"""

from __future__ import annotations

import torch

from .encoding import last_token_mask


def sft_loss(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the masked tokens over their total count."""
    return -(token_logprobs * mask).sum() / mask.sum()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


def token_rewards(logp_old: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor,
                  scores: torch.Tensor, cut: torch.Tensor, kl_coef: float = 0.02,
                  cut_penalty: float = 1.0) -> torch.Tensor:
    rewards = -kl_coef * (logp_old - logp_ref) * mask
    terminal = scores - cut_penalty * cut.to(scores.dtype)
    return rewards + last_token_mask(mask) * terminal.unsqueeze(1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns; zero outside the mask."""
    dones = last_token_mask(mask).to(rewards.dtype)
    steps = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(steps)):
        next_values = values[:, t + 1] if t + 1 < steps else torch.zeros_like(values[:, t])
        nonterminal = 1.0 - dones[:, t]
        deltas = rewards[:, t] + gamma * nonterminal * next_values - values[:, t]
        lastgaelam = deltas + gamma * lam * nonterminal * lastgaelam
        advantages[:, t] = lastgaelam * mask[:, t]
    returns = (advantages + values) * mask
    return advantages, returns


def per_response_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each response's active tokens, then over responses."""
    return ((x * mask).sum(1) / mask.sum(1)).mean()


def actor_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, clip: float = 0.2) -> tuple[torch.Tensor, dict]:
    ratio = torch.exp(logp - logp_old)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = per_response_mean(torch.max(pg_loss1, pg_loss2), mask)
    with torch.no_grad():
        clipped = (pg_loss2 > pg_loss1) & mask  # where the clip binds (TRL's clipfrac)
        stats = {"clip_fraction": float(clipped.sum() / mask.sum()),
                 "ratio_max": float(ratio[mask].max()), "ratio_min": float(ratio[mask].min())}
    return loss, stats


def critic_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_response_mean(0.5 * (values - returns) ** 2, mask)
