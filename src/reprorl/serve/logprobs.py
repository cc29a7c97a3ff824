"""The distribution a token is drawn from, as vLLM processes it, and the draw.

`Params` holds a request's sampling settings (the part of vLLM's `SamplingParams` the engine
honours). `processed_logprobs` gives vLLM's processed log-probs in its sampler's order: allowed
token ids, bad words, min tokens, logit bias, the repetition, frequency and presence penalties,
then temperature, min-p, top-k and top-p, a filtered token at -inf (greedy: the log-softmax of
the adjusted logits). `penalise_repeats`, the repetition penalty alone, is also what the GRPO
loss applies, which must score each token under the distribution it was drawn from. `race`
draws one token per row, each row from its own generator: the exponential race vLLM runs.
`draw` puts them together for rows that share their settings, with what a response reports of
each draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature means greedy


@dataclass
class Params:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on every token already in the prompt or the output
    logprobs: int | None = None
    eos_id: int | None = None
    stop_ids: frozenset = frozenset()
    sampling_mask: bool = False  # keep each sampled token's candidate set (vLLM's flag)
    allowed: frozenset | None = None  # allowed_token_ids: every other token at -inf
    bad_words: tuple = ()  # token-id sequences: a last token is barred after the rest of it
    min_tokens: int = 0  # the end tokens (eos_id, stop_ids) barred until this many are out
    logit_bias: tuple = ()  # (token id, bias) pairs added to the logits
    frequency_penalty: float = 0.0  # times each count in the output, off the logits
    presence_penalty: float = 0.0  # off the logits of every token the output holds
    stop: tuple = ()  # stop strings (`Sequence.take` checks them on the output's text)
    include_stop: bool = False  # include_stop_str_in_output

    @property
    def own_row(self) -> bool:
        """Whether the distribution reads the row's own tokens or settings beyond the shared
        ones, so the row is drawn alone (`Engine.sample`)."""
        return (self.repetition_penalty != 1 or self.allowed is not None or bool(
            self.bad_words) or self.min_tokens > 0 or bool(self.logit_bias)
            or self.frequency_penalty != 0 or self.presence_penalty != 0)


def penalise_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM's repetition penalty (`apply_repetition_penalties_torch`): the logit of every token
    `seen` (a bool mask over the vocabulary, broadcast against `logits`) is divided by the
    penalty when positive and multiplied by it otherwise. One function for the engine and the
    trainer, which must score each token under the distribution it was drawn from."""
    penalties = torch.where(seen, torch.tensor(penalty, dtype=logits.dtype,
                                               device=logits.device), 1.0)
    return logits * torch.where(logits > 0, 1.0 / penalties, penalties)


def restricted(logits: torch.Tensor, p: Params, output: list[int]) -> torch.Tensor:
    """vLLM's steps before the penalties, for one row whose `output` is so far: only the
    allowed tokens, no bad word's last token after the rest of it, no end token before
    min_tokens, then the logit bias. Without any of them, `logits` itself."""
    vocab = logits.shape[-1]
    if p.allowed is not None:  # every other token at -inf, the allowed ones as they were
        keep = torch.tensor(sorted(t for t in p.allowed if t < vocab), device=logits.device)
        logits = torch.full_like(logits, -math.inf).index_copy(
            -1, keep, logits.index_select(-1, keep))
    barred = set()
    for word in p.bad_words:
        if len(word) == 1 or list(word[:-1]) == output[len(output) - len(word) + 1:]:
            barred.add(word[-1])
    if len(output) < p.min_tokens:
        barred |= set(p.stop_ids) | ({p.eos_id} if p.eos_id is not None else set())
    if barred:
        logits = logits.index_fill(-1, torch.tensor(sorted(t for t in barred if t < vocab),
                                                    device=logits.device), -math.inf)
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        logits = logits.index_add(-1, torch.tensor(ids, device=logits.device), torch.tensor(
            bias, dtype=logits.dtype, device=logits.device).expand(*logits.shape[:-1], -1))
    return logits


