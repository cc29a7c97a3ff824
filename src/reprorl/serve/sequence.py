"""One generation request as the engine runs it, and the error a request fails with.

A `Sequence` carries a prompt through the engine: its sampling settings, its adapter, its own
generator, what it generated (tokens, log-probs, candidate masks, ranks) and how it ended. The
HTTP server awaits its future; in-process callers (`Engine.generate`) read the sequence itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .logprobs import Params

if TYPE_CHECKING:
    from .adapters import Adapter

FINISH_REASONS = ("stop", "length", "abort")


class ApiError(Exception):
    """A failure with its HTTP status (the server answers it in vLLM's JSON error shape)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param  # param: vLLM's field


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: Params
    adapter: Adapter | None  # a reference: an unloaded adapter stays usable until this ends
    generator: torch.Generator
    future: asyncio.Future | None = None  # None: driven by `Engine.generate`, nobody awaits
    loop: asyncio.AbstractEventLoop | None = None
    generated: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (sampled lp, top ids, top lps) per token
    masks: list = field(default_factory=list)  # per token, the ids it could have been
    ranks: list = field(default_factory=list)  # per token, its rank among the log-probs
    slot: int | None = None  # its row of the KV slots while it runs
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string it ended on
    # with stop strings: the output's text (the server's decode), and where a stop cut it
    text_of: Callable[[list[int]], str] | None = None
    text: str = ""
    text_end: int | None = None
    aborted: bool = False
    error: ApiError | None = None  # this request failed; the others go on
    # a streamed request's: called on its event loop after each token with (this sequence,
    # its tokens generated, whether it ended), as the engine thread saw them
    on_token: Callable[[Sequence, int, bool], None] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def take(self, token: int, logprob: float, top: tuple | None, rank: int | None,
             mask: list[int] | None) -> None:
        """A drawn token (`logprobs.draw`'s row) onto the sequence, which may end with it."""
        p = self.params
        if p.logprobs is not None:
            self.logprobs.append((logprob, *top))
            self.ranks.append(rank)
        if p.sampling_mask:
            self.masks.append(mask)
        self.generated.append(token)
        if token == p.eos_id:
            self.finish_reason = "stop"
        elif token in p.stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif len(self.generated) >= p.max_tokens:
            self.finish_reason = "length"
        if p.stop and len(self.generated) > p.min_tokens:
            self.find_stop_string()
        if self.on_token is not None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                self.loop.call_soon_threadsafe(self.on_token, self, len(self.generated),
                                               self.finish_reason is not None)

    def find_stop_string(self) -> None:
        """vLLM's stop strings: the first one the output's text holds, searched from where the
        newest token's characters could complete one, ends the sequence, its text cut before
        the string (after it with include_stop_str_in_output); an end token's own text is not
        searched unless included."""
        p, ended = self.params, self.finish_reason == "stop"
        shown = self.generated[:-1] if ended and not p.include_stop else self.generated
        before, self.text = len(self.text), self.text_of(shown)
        added = len(self.text) - before
        if added <= 0:
            return
        for stop in p.stop:
            at = self.text.find(stop, max(0, len(self.text) - added - len(stop) + 1))
            if at != -1:
                self.finish_reason, self.stop_reason = "stop", stop
                self.text_end = at + len(stop) if p.include_stop else at
                return

    def resolve(self, error: Exception | None = None) -> None:
        if self.loop is None:  # `Engine.generate` reads the outcome from the sequence itself
            return

        def settle():
            if not self.future.done():
                self.future.set_exception(error) if error else self.future.set_result(self)
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody waits
            self.loop.call_soon_threadsafe(settle)
