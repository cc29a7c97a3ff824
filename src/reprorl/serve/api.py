"""vLLM's OpenAI-compatible API as the embedded server speaks it: requests and responses.

What a request may ask and how it is checked (`sampling_params`, `number`: every number finite
and in range, a fault answered with vLLM's JSON error and its status), and the shapes of
vLLM's responses (`completion`, `generation`, `metrics`), so a client written against a real
`vllm serve` runs unchanged here. The HTTP routes that use them are in `server.py`.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from .engine import WORK, Engine
from .logprobs import Params
from .sequence import ApiError, Sequence

SYSTEM_FINGERPRINT = "reprorl-serve"
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "RequestEntityTooLargeError", 503: "ServiceUnavailableError"}


def error_body(error: ApiError) -> dict:
    """vLLM's JSON error body (the response carries the error's status too)."""
    kind = ERROR_TYPES.get(error.status, "InternalServerError")
    return {"error": {"message": error.message, "type": kind, "param": error.param,
                      "code": error.status}}


def number(body: dict, key: str, default, kind=float):
    """body[key] as a finite number of `kind` (int or float); a missing or null one is the
    default. Python's JSON reader turns 1e999 into inf, so finiteness is checked here too."""
    value = body.get(key)
    if value is None:
        return default
    what = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{key}' must be {what}, got {value!r}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"'{key}' must be finite, got {value!r}.")
    if kind is int and value != int(value):
        raise ApiError(400, f"'{key}' must be an integer, got {value!r}.")
    try:
        return kind(value)
    except OverflowError as error:  # an integer beyond a float's range
        raise ApiError(400, f"'{key}' is out of range.") from error


# pydantic's lax booleans, which vLLM's request models take: "false" is false, "yes" true
TRUE, FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "f", "false", "n", "no", "off"}


def boolean(body: dict, key: str, default: bool) -> bool:
    """body[key] read as vLLM reads a boolean field (pydantic's lax mode); a missing or null
    one is the default, anything else not a boolean a 400 naming the field."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, float) and value in (0.0, 1.0):
        return bool(value)
    if isinstance(value, str) and value.lower() in TRUE | FALSE:
        return value.lower() in TRUE
    raise ApiError(400, f"'{key}' must be a boolean, got {value!r}.", param=key)


def token_ids(body: dict, key: str, vocab: int) -> list[int] | None:
    """body[key] as a list of token ids of the vocabulary (None where missing or null)."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"'{key}' must be a list of token ids.", param=key)
    if any(not 0 <= t < vocab for t in value):
        raise ApiError(400, f"'{key}' holds token ids out of the vocabulary (size {vocab}).",
                       param=key)
    return value


def strings(body: dict, key: str) -> list[str]:
    """body[key] as a list of strings: one string, a list of them, or none (missing, null)."""
    value = body.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ApiError(400, f"'{key}' must be a string or a list of strings.", param=key)
    return value


def refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def text(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{key}' must be a string, got {type(value).__name__}.")
    return value


def json_logprob(value: float) -> float:
    """A log-prob as vLLM writes it: -inf (a token truncation removed) as -9999.0, which JSON
    can hold."""
    return max(value, -9999.0)


@dataclass(frozen=True)
class Reply:
    """What a completion's response needs from its request body (the body is not kept)."""

    model: str
    as_ids: bool  # return_tokens_as_token_ids
    with_ids: bool  # return_token_ids
    skip_special: bool  # skip_special_tokens
    request_id: str  # the response's id is cmpl-<request_id>
    samples: int  # n: samples of each prompt
    echo: bool  # the prompt's text before each choice's

    @classmethod
    def of(cls, body: dict, model: str) -> Reply:
        request_id = text(body, "request_id") or uuid.uuid4().hex
        samples = number(body, "n", 1, int)
        if samples < 1:
            raise ApiError(400, f"n must be at least 1, got {samples}.", param="n")
        echo = boolean(body, "echo", False)
        if echo and body.get("logprobs") is not None:
            raise ApiError(400, "'echo' with 'logprobs' is not supported by this server: it "
                           "needs the prompt's log-probs (prompt_logprobs); ask one or the "
                           "other.", param="echo")
        return cls(model, boolean(body, "return_tokens_as_token_ids", False),
                   boolean(body, "return_token_ids", False),
                   boolean(body, "skip_special_tokens", True), request_id, samples, echo)


def prompts(value) -> list:
    """vLLM's `prompt`: a string, a list of token ids, or a list of either (one choice set
    each); the items are checked as prompts by the server."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        return value
    return [value]


def sampling_params(body: dict, prompt_len: int, max_len: int, max_logprobs: int,
                    eos_id: int | None, extra_eos: set[int], vocab: int,
                    encode=None) -> Params:
    """The request's sampling settings, checked as vLLM checks them: `max_len` the served
    context, `max_logprobs` the server's --max-logprobs; `eos_id` and `extra_eos` (the
    generation config's other end tokens) end a sequence unless it asks `ignore_eos`;
    `encode(text)` tokenizes bad words (a request with some needs it). The fields no setting
    here reads are refused or honoured elsewhere (`fields.py`)."""
    unbounded = "max_tokens" in body and body["max_tokens"] is None  # vLLM: fill the context
    maximum = number(body, "max_tokens", max_len - prompt_len if unbounded else 16, int)
    if maximum < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {maximum}.")
    if prompt_len + maximum > max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                       f"However, you requested {prompt_len + maximum} tokens ({prompt_len} "
                       f"in the messages, {maximum} in the completion). Please reduce the "
                       "length of the messages or completion.")
    p = Params(maximum, number(body, "temperature", 1.0), number(body, "top_p", 1.0),
               number(body, "top_k", 0, int), number(body, "min_p", 0.0),
               number(body, "repetition_penalty", 1.0))
    if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < -1 or not 0 <= p.min_p <= 1:
        raise ApiError(400, "temperature must be >= 0, top_p in (0, 1], top_k >= -1 and "
                       "min_p in [0, 1].")
    for key in ("presence_penalty", "frequency_penalty"):
        value = number(body, key, 0.0)
        if not -2 <= value <= 2:
            raise ApiError(400, f"{key} must be in [-2, 2], got {value}.", param=key)
        setattr(p, key, value)
    if p.repetition_penalty <= 0:
        raise ApiError(400, "repetition_penalty must be greater than zero, got "
                       f"{p.repetition_penalty}.")
    if body.get("logprobs") is not None:
        p.logprobs = number(body, "logprobs", 0, int)
        if not 0 <= p.logprobs <= max_logprobs:
            raise ApiError(400, f"Requested sample logprobs of {p.logprobs}, which is "
                           f"greater than max allowed: {max_logprobs}")
    stops = token_ids(body, "stop_token_ids", vocab) or []
    ignore = boolean(body, "ignore_eos", False)
    p.eos_id = None if ignore else eos_id
    p.stop_ids = frozenset(stops) | (frozenset() if ignore else frozenset(extra_eos))
    p.stop = tuple(stop for stop in strings(body, "stop") if stop)
    p.include_stop = boolean(body, "include_stop_str_in_output", False)
    p.min_tokens = number(body, "min_tokens", 0, int)
    if not 0 <= p.min_tokens <= maximum:
        raise ApiError(400, f"min_tokens must be in [0, max_tokens={maximum}], got "
                       f"{p.min_tokens}.", param="min_tokens")
    allowed = token_ids(body, "allowed_token_ids", vocab)
    if allowed is not None:
        if not allowed:
            raise ApiError(400, "allowed_token_ids is not None and empty!",
                           param="allowed_token_ids")
        p.allowed = frozenset(allowed)
    p.logit_bias = logit_bias(body, vocab)
    words = strings(body, "bad_words")
    if words:
        p.bad_words = bad_word_ids(words, encode, vocab)
    return p


def logit_bias(body: dict, vocab: int) -> tuple:
    """vLLM's logit_bias: token ids (as JSON keys) to a bias, clipped to [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(400, "'logit_bias' must be an object of token ids to biases.",
                       param="logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            tid = int(key)
        except ValueError as error:
            raise ApiError(400, f"logit_bias: {key!r} is not a token id.",
                           param="logit_bias") from error
        if not 0 <= tid < vocab:
            raise ApiError(400, f"token_id(s) [{tid}] in logit_bias contain out-of-vocab token "
                           f"ids. Vocabulary size: {vocab}", param="logit_bias")
        amount = number({"logit_bias": bias}, "logit_bias", 0.0)
        pairs.append((tid, min(100.0, max(-100.0, amount))))
    return tuple(sorted(pairs))


def bad_word_ids(words: list[str], encode, vocab: int) -> tuple:
    """vLLM's bad words as token sequences (`SamplingParams.update_from_tokenizer`): each word
    as written (its leading spaces dropped), and with one leading space where that makes a
    sequence of the same length starting with another token (the word inside a text)."""
    sequences: list[list[int]] = []
    for word in words:
        for spaced in (False, True):
            ids = encode((" " if spaced else "") + word.lstrip())
            if not ids:
                raise ApiError(400, f"bad_words: {word!r} has no tokens.", param="bad_words")
            if not spaced or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
    if any(not 0 <= t < vocab for ids in sequences for t in ids):
        raise ApiError(400, "bad_words hold token ids out of the vocabulary.", param="bad_words")
    return tuple(tuple(ids) for ids in sequences)


def output_text(seq: Sequence, tokenizer, skip_special: bool) -> str:
    """A finished sequence's text as vLLM answers it: an end token's own text left out unless
    include_stop_str_in_output; a stop string's cut where `Sequence.find_stop_string` found it."""
    if isinstance(seq.stop_reason, str):
        return seq.text[:seq.text_end]
    ended = seq.finish_reason == "stop" and not seq.params.include_stop
    return tokenizer.decode(seq.generated[:-1] if ended else seq.generated,
                            skip_special_tokens=skip_special)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def completion(seqs: list[Sequence], reply: Reply, tokenizer, piece,
               texts: list[str | None]) -> dict:
    """vLLM's `/v1/completions` response for finished `seqs`, each prompt's `reply.samples`
    in turn (choice index: prompt x n + sample); `piece(token id)` is a token's text (the
    server caches it), `texts` each prompt's text as sent (None: sent as token ids)."""
    choices = [choice(seq, index, reply, tokenizer, piece, texts[index // reply.samples])
               for index, seq in enumerate(seqs)]
    return {"id": f"cmpl-{reply.request_id}", "object": "text_completion",
            "created": int(time.time()), "model": reply.model, "choices": choices,
            "usage": usage(sum(len(seq.prompt) for seq in seqs[::reply.samples]),
                           sum(len(seq.generated) for seq in seqs)),
            # vLLM's other top-level keys, empty here as they are in vLLM without those
            # features (tests/recorded/vllm-responses.json)
            "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def completion_logprobs(seq: Sequence, reply: Reply, piece, start: int = 0,
                        end: int | None = None, offset: int = 0) -> tuple[dict | None, int]:
    """vLLM's completion log-probs of the generated tokens [start, end) (None when not asked),
    their text offsets counted from `offset`; and the offset after them (a stream's next)."""
    if seq.params.logprobs is None:
        return None, offset

    def shown_as(tid: int) -> str:
        return f"token_id:{tid}" if reply.as_ids else piece(tid)

    logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for tid, (value, ids, values) in zip(seq.generated[start:end], seq.logprobs[start:end]):
        top = {shown_as(tid): json_logprob(value)}  # the sampled token first, as vLLM
        for other, other_value in zip(ids, values):
            top.setdefault(shown_as(other), json_logprob(other_value))
        logprobs["text_offset"].append(offset)
        logprobs["tokens"].append(shown_as(tid))
        offset += len(logprobs["tokens"][-1])
        logprobs["token_logprobs"].append(json_logprob(value))
        logprobs["top_logprobs"].append(top)
    return logprobs, offset


def choice(seq: Sequence, index: int, reply: Reply, tokenizer, piece,
           prompt_text: str | None) -> dict:
    """One choice of a completion: its text (after the prompt's with `echo`), log-probs and
    ending."""
    logprobs = completion_logprobs(seq, reply, piece)[0]
    with_ids = reply.with_ids
    text = output_text(seq, tokenizer, reply.skip_special)
    if reply.echo and not with_ids:  # vLLM: with return_token_ids the ids carry the prompt
        text = (prompt_text if prompt_text is not None else tokenizer.decode(
            seq.prompt, skip_special_tokens=reply.skip_special)) + text
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": seq.finish_reason,
        "stop_reason": seq.stop_reason,
        "token_ids": ([*seq.prompt, *seq.generated] if reply.echo else list(seq.generated))
        if with_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": list(seq.prompt) if with_ids else None,
        "routed_experts": None,  # vLLM's, for mixture-of-experts models
    }


def generation(seq: Sequence, request_id: str) -> dict:
    """vLLM's `/inference/v1/generate` response for a finished `seq`."""
    content = None
    if seq.params.logprobs is not None:
        content = [{"token_id": tid, "logprob": json_logprob(value), "rank": rank,
                    "top_logprobs": [{"token_id": other, "logprob": json_logprob(v)}
                                     for other, v in zip(ids, values)]}
                   for tid, (value, ids, values), rank in zip(
                       seq.generated, seq.logprobs, seq.ranks)]
    choice = {"index": 0, "finish_reason": seq.finish_reason,
              "token_ids": list(seq.generated), "routed_experts": None,
              "sampling_mask": list(seq.masks) if seq.params.sampling_mask else None,
              "logprobs": None if content is None else {"content": content}}
    used = {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.generated),
            "total_tokens": seq.length}
    return {"request_id": request_id, "output_mode": "tokens", "choices": [choice],
            "usage": used}


def metrics(engine: Engine, name: str, max_loras: int) -> str:
    """The Prometheus page of `/metrics`: vLLM's gauges and counters for the served model
    `name`, and where the engine thread's time goes (`reprorl:engine_*`)."""
    label = f'engine="0",model_name="{name}"'
    counters, blocks = engine.counters, f'num_gpu_blocks="{engine.capacity // 16}",'
    table = [  # name, type, help, [(extra labels, value)]
        ("vllm:num_requests_running", "gauge", "Requests in model execution batches.",
         [("", len(engine.running))]),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.",
         [("", len(engine.waiting))]),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         [("", engine.kv_in_use() / engine.capacity)]),
        ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.",
         [("", counters["preemptions"])]),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         [("", counters["prompt_tokens"])]),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         [("", counters["generation_tokens"])]),
        ("vllm:prefix_cache_queries_total", "counter",
         "Prefix cache queries, in terms of number of queried tokens.",
         [("", counters["prefix_cache_queries"])]),
        ("vllm:prefix_cache_hits_total", "counter",
         "Prefix cache hits, in terms of number of cached tokens.",
         [("", counters["prefix_cache_hits"])]),
        ("vllm:request_success_total", "counter", "Count of successfully processed requests.",
         [(f'finished_reason="{r}",', n) for r, n in engine.successes.items()]),
        ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
         [(f'block_size="16",{blocks}', 1)]),
    ]
    table += [(f"reprorl:engine_{key}_total", "counter", meaning, [("", engine.work[key])])
              for key, meaning in WORK.items()]
    lines = []
    for metric, kind, text, samples in table:
        lines += [f"# HELP {metric} {text}", f"# TYPE {metric} {kind}"]
        lines += [f"{metric}{{{extra}{label}}} {float(value)}" for extra, value in samples]
    # vLLM's LoRA gauge: no engine label; the value is when it was set
    running = ",".join(sorted({seq.adapter.name for seq in list(engine.running)
                               if seq.adapter is not None}))
    lines += ["# HELP vllm:lora_requests_info Running stats on lora requests.",
              "# TYPE vllm:lora_requests_info gauge",
              (f'vllm:lora_requests_info{{max_lora="{max_loras}",'
               f'running_lora_adapters="{running}",waiting_lora_adapters=""}} {time.time()}')]
    return "\n".join(lines) + "\n"
