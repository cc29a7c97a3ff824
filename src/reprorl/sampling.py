"""Autoregressive sampling with a KV cache, recording the behaviour log-probs as it goes.

One sequence at a time (no padding to get wrong): the prompt is encoded once, then each new
token is fed alone against the cache. At every visited prefix the sampler keeps the log-prob of
the token it drew under the distribution it drew from (temperature applied, full vocabulary, no
top-k/top-p). Greedy decoding is `generator=None`. A response that reaches `max_new_tokens`
without EOS is returned with finish reason "cut".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import Qwen2ForCausalLM

# transformers 5.2x renamed `past_key_values` to `cache` (argument and output field)
_CACHE = "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else (
    "past_key_values")


@dataclass
class Sample:
    response_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each response token
    finish_reason: str  # "eos" or "cut"


def _draw(logits: torch.Tensor, generator: torch.Generator | None,
          temperature: float) -> tuple[int, float]:
    """The next token (argmax when greedy) and its log-prob under the sampled distribution."""
    scores = (logits.float() / temperature).log_softmax(-1)
    if generator is None:
        token = int(scores.argmax())
    else:
        token = int(torch.multinomial(scores.exp(), 1, generator=generator))
    return token, float(scores[token])


@torch.inference_mode()
def sample(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
           generator: torch.Generator | None = None, temperature: float = 1.0) -> Sample:
    output = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        token, logprob = _draw(output.logits[0, -1], generator, temperature)
        tokens.append(token)
        logprobs.append(logprob)
        if token == eos_id:
            return Sample(tokens, logprobs, "eos")
        output = model(input_ids=torch.tensor([[token]]), use_cache=True, logits_to_keep=1,
                       **{_CACHE: output[_CACHE]})
    return Sample(tokens, logprobs, "cut")


def response_text(tokenizer, result: Sample) -> str:
    """The answer's text without the final EOS. Bytes that do not decode show up as U+FFFD,
    which the rubric refuses; special tokens inside the answer are kept visible."""
    ids = result.response_ids[:-1] if result.finish_reason == "eos" else result.response_ids
    return tokenizer.decode(ids, skip_special_tokens=False)


@torch.inference_mode()
def sample_without_cache(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
                         generator: torch.Generator | None = None,
                         temperature: float = 1.0) -> Sample:
    """The seed's sampler: the whole prefix is recomputed for every new token. Kept as the
    baseline that `benchmarks/sampling.py` measures `sample` against."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        sequence = torch.tensor([list(prompt_ids) + tokens])
        logits = model(input_ids=sequence, use_cache=False, logits_to_keep=1).logits
        token, logprob = _draw(logits[0, -1], generator, temperature)
        tokens.append(token)
        logprobs.append(logprob)
        if token == eos_id:
            return Sample(tokens, logprobs, "eos")
    return Sample(tokens, logprobs, "cut")
