"""`"stream": true`: a completion or a chat sent as server-sent events, as vLLM streams them.

Each sequence calls back after every token it takes (`Sequence.on_token`); the stream then sends
a chunk with the tokens since its last one: their text, their log-probs and ids. Text is held
back while it may still turn into a stop string (the longest one's length less one character,
unless `include_stop_str_in_output`) or ends in an incomplete character, so what was sent is
always the start of the final text. A choice's last chunk carries its finish and stop reasons;
with `stream_options.include_usage` a chunk of the whole request's usage follows the last
choice (and `continuous_usage_stats` puts the usage so far in every chunk); then `data:
[DONE]`. A stream only reads what the engine wrote: the tokens are those of the same request
unstreamed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass

from aiohttp import web

from .api import SYSTEM_FINGERPRINT, Reply, boolean, completion_logprobs, error_body, output_text
from .chat import logprobs as chat_logprobs
from .sequence import ApiError, Sequence

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


@dataclass(frozen=True)
class StreamOptions:
    """`stream_options`, refused (as vLLM refuses it) without `stream`."""

    usage: bool = False  # include_usage: a usage chunk after the last choice
    continuous: bool = False  # continuous_usage_stats: the usage so far in every chunk

    @classmethod
    def of(cls, body: dict) -> StreamOptions | None:
        """None: not streamed."""
        options = body.get("stream_options")
        if not boolean(body, "stream", False):
            if options is not None:
                raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                               param="stream_options")
            return None
        if options is None:
            return cls()
        if not isinstance(options, dict) or set(options) - {"include_usage",
                                                            "continuous_usage_stats"}:
            raise ApiError(400, "'stream_options' takes include_usage and "
                           "continuous_usage_stats.", param="stream_options")
        usage = boolean(options, "include_usage", False)
        return cls(usage, usage and boolean(options, "continuous_usage_stats", False))


@dataclass
class Sent:
    """What a choice has streamed so far."""

    tokens: int = 0
    text: str = ""
    offset: int = 0  # the next token's text offset (completion log-probs)
    started: bool = False


def held_text(seq: Sequence, upto: int, decode, skip_special: bool) -> str:
    """The text of the first `upto` generated tokens that may be sent before the end."""
    text = decode(seq.generated[:upto], skip_special_tokens=skip_special)
    while text.endswith("\ufffd"):  # the first bytes of a character the next token completes
        text = text[:-1]
    p = seq.params
    if p.stop and not p.include_stop:
        text = text[:max(0, len(text) - (max(map(len, p.stop)) - 1))]
    return text


class Stream:
    """One request's chunks: `chunk(index, seq, upto)` while a choice runs, then
    `chunk(index, seq, None)` once it ended; `usage()` after every choice."""

    def __init__(self, reply: Reply, options: StreamOptions, tokenizer, piece, chat: bool,
                 prompt_texts: list[str | None], choices: int):
        self.reply, self.options, self.tokenizer, self.piece = reply, options, tokenizer, piece
        self.chat, self.prompt_texts = chat, prompt_texts
        self.sent = [Sent() for _ in range(choices)]
        self.prompt_tokens: dict[int, int] = {}  # by prompt
        self.created = int(time.time())

    def head(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.reply.request_id}", "object": kind,
                "created": self.created, "model": self.reply.model}

    def roles(self) -> list[bytes]:
        """A chat's first chunk of each choice: the assistant's role."""
        return [event({**self.head(), "choices": [{
            "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None})
            for index in range(len(self.sent))]

    def chunk(self, index: int, seq: Sequence, upto: int | None) -> bytes | None:
        """The chunk of choice `index` with its tokens up to `upto`, or (None) to its end;
        None when there is nothing new."""
        sent, reply = self.sent[index], self.reply
        prompt = index // reply.samples
        self.prompt_tokens[prompt] = len(seq.prompt)
        ended = upto is None
        end = len(seq.generated) if ended else upto
        if not ended and end <= sent.tokens:
            return None
        text = (output_text(seq, self.tokenizer, reply.skip_special) if ended
                else held_text(seq, end, self.tokenizer.decode, reply.skip_special))
        # a tokenizer whose text of more tokens does not extend the shorter one's: wait
        moved_back = not text.startswith(sent.text)
        delta = "" if moved_back and not ended else text[len(sent.text):]
        choice = {"index": index}
        if self.chat:
            choice["delta"] = {"content": delta}
            choice["logprobs"] = chat_logprobs(seq, reply, self.piece, sent.tokens, end)
        else:
            if reply.echo and not sent.started and not reply.with_ids:
                prompt_text = self.prompt_texts[prompt]
                delta = (prompt_text if prompt_text is not None else self.tokenizer.decode(
                    seq.prompt, skip_special_tokens=reply.skip_special)) + delta
            choice["text"] = delta
            choice["logprobs"], sent.offset = completion_logprobs(
                seq, reply, self.piece, sent.tokens, end, sent.offset)
        choice["finish_reason"] = seq.finish_reason if ended else None
        if ended:
            choice["stop_reason"] = seq.stop_reason
        elif not self.chat:
            choice["stop_reason"] = None
        if not self.chat:
            choice["prompt_token_ids"] = (list(seq.prompt) if reply.with_ids
                                          and not sent.started else None)
        choice["token_ids"] = list(seq.generated[sent.tokens:end]) if reply.with_ids else None
        sent.tokens, sent.started = end, True
        if not moved_back:
            sent.text = text
        payload = {**self.head(), "choices": [choice]}
        if ended and not self.options.usage:  # else the usage chunk is the last
            payload["system_fingerprint"] = SYSTEM_FINGERPRINT
        if self.options.continuous:
            payload["usage"] = self.counts(len(seq.prompt), sent.tokens)
        return event(payload)

    @staticmethod
    def counts(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}

    def usage(self) -> bytes | None:
        """After every choice ended: the request's usage (with include_usage)."""
        if not self.options.usage:
            return None
        return event({**self.head(), "choices": [], "usage": self.counts(
            sum(self.prompt_tokens.values()), sum(s.tokens for s in self.sent)),
            "system_fingerprint": SYSTEM_FINGERPRINT})