def penalise_output(logits: torch.Tensor, p: Params, output: list[int]) -> torch.Tensor:
    """vLLM's frequency and presence penalties: each token's count in the output times the
    first, and the second once for every token the output holds, off its logit."""
    counts = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    if output:
        counts.index_add_(0, torch.tensor(output, device=logits.device),
                          torch.ones(len(output), dtype=logits.dtype, device=logits.device))
    return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def processed_logprobs(logits: torch.Tensor, p: Params, seen: list[int] | None = None,
                       output: list[int] | None = None) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from (filtered tokens get -inf), over the
    last dimension of `logits` ([vocab], or [rows, vocab] that share `p`: every operation works
    row by row, so on the CPU a row's bits are those it gets alone, `Engine.sample`); `seen`:
    the tokens so far (prompt and output) of a single row, which the repetition penalty
    applies to, and `output` its generated ones (`Params.own_row`: a row drawn alone)."""
    logits = logits.float()
    if p.own_row:
        logits = restricted(logits, p, output or [])
    if p.repetition_penalty != 1 and seen:
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        mask[torch.tensor(seen, device=logits.device)] = True
        logits = penalise_repeats(logits, mask, p.repetition_penalty)
    if p.frequency_penalty != 0 or p.presence_penalty != 0:
        logits = penalise_output(logits, p, output or [])
    if p.temperature < GREEDY_EPS:
        return logits.log_softmax(-1)
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), -math.inf)
    if 0 < p.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(p.top_k).values[..., -1:], -math.inf)
    if p.top_p < 1:
        ordered, order = logits.sort()  # ascending, as vLLM's apply_top_k_top_p
        probs = ordered.softmax(-1)
        # a float cumsum on CUDA has no deterministic kernel: summed on the CPU there
        cumulative = probs.cumsum(-1) if probs.device.type == "cpu" else (
            probs.cpu().cumsum(-1).to(probs.device))
        drop = cumulative <= 1 - p.top_p
        drop[..., -1] = False  # keep at least one token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), -math.inf)
    return logits.log_softmax(-1)


def race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab], row i drawn with `generators[i]`: the
    argmax of probs / q, q ~ Exp(1) (the exponential race: how vLLM and `torch.multinomial`
    draw one sample, so the token `torch.multinomial(row, 1, generator=g)` gives, checked in
    `test_sampling`). The draws stay per row, each from its own generator; the rest is one
    operation over the rows."""
    q = torch.empty_like(probs)
    for row, generator in zip(q, generators, strict=True):
        row.exponential_(generator=generator)
    return (probs / q).argmax(-1)


def draw(logits: torch.Tensor, p: Params, generators: list[torch.Generator],
         seen: list[int] | None, output: list[int] | None = None) -> list[tuple | None]:
    """One token for each row of `logits`, all rows under the settings `p` (and, where the
    row is drawn alone, `Params.own_row`, its `seen` tokens and its `output`; None otherwise):
    for each row (token, its log-prob, top log-probs, rank, candidate ids), or None where its
    log-probs hold NaN."""
    scores = processed_logprobs(logits, p, seen, output)
    broken = torch.isnan(scores).any(-1).tolist()
    if p.temperature < GREEDY_EPS:
        tokens = scores.argmax(-1)
    else:
        tokens = race(scores.exp(), generators)
    chosen = scores.gather(-1, tokens[:, None])
    top = [None] * len(generators)
    ranks = [None] * len(generators)
    if p.logprobs is not None:
        best = scores.topk(p.logprobs)
        top = list(zip(best.indices.tolist(), best.values.tolist()))
        ranks = (1 + (scores > chosen).sum(-1)).tolist()
    # what survived temperature, min-p, top-k and top-p
    masks = ([torch.isfinite(row).nonzero().flatten().tolist() for row in scores]
             if p.sampling_mask else [None] * len(generators))
    return [None if nan else (token, logprob, pair, rank, mask) for
            nan, token, logprob, pair, rank, mask in
            zip(broken, tokens.tolist(), chosen[:, 0].tolist(), top, ranks, masks)]
