"""Autoregressive sampling with a KV cache, recording the behaviour log-probs as it goes.

At every visited prefix the sampler keeps the log-prob of the token it drew under the
distribution it drew from (temperature applied, full vocabulary, no top-k/top-p). Greedy
decoding is `generator=None`. A response that reaches `max_new_tokens` without EOS is returned
with finish reason "cut". Two samplers:
- `sample_many`, what the stages use: many prompts at once through the embedded server's
  engine (`engine.Engine`, run in the caller's thread): KV slots allocated once, each
  prompt prefilled alone, decode steps of a fixed number of rows (or, on one thread where
  the row count changes no bits, spanning every slot in use). A prompt's tokens and
  log-probs are bitwise the same whatever is sampled beside it, so a batch is only a speed-up
  (one weight read per step serves every row; a lone decode is bound by that read here).
- `sample`, one sequence against transformers' growing cache; kept for the benchmarks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from reprorl.core import devices
from reprorl.core.errors import ReproError

from .engine import Engine
from .invariance import SPAN_ROWS, cache_argument
from .logprobs import Params
from .sequence import Sequence


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
    device = devices.of(model)
    output = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True,
                   logits_to_keep=1)
    tokens: list[int] = []
    logprobs: list[float] = []
    cache = cache_argument(model)  # the argument and the output field
    for _ in range(max_new_tokens):
        token, logprob = _draw(output.logits[0, -1], generator, temperature)
        tokens.append(token)
        logprobs.append(logprob)
        if token == eos_id:
            return Sample(tokens, logprobs, "eos")
        output = model(input_ids=torch.tensor([[token]], device=device), use_cache=True,
                       logits_to_keep=1, **{cache: output[cache]})
    return Sample(tokens, logprobs, "cut")


FINISH = {"stop": "eos", "length": "cut"}  # the engine's (vLLM's) finish reasons, and ours


@torch.inference_mode()
def sample_many(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                max_len: int, generators: list[torch.Generator] | None = None,
                temperature: float = 1.0, rows: int = SPAN_ROWS, slots: int = 64,
                prefills: OrderedDict | None = None) -> list[Sample]:
    """Each prompt's `Sample`, `slots` sequences at a time in decode groups of `rows` rows
    (a row's bits depend on `rows`, never on the other rows: keep it fixed per use; on one
    thread with SPAN_ROWS rows or more a forward spans the groups in use, `Engine.span`). Greedy
    when `generators` is None; else prompt i draws with `generators[i]`. `max_len` bounds
    prompt + response (the length of a KV slot). `prefills`: a store kept between calls on
    the same weights (an empty OrderedDict at first): every prompt's prefill stays in it, and
    a later call reuses it (the same forward, so the same bits). It holds every prompt's KV
    (the curves' 180 prompts: about 0.1 GB on the embedded base, 1-2 GB on Qwen in bf16)."""
    greedy = generators is None
    params = Params(max_tokens=max_new_tokens, temperature=0.0 if greedy else temperature,
                    logprobs=0, eos_id=eos_id)
    seqs = [Sequence(list(prompt), params, None, None if greedy else generators[i])
            for i, prompt in enumerate(prompts)]
    too_long = [i for i, prompt in enumerate(prompts) if len(prompt) + max_new_tokens > max_len]
    if too_long:
        raise ReproError(f"prompts {too_long} leave no room for {max_new_tokens} new tokens "
                         f"within {max_len}: raise limits.context_tokens")
    slots = max(rows, min(slots, -(-len(seqs) // rows) * rows))
    Engine(model, {}, slots, slots * max_len, max_len, rows, prefills).generate(seqs)
    failed = [seq.error.message for seq in seqs if seq.error is not None]
    if failed:
        raise ReproError(f"{len(failed)} of {len(seqs)} generations failed: {failed[0]}")
    return [Sample(seq.generated, [lp for lp, _, _ in seq.logprobs], FINISH[seq.finish_reason])
            for seq in seqs]


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
    device = devices.of(model)
    for _ in range(max_new_tokens):
        sequence = torch.tensor([list(prompt_ids) + tokens], device=device)
        logits = model(input_ids=sequence, use_cache=False, logits_to_keep=1).logits
        token, logprob = _draw(logits[0, -1], generator, temperature)
        tokens.append(token)
        logprobs.append(logprob)
        if token == eos_id:
            return Sample(tokens, logprobs, "eos")
    return Sample(tokens, logprobs, "cut")
