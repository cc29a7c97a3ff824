"""The loss of one micro-batch: the policy's forwards on its rows, read per trained token.

A micro-batch (`batching.py`) lays its samples out as tree-packed rows (or padded rows); the
forwards keep only the positions some sample reads (`kept_logits`), and `batch.index` gathers
them into per-sample columns (B, W, V). From there every quantity is per trained token, whatever
the layout: the policy's log-prob at the sampler's temperature (under the server's repetition
penalty when there is one, and renormalised over the sampler's candidate set under
top-k/top-p/min-p), the importance weights and the loss of `model/grpo_losses.py`, and the
seed's sampling metrics. `sequence_logprobs` scores one sequence the same way for the
weight-sync canary.
"""

from __future__ import annotations

import contextlib

import torch

from reprorl.core import devices
from reprorl.model.encoding import mask_for
from reprorl.model.grpo_losses import (
    centered_score_loss,
    clip_fractions,
    clipped_surrogate_loss,
    importance_weights,
    token_mean,
)
from reprorl.serve.logprobs import penalise_repeats

from .batching import MicroBatch
from .config import AsyncGRPOConfig


def kept_logits(model, batch: MicroBatch, forward=None) -> torch.Tensor:
    """The logits the loss reads, (sum of R * N over the forwards, V): each forward's kept
    positions, forward after forward (`batch.index` counts in that order). `forward`: the
    module to call (DDP's wrapper across ranks), `model` by default."""
    return torch.cat([(forward or model)(
        input_ids=f.input_ids, attention_mask=mask_for(model, f.attention_mask),
        position_ids=f.position_ids, use_cache=False, logits_to_keep=f.keep,
    ).logits.flatten(0, 1) for f in batch.forwards])


def autocast_for(args: AsyncGRPOConfig, device: torch.device):
    return (torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16
            else contextlib.nullcontext())


def sequence_logprobs(model, args: AsyncGRPOConfig, prompt_ids: list[int],
                      output_ids: list[int]) -> list[float]:
    """log pi(output | prompt) per output token at the run's temperature, as the loss scores
    it without truncation or repetition penalty, which the canary's requests do not use (one
    unpadded sequence, no gradient, no RNG drawn): the weight-sync canary's side."""
    device = devices.of(model)
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=device)
    with torch.no_grad(), autocast_for(args, device):
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1]
    scores = (logits.float() / args.temperature).log_softmax(-1)
    targets = torch.tensor(output_ids, device=device).unsqueeze(-1)
    return scores.gather(-1, targets).squeeze(-1).tolist()


