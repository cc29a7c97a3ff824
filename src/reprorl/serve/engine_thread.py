"""The engine in a background thread, as the HTTP server runs it.

The event loop only submits sequences and awaits their futures; the thread steps the engine
whenever work waits. Work that must not overlap a forward (a weight reload, a prefix-cache
reset) runs in the thread between two steps (`between_steps`); sequences already running go on
under the new weights with the KV they have, as in vLLM.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque

import torch

from .engine import Engine
from .sequence import ApiError, Sequence

log = logging.getLogger("reprorl.serve")


class EngineThread(Engine, threading.Thread):
    """An `Engine` that steps in its own daemon thread until `stop`; when it stops or breaks,
    every waiting request and call is answered with a 503, never left waiting."""

    def __init__(self, *args, **kwargs):
        Engine.__init__(self, *args, **kwargs)
        threading.Thread.__init__(self, name="engine", daemon=True)
        self.stopping = False
        self.calls: list[tuple] = []  # (work, future) to run between two steps

    def submit(self, seq: Sequence) -> None:
        with self.cond:
            self.waiting.append(seq)
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def between_steps(self, work) -> concurrent.futures.Future:
        """Run `work()` in the engine thread while no forward runs (a weight reload, a cache
        reset); the future gets its result or its exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            if self.stopping or not self.is_alive():
                future.set_exception(ApiError(503, "The engine has stopped."))
            else:
                self.calls.append((work, future))
                self.cond.notify()
        return future

    @staticmethod
    def run_calls(calls: list[tuple]) -> None:
        """`between_steps` work, each call once; a call its caller gave up on (a cancelled
        future: the client went away) is skipped, so it never half-applies unseen."""
        for work, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = work()
            except Exception as error:  # noqa: BLE001 (the caller reports it)
                future.set_exception(error)
            else:
                future.set_result(result)

    def run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self.cond:
                        while not (self.stopping or self.waiting or self.running
                                   or self.calls):
                            self.cond.wait()
                        if self.stopping:
                            return
                        calls, self.calls = self.calls, []
                        if not calls:
                            newcomers = self.schedule()
                    if calls:  # then round again: the next step sees their effect
                        started = time.perf_counter()
                        self.run_calls(calls)
                        self.work["busy_seconds"] += time.perf_counter() - started
                        continue
                    try:
                        self.step(newcomers)
                    except Exception as error:  # a bug outside one sequence's work
                        log.exception("engine step failed")
                        for seq in list(self.running):
                            self.release(seq)
                            seq.resolve(ApiError(500, f"generation failed: {error}"))
        finally:  # stopped or broken: /health turns 503 and nobody is left waiting
            with self.cond:
                self.stopping = True  # a call made from now on is refused, never left waiting
                left, self.running, self.waiting = [*self.running, *self.waiting], [], deque()
                calls, self.calls = self.calls, []
            for seq in left:
                seq.resolve(ApiError(503, "The engine has stopped."))
            for _, future in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(ApiError(503, "The engine has stopped."))
