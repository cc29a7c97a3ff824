"""vLLM's `/v1/chat/completions`: messages through the model's chat template, then sampled.

A request's messages (and tools, documents) are rendered with the tokenizer's chat template as
vLLM renders them (`add_generation_prompt`, `continue_final_message`, `chat_template`,
`chat_template_kwargs`), sampled as a completion is (`api.sampling_params`: the chat request's
`max_completion_tokens` and `logprobs`/`top_logprobs` in the completion's terms), and answered
in vLLM's chat shape. With `tools` and `tool_choice: "auto"`, the calls the model writes are
read by the parser the GRPO worker uses (`model.tool_calls`), as vLLM's hermes parser reads
them, into the message's `tool_calls`.
"""

from __future__ import annotations

import json
import time
import uuid

from reprorl.model.tool_calls import parse_tool_calls

from .api import (
    SYSTEM_FINGERPRINT,
    Reply,
    boolean,
    json_logprob,
    number,
    output_text,
    text,
    usage,
)
from .sequence import ApiError, Sequence


def chat_settings(body: dict) -> dict:
    """The chat request in a completion's terms: `max_completion_tokens` (or the older
    `max_tokens`) and `logprobs: true` with `top_logprobs` k as the completion's `logprobs`."""
    settings = {k: v for k, v in body.items() if k not in (
        "max_completion_tokens", "logprobs", "top_logprobs")}
    most = body.get("max_completion_tokens")
    settings["max_tokens"] = most if most is not None else body.get("max_tokens")
    top = number(body, "top_logprobs", 0, int)
    if boolean(body, "logprobs", False):
        settings["logprobs"] = top
    elif top:
        raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                       param="top_logprobs")
    return settings


def messages_of(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError(400, "'messages' must be a non-empty list of messages, each with a "
                       "role.", param="messages")
    return [{**m, "content": content_of(m)} for m in messages]


def content_of(message: dict) -> str | None:
    """A message's content as a template reads it: a string, or the text of its parts."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, "a message's content must be a string or a list of text parts (this "
                   "server takes text only).", param="messages")


def render(body: dict, tokenizer) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether the answer's tool calls are to be parsed."""
    generation = boolean(body, "add_generation_prompt", True)
    final = boolean(body, "continue_final_message", False)
    if generation and final:
        raise ApiError(400, "Cannot set both `continue_final_message` and "
                       "`add_generation_prompt` to True.", param="continue_final_message")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict) for t in tools)):
        raise ApiError(400, "'tools' must be a list of function tools.", param="tools")
    choice = body.get("tool_choice", "none" if not tools else "auto")
    if choice not in ("none", "auto", None):
        raise ApiError(400, f"tool_choice {choice!r} is not supported by this server: it needs "
                       "guided decoding; use 'auto' or 'none'.", param="tool_choice")
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object.",
                       param="chat_template_kwargs")
    try:
        prompt = tokenizer.apply_chat_template(
            messages_of(body), tools=tools, documents=body.get("documents"),
            chat_template=text(body, "chat_template"), add_generation_prompt=generation,
            continue_final_message=final, tokenize=False, **extra)
    except (ValueError, TypeError, KeyError) as error:
        raise ApiError(400, f"the chat template could not render these messages: {error}",
                       param="messages") from error
    ids = tokenizer(prompt, add_special_tokens=boolean(body, "add_special_tokens", False))
    return ids["input_ids"], bool(tools) and choice == "auto"


def chat_completion(seqs: list[Sequence], reply: Reply, tokenizer, piece,
                    tool_calls: bool) -> dict:
    """vLLM's chat response for the finished `seqs` (the `n` samples of one prompt)."""
    choices = []
    for index, seq in enumerate(seqs):
        content = output_text(seq, tokenizer, reply.skip_special)
        calls = []
        if tool_calls:
            content, calls = parse_tool_calls(content)
        message = {"role": "assistant", "content": content or (None if calls else content),
                   "refusal": None, "annotations": None, "audio": None, "function_call": None,
                   **({"tool_calls": [{
                       "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                       "function": {"name": call["name"],
                                    "arguments": json.dumps(call["arguments"])}}
                       for call in calls]} if calls else {}),
                   "reasoning": None}
        choices.append({
            "index": index, "message": message, "logprobs": logprobs(seq, reply, piece),
            "finish_reason": "tool_calls" if calls else seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": list(seq.generated) if reply.with_ids else None,
            "routed_experts": None})
    return {"id": f"chatcmpl-{reply.request_id}", "object": "chat.completion",
            "created": int(time.time()), "model": reply.model, "choices": choices,
            "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage(len(seqs[0].prompt), sum(len(seq.generated) for seq in seqs)),
            "prompt_logprobs": None,
            "prompt_token_ids": list(seqs[0].prompt) if reply.with_ids else None,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None}


def logprobs(seq: Sequence, reply: Reply, piece, start: int = 0,
             end: int | None = None) -> dict | None:
    """vLLM's chat log-probs of the generated tokens [start, end): each token with its bytes
    and its top alternatives."""
    if seq.params.logprobs is None:
        return None

    def entry(tid: int, value: float) -> dict:
        token = f"token_id:{tid}" if reply.as_ids else piece(tid)
        return {"token": token, "logprob": json_logprob(value),
                "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [
        {**entry(tid, value), "top_logprobs": [entry(o, v) for o, v in zip(ids, values)]}
        for tid, (value, ids, values) in zip(seq.generated[start:end],
                                             seq.logprobs[start:end])]}