def candidate_logmass(scores: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """log of the probability mass of each column's candidate set under `scores`, (B, W).

    With top-k/top-p/min-p the sampler drew each token from a candidate set, renormalised
    (its processed log-probs); the policy's log-prob of the token must be renormalised over
    the same set, or every importance ratio is biased low by that mass (the seed's "top-k and
    top-p sampling"). Columns without a set get 0: the whole vocabulary."""
    if batch.candidates is None:
        return torch.zeros_like(scores[..., 0])
    inside = scores.gather(-1, batch.candidates).masked_fill(~batch.candidates_valid,
                                                             float("-inf"))
    return torch.where(batch.candidates_valid.any(-1), inside.logsumexp(-1), 0.0)


def penalise_columns(columns: torch.Tensor, batch: MicroBatch, penalty: float) -> torch.Tensor:
    """The (B, W, V) column logits under the server's repetition penalty: each column's
    logits of the tokens before it in its sample penalised (`logprobs.penalise_repeats`). Only
    the ids the batch holds are gathered, penalised and scattered back: one (B, W, V) copy
    more, not a (B, W, V) mask and its temporaries (V is 151,936 for Qwen)."""
    tokens, width = batch.seen_ids, columns.shape[1]
    rows, real = len(tokens), tokens >= 0
    # token i of a sample of n tokens comes before columns i + W + 1 - n on (column c holds
    # token n - W + c)
    device = tokens.device
    after = torch.arange(tokens.shape[1], device=device) + width + 1 - real.sum(1, keepdim=True)
    ids = tokens[real].unique()  # sorted
    where = torch.searchsorted(ids, tokens.clamp(min=0)).masked_fill(~real, len(ids))
    # pads: a dropped column
    first = torch.full((rows, len(ids) + 1), width, dtype=torch.long, device=device)
    first.scatter_reduce_(1, where, after.clamp(min=0), "amin")
    seen = first[:, None, :-1] <= torch.arange(width, device=device)[None, :, None]  # (B, W, U)
    index = ids.expand(rows, width, -1)
    return columns.scatter(-1, index, penalise_repeats(columns.gather(-1, index), seen,
                                                       penalty))


def microbatch_loss(model, args: AsyncGRPOConfig, batch: MicroBatch,
                    trained_tokens: int | None = None, forward=None
                    ) -> tuple[torch.Tensor, dict]:
    """The micro-batch's loss (`model/grpo_losses.py`: its trained tokens' terms summed,
    divided by their count, or by `trained_tokens`, those of its slot on every rank) and the
    seed's sampling metrics. The forwards run on the batch's layout (tree rows, or padded
    rows); their kept logits are gathered into per-sample columns (B, W, V) by `batch.index`,
    so every per-token quantity below is computed per trained token, whatever the layout."""
    with autocast_for(args, batch.targets.device):
        logits = kept_logits(model, batch, forward)
    # Unpenalised: log_softmax on the kept positions once, then one copy per column.
    # index_select, not `[batch.index]`: several columns read one position (a shared fork
    # token, the untrained columns), and the backward of advanced indexing accumulates them
    # with CPU atomics once the tensor is large (measured: multi-turn rows of ~500 tokens
    # trained to other bits run to run); index_select's backward, index_add_, adds in order
    if args.repetition_penalty == 1:
        flat = (logits.float() / args.temperature).log_softmax(-1)
        scores = flat.index_select(0, batch.index.reshape(-1)).reshape(*batch.index.shape, -1)
    else:  # the penalty depends on each column's own prefix: per column, then log_softmax
        columns = logits.float().index_select(0, batch.index.reshape(-1))
        columns = penalise_columns(columns.reshape(*batch.index.shape, -1), batch,
                                   args.repetition_penalty)
        scores = (columns / args.temperature).log_softmax(-1)
    logp = scores.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    mass = candidate_logmass(scores, batch)  # 0 where a column was sampled from everything
    logp = logp - mass
    ratio, keep = importance_weights(logp.detach(), batch.sampler_logp,
                                     args.vllm_importance_sampling_clip_min,
                                     args.vllm_importance_sampling_clip_max)
    keep = keep & batch.trained
    if args.score_centering:
        topk_logp = scores.gather(-1, batch.top_ids) - mass.unsqueeze(-1)
        per_token = centered_score_loss(logp, topk_logp, batch.top_sampler_logp,
                                        batch.advantages, ratio, keep)
    else:
        per_token = clipped_surrogate_loss(logp, batch.sampler_logp, batch.advantages, keep,
                                           args.epsilon, args.epsilon_high)
    with torch.no_grad():
        stats = loss_stats(args, batch, scores, logp.detach(), ratio, keep)
    if trained_tokens is None:
        return token_mean(per_token, batch.trained), stats
    return (per_token * batch.trained).sum() / max(trained_tokens, 1), stats


def loss_stats(args: AsyncGRPOConfig, batch: MicroBatch, scores, logp, ratio,
               keep) -> dict[str, list]:
    """Per-token (per-completion for clip_ratio) values of the seed's sampling metrics."""
    t = batch.trained
    diff = (logp - batch.sampler_logp).abs()[t].tolist()
    ratios = ratio[t].tolist()
    clipped = clip_fractions(ratio, batch.advantages, t, args.epsilon, args.epsilon_high)
    low, high = clipped["low"].tolist(), clipped["high"].tolist()
    stats = {
        "sampling/sampling_logp_difference/mean": diff,
        "sampling/sampling_logp_difference/max": diff,
        "sampling/importance_sampling_ratio/min": ratios,
        "sampling/importance_sampling_ratio/mean": ratios,
        "sampling/importance_sampling_ratio/max": ratios,
        "sampling/masked_mean": (~keep[t]).float().tolist(),
        "entropy": (-(scores.exp() * scores).sum(-1)[t]).tolist(),
        "clip_ratio/region_mean": clipped["region"].tolist(),
        "clip_ratio/low_mean": low, "clip_ratio/low_min": low,
        "clip_ratio/high_mean": high, "clip_ratio/high_max": high,
    }
    if args.score_centering:
        stats["sampling/sampler_mass"] = batch.top_sampler_logp.exp().sum(-1)[t].tolist()
    return stats
