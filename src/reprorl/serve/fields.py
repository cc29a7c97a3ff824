"""Every field of vLLM's request models, and what this server does with each.

vLLM 0.32's `CompletionRequest` (`/v1/completions`), `SamplingParams` (the `sampling_params` of
`/inference/v1/generate`) and its tokenizer routes' requests: each field is honoured as vLLM
honours it (the table says where), or refused when a request sets it to anything but its
default, with vLLM's JSON 400 naming the field and why. A field of neither table is one vLLM
does not have either: it is logged and ignored, as vLLM does. `tests/test_server_fields.py`
reads vLLM's own models and fails on any field missing here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .api import TRUE
from .sequence import ApiError

log = logging.getLogger("reprorl.serve")


@dataclass(frozen=True)
class Fields:
    honoured: dict[str, str]  # field -> what reads it
    refused: dict[str, tuple]  # field -> (its default, a value a test asks, why not here)


NO_STREAM = "a generate request's answer comes whole"
NO_PROMPT_LOGPROBS = "the prompt's own log-probs are not computed"
NO_GUIDED = "no guided decoding (grammars, JSON schemas, regular expressions)"
NO_BEAMS = "no beam search"
NO_TRANSFER = "no disaggregated serving (KV or encoder-cache transfer)"
NO_MULTIMODAL = "text models only"
NO_CUT = "a prompt is never cut; send a shorter one"
INFORMATIONAL = "informational, as in vLLM"

# the fields both read: a completion's body, a generate request's sampling_params
SHARED_HONOURED = {
    "max_tokens": "api.sampling_params", "min_tokens": "logprobs.restricted",
    "temperature": "api.sampling_params", "top_p": "api.sampling_params",
    "top_k": "api.sampling_params", "min_p": "api.sampling_params",
    "repetition_penalty": "logprobs.penalise_repeats",
    "presence_penalty": "logprobs.penalise_output",
    "frequency_penalty": "logprobs.penalise_output", "seed": "server.run: its generator",
    "stop": "Sequence.find_stop_string", "stop_token_ids": "Sequence.take",
    "include_stop_str_in_output": "Sequence.find_stop_string and api.choice",
    "ignore_eos": "api.sampling_params", "logprobs": "logprobs.draw",
    "skip_special_tokens": "api.choice; the text stop strings are searched in",
    "allowed_token_ids": "logprobs.restricted", "bad_words": "logprobs.restricted",
    "logit_bias": "logprobs.restricted",
    "routed_experts_prompt_start": "dense models route no experts (vLLM answers null too)",
}
SHARED_REFUSED = {
    "prompt_logprobs": (None, 1, NO_PROMPT_LOGPROBS),
    "logprob_token_ids": (None, [1], "log-probs are the top ones (logprobs), not chosen ids"),
    "spaces_between_special_tokens": (True, False, "text is decoded as the tokenizer decodes"),
    "structured_outputs": (None, {"regex": "a+"}, NO_GUIDED),
    "watermarking": (None, True, "no watermarking"),
    "repetition_detection": (None, {"max_pattern_size": 4}, "no repetition detection"),
    "thinking_token_budget": (None, 8, "no reasoning parser"),
    "stream_interval": (None, 2, NO_STREAM),
}

COMPLETION = Fields(
    honoured={
        **SHARED_HONOURED,
        "n": "server.completions: n samples, sample j seeded seed + j",
        "model": "server.model_of: the served model or a loaded adapter",
        "prompt": "server.completions: a string, token ids, or a list of either",
        "echo": "api.choice: the prompt's text first (not with logprobs)",
        "user": INFORMATIONAL, "session_id": INFORMATIONAL,
        "request_id": "api.completion: the response's id",
        "return_tokens_as_token_ids": "api.choice", "return_token_ids": "api.choice",
        "add_special_tokens": "server.prompt: a text prompt's tokenization",
        "return_token_offsets": "ignored by vLLM outside its render endpoints too",
        "stream": "streaming.py: server-sent events, chunks as vLLM's",
        "stream_options": "streaming.StreamOptions: include_usage, continuous_usage_stats",
    },
    refused={
        **SHARED_REFUSED,
        "suffix": (None, "end", "the model has no fill-in-the-middle template"),
        "use_beam_search": (False, True, NO_BEAMS),
        "length_penalty": (1.0, 0.5, NO_BEAMS),
        "truncate_prompt_tokens": (None, 4, NO_CUT),
        "truncation_side": (None, "left", NO_CUT),
        "prompt_embeds": (None, "AAAA", "prompts are text or token ids"),
        "response_format": (None, {"type": "json_object"}, NO_GUIDED),
        "priority": (0, 1, "no priority scheduling (vLLM without it refuses this too)"),
        "mm_payload": ("tensors", "none", NO_MULTIMODAL),
        "return_mm_kwargs": (None, True, NO_MULTIMODAL),
        "cache_salt": (None, "salt", "the prefix cache is not partitioned by salt"),
        "kv_transfer_params": (None, {"do_remote_decode": True}, NO_TRANSFER),
        "ec_transfer_params": (None, {"a": 1}, NO_TRANSFER),
        "vllm_xargs": (None, {"key": 1}, "no extra arguments for plugins"),
    })

SAMPLING = Fields(
    honoured={
        **SHARED_HONOURED,
        "detokenize": "the generate route answers token ids only",
        "skip_clone": "an internal copy flag, nothing to clone here",
        "skip_reading_prefix_cache": "a prefix-cache hit gives the bits of a fresh prefill",
    },
    refused={
        **SHARED_REFUSED,
        "n": (1, 2, "one token sequence per generate request"),
        "flat_logprobs": (False, True, "log-probs come in the response's lists"),
        "output_kind": (0, 1, NO_STREAM),
        "output_text_buffer_length": (0, 4, NO_STREAM),
        "prompt_logprob_start": (None, 1, NO_PROMPT_LOGPROBS),
        "prompt_logprob_token_ids": (None, [[1]], NO_PROMPT_LOGPROBS),
        "trace_decode_token_ids": (None, [1], "no forced decoding"),
        "extra_args": (None, {"key": 1}, "no extra arguments for plugins"),
    })


def unchanged(value, default) -> bool:
    """Whether a request's value asks nothing of a refused field: missing or null, its
    default, or (for a default that is empty or false) another empty or false value."""
    if value is None or value == default:
        return True
    if isinstance(default, bool) and isinstance(value, str):
        return (value.lower() in TRUE) == default
    return not value and not default


def refuse_unhonoured(body: dict, table: Fields) -> None:
    """A 400 naming the first field of `body` that asks what this server does not do; fields
    vLLM does not know either are logged and ignored, as vLLM does."""
    for name, value in body.items():
        if name in table.refused:
            default, _, why = table.refused[name]
            if not unchanged(value, default):
                raise ApiError(400, f"'{name}' is not supported by this server: {why}; leave "
                               f"it out or at {default!r}.", param=name)
    unknown = sorted(set(body) - set(table.honoured) - set(table.refused))
    if unknown:
        log.warning("The following fields were present in the request but ignored: %s",
                    unknown)

TOKENIZE = Fields(honoured={"model": "server.model_of", "prompt": "server.tokenize",
                            "add_special_tokens": "server.prompt",
                            "return_token_strs": "server.tokenize"}, refused={})
DETOKENIZE = Fields(honoured={"model": "server.model_of", "tokens": "server.detokenize"},
                    refused={})

_NOT_IN_CHAT = ("prompt", "suffix", "echo", "prompt_embeds")
CHAT = Fields(
    honoured={
        **{k: v for k, v in COMPLETION.honoured.items() if k not in _NOT_IN_CHAT},
        "messages": "chat.render: through the model's chat template",
        "logprobs": "chat.chat_settings: with top_logprobs, the completion's logprobs",
        "top_logprobs": "chat.chat_settings",
        "max_completion_tokens": "chat.chat_settings: the completion's max_tokens",
        "tools": "chat.render (the template) and chat.chat_completion (model.tool_calls)",
        "tool_choice": "chat.render: 'auto' parses tool calls, 'none' does not",
        "include_reasoning": "no reasoning parser: an answer has no reasoning to leave out",
        "add_generation_prompt": "chat.render", "continue_final_message": "chat.render",
        "add_special_tokens": "chat.render (false by default, as vLLM's chat)",
        "documents": "chat.render", "chat_template": "chat.render",
        "chat_template_kwargs": "chat.render",
    },
    refused={
        **{k: v for k, v in COMPLETION.refused.items() if k not in _NOT_IN_CHAT},
        "echo": (False, True, "the last message is not repeated before the answer"),
        "reasoning_effort": (None, "low", "no reasoning parser"),
        "parallel_tool_calls": (True, False, "every call the model writes is returned"),
        "media_io_kwargs": (None, {"a": 1}, NO_MULTIMODAL),
        "mm_processor_kwargs": (None, {"a": 1}, NO_MULTIMODAL),
        "return_prompt_text": (None, True, "the rendered prompt is not returned (/tokenize "
                               "gives its ids)"),
    })
TOKENIZE_CHAT = Fields(
    honoured={"model": "server.model_of", "messages": "chat.render",
              "return_token_strs": "server.tokenize",
              **{k: CHAT.honoured[k] for k in (
                  "add_generation_prompt", "continue_final_message", "add_special_tokens",
                  "chat_template", "chat_template_kwargs", "tools")}},
    refused={k: CHAT.refused[k] for k in ("media_io_kwargs", "mm_processor_kwargs")})
