"""GRPO advantages and per-token losses, as pure functions.

Advantages: within a group, each scored reward is standardised, `(r - mean) / (std + 1e-4)`
with the unbiased std (TRL's GRPO convention); an unscored rollout (NaN) gets 0 and is left
out of the mean and std. A group with fewer than two scored rollouts, or whose scored rewards
are all equal, carries no signal and is dropped (`frac_reward_zero_std`).

Loss of trained token t, with sampler log-prob log mu_t and policy log-prob log pi_t (both at
the sampler's temperature):
- masked importance sampling: rho_t = exp(log pi_t - log mu_t), w_t = rho_t when
  C_min <= rho_t <= C_max, else the token is left out of the loss (w_t = 0);
- score centering (default): L_t = -A sg(w_t) (log pi(y_t) - sum_{y in K_t} mu~(y) log pi(y)),
  K_t the sampler's top tokens at t. We *renormalise* mu~ over K_t (mu~ = mu / mu(K_t)): the
  subtracted term is then the sampler's expectation of the score given K_t, so the centered
  score has exactly zero expectation under the sampler restricted to K_t, and under the full
  sampler whenever K_t covers its support. The uncovered mass is logged as
  `sampling/sampler_mass`;
- clipped surrogate (score_centering=False): -min(rho A, clip(rho, 1-eps, 1+eps_high) A) on the
  unmasked tokens.
The per-token losses are summed and divided by the trained tokens of the micro-batch (masked
ones included: they are trained tokens whose weight is zero); the trainer then divides by the
accumulation steps.
"""

from __future__ import annotations

import numpy as np
import torch

STD_EPS = 1e-4


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """One advantage per rollout; NaN rewards get 0 and stay out of mean and std."""
    rewards = np.asarray(rewards, dtype=np.float64)
    advantages = np.zeros_like(rewards)
    scored = ~np.isnan(rewards)
    if scored.sum() >= 2:
        values = rewards[scored]
        advantages[scored] = (values - values.mean()) / (values.std(ddof=1) + STD_EPS)
    return advantages


def group_is_dropped(rewards: np.ndarray) -> bool:
    """No signal: fewer than two scored rollouts, or all scored rewards equal."""
    scored = np.asarray(rewards, dtype=np.float64)
    scored = scored[~np.isnan(scored)]
    return len(scored) < 2 or bool(np.all(scored == scored[0]))


def importance_weights(logp: torch.Tensor, sampler_logp: torch.Tensor, clip_min: float,
                       clip_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rho_t = pi/mu and the mask of tokens kept in the loss (C_min <= rho <= C_max)."""
    ratio = torch.exp(logp - sampler_logp)
    keep = (ratio >= clip_min) & (ratio <= clip_max)
    return ratio, keep


def centered_score_loss(logp: torch.Tensor, topk_logp: torch.Tensor,
                        sampler_topk_logp: torch.Tensor, advantages: torch.Tensor,
                        ratio: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-token score-centering loss, (B, T).

    logp: (B, T) policy log-prob of the sampled tokens; topk_logp: (B, T, K) policy log-probs
    of the sampler's top-K tokens; sampler_topk_logp: (B, T, K) their sampler log-probs (-inf
    pads a missing entry); advantages: (B,).
    """
    weights = torch.softmax(sampler_topk_logp, dim=-1)  # mu~ over K_t, renormalised
    weights = torch.nan_to_num(weights, nan=0.0)  # a row of pads only: no centering term
    expected = (weights * topk_logp).sum(-1)
    w = torch.where(keep, ratio, torch.zeros_like(ratio)).detach()
    return -advantages[:, None] * w * (logp - expected)


def clipped_surrogate_loss(logp: torch.Tensor, sampler_logp: torch.Tensor,
                           advantages: torch.Tensor, keep: torch.Tensor, epsilon: float,
                           epsilon_high: float) -> torch.Tensor:
    """Per-token clipped surrogate on the unmasked tokens, (B, T)."""
    ratio = torch.exp(logp - sampler_logp)
    pg_loss1 = -advantages[:, None] * ratio
    pg_loss2 = -advantages[:, None] * torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    return torch.where(keep, torch.maximum(pg_loss1, pg_loss2), torch.zeros_like(ratio))


def token_mean(per_token: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Sum over trained tokens divided by their count (0 when there are none)."""
    count = trained.sum().clamp(min=1)
    return (per_token * trained).sum() / count


def clip_fractions(ratio: torch.Tensor, advantages: torch.Tensor, trained: torch.Tensor,
                   epsilon: float, epsilon_high: float) -> dict[str, torch.Tensor]:
    """Per-completion fractions of tokens outside the trust region (TRL's clip_ratio/*).

    low: rho < 1-eps with A < 0; high: rho > 1+eps_high with A > 0. With score centering
    nothing is clipped, and these count tokens outside the region.
    """
    a = advantages[:, None]
    low = (ratio < 1 - epsilon) & (a < 0) & trained
    high = (ratio > 1 + epsilon_high) & (a > 0) & trained
    tokens = trained.sum(1).clamp(min=1)
    return {"low": low.sum(1) / tokens, "high": high.sum(1) / tokens,
            "region": (low | high).sum(1) / tokens}