async def respond(request, stream: Stream, runs: list, in_text_pool) -> web.StreamResponse:
    """Send `stream`'s choices as they come: `runs[i](on_token)` generates choice i (the
    server's `run`); `in_text_pool(work)` runs the tokenizer's work. An error after the
    first chunk is sent as an event, as vLLM does, and ends the stream; an error or a client
    that goes away stops the other choices."""
    events = asyncio.Queue()

    async def sample(index: int, run) -> None:
        try:
            seq = await run(on_token=lambda seq, upto, ended: ended or events.put_nowait(
                (index, seq, upto)))
            events.put_nowait((index, seq, None))  # after its tokens' events
        except ApiError as error:
            events.put_nowait((index, error, None))
        except Exception as error:  # noqa: BLE001 (sent as the stream's error event)
            events.put_nowait((index, ApiError(500, f"{type(error).__name__}: {error}"), None))

    tasks = [asyncio.ensure_future(sample(index, run)) for index, run in enumerate(runs)]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        for chunk in stream.roles() if stream.chat else []:
            await response.write(chunk)
        ended = 0
        while ended < len(tasks):
            index, seq, upto = await events.get()  # upto None: the sequence ended
            if isinstance(seq, ApiError):
                await response.write(event(error_body(seq)))
                break
            ended += upto is None
            chunk = await in_text_pool(functools.partial(stream.chunk, index, seq, upto))
            if chunk is not None:
                await response.write(chunk)
        else:
            usage = stream.usage()
            if usage is not None:
                await response.write(usage)
        await response.write(DONE)
    finally:
        for task in tasks:
            task.cancel()
    return response
