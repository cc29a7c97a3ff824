"""`SampleQueue`: the trainer's end of the rollout worker's queue, one micro-batch at a time.

The worker puts one `GroupResult` per prompt position; this unit unpacks groups into samples,
drops a sample more than `max_staleness` weight versions old at dequeue (`is_stale`), and a
sample longer than the token budget, and hands out micro-batches the batcher accepts
(`batcher.fits`; a free-running micro-batch stops waiting for groups once `batcher.full`). A
sample that does not fit the micro-batch being filled is carried over to the next one, and
judged for staleness again then (a step and a weight sync may have passed). Every taken or
dropped sample leaves the shared queued-token and queued-sample counters at once, not after the
step: a step that held the whole token allowance would otherwise wait for a group the worker
may not start. Every arrival, training and drop is entered in the `PositionLedger`, and a
group's content metrics (its `records`) in the window when its samples are taken. A fixed
schedule takes a whole block of positions at a time instead, in position order (`next_block`).

Watchdog: when `stall_positions` prompt positions in a row (an epoch's worth) arrive without a
sample (dropped for zero reward variance, or filtered), or no sample is trained for
`stall_timeout` seconds, the run stops with a `StalledRun` error that counts what arrived.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import time

from .ledger import PositionLedger
from .metrics import MetricsWindow
from .samples import GroupResult, Sample

logger = logging.getLogger("reprorl.grpo")


def is_stale(current_version: int, sample_version: int, max_staleness: int) -> bool:
    """A sample more than max_staleness weight versions behind at dequeue is dropped."""
    return current_version - sample_version > max_staleness


class StalledRun(RuntimeError):
    """No sample reached training for an epoch of prompts, or for `stall_timeout` seconds."""


class SampleQueue:
    def __init__(self, groups, ledger: PositionLedger, version, max_staleness: int,
                 queued_tokens, queued_samples, window: MetricsWindow, *,
                 check_worker=lambda: None, log=print,
                 stall_positions: int | None = None, stall_timeout: float = math.inf):
        self.groups = groups  # the worker's GroupResults (get(timeout=...), queue.Empty)
        self.ledger = ledger
        self.version = version  # .value: the newest published weight version
        self.max_staleness = max_staleness
        self.queued_tokens, self.queued_samples = queued_tokens, queued_samples  # shared
        self.window = window
        self.check_worker = check_worker  # raises when the worker failed, died or hung
        self.log = log
        self.pending: collections.deque[Sample] = collections.deque()
        self.carried: Sample | None = None
        self.parked: dict[int, GroupResult] = {}  # fixed schedule: groups not yet due
        self.received = 0  # GroupResults taken off the queue
        self.exhausted = False  # epoch mode: no position is left to arrive
        self.wait_s = 0.0  # time spent waiting for groups since take_wait_s()
        self.stall_positions, self.stall_timeout = stall_positions, stall_timeout
        self.last_trained = time.monotonic()  # when a sample last went to training
        self.since_trained: collections.Counter = collections.Counter()  # what came instead

    def next_microbatch(self, batcher) -> list[Sample]:
        """Samples for one micro-batch: as many as fit, or fewer when none is waiting any more
        (empty: nothing arrived, or the run's positions are all consumed)."""
        samples: list[Sample] = []
        while True:
            if not self.pending and batcher.full(samples):
                return samples  # waiting for another group could not add to it
            sample = self._next_sample()
            if sample is None:
                return samples
            if self._dropped_oversize(sample, batcher):
                continue
            if not batcher.fits(samples, sample):
                self.carried = sample
                return samples
            self._take(sample)
            samples.append(sample)

    def next_block(self, first: int, last: int, batcher) -> list[list[Sample]]:
        """A fixed schedule's step: once every position in [first, last) has arrived (or was
        consumed before a resume), their samples in position order, cut into the micro-batches
        the batcher accepts. Groups of later positions that arrive meanwhile wait their turn,
        so the result never depends on the order in which the worker finished them."""
        while not all(self.ledger.has_arrived(p) for p in range(first, last)):
            group = self._arrival()
            if group is None:  # the run's last positions are all here
                break
            self.parked[group.position] = group
        batches: list[list[Sample]] = [[]]
        for position in range(first, last):
            group = self.parked.pop(position, None)
            if group is None:  # consumed before a resume (a free-running checkpoint's cursor)
                continue
            self.window.merge(group.records)  # in position order: the window is reproducible
            for sample in group.samples:
                if self._dropped_oversize(sample, batcher):
                    continue
                current = batches[-1]
                if current and not batcher.fits(current, sample):
                    batches.append(current := [])
                self._take(sample)
                current.append(sample)
        return [batch for batch in batches if batch]

    def _arrival(self) -> GroupResult | None:
        """The next group off the queue, timed as waiting and entered in the ledger."""
        started = time.monotonic()
        group = self._next_group()
        self.wait_s += time.monotonic() - started
        if group is not None:
            self.ledger.arrive(group.position, len(group.samples))
        return group

    def _dropped_oversize(self, sample: Sample, batcher) -> bool:
        oversize = batcher.oversize(sample)
        self.window.add("batch/dropped_oversize_count", int(oversize))
        if oversize:
            self.since_trained["samples over token_budget"] += 1
            logger.warning("dropping a sample of %d tokens: over token_budget=%d",
                           sample.tokens, batcher.token_budget)
            self.log(f"warning: dropped a {sample.tokens}-token sample (token_budget "
                     f"{batcher.token_budget})")
            self._drop(sample)
        return oversize

    def _take(self, sample: Sample) -> None:
        """`sample` goes to training."""
        # queue_size: the scored samples that were waiting, this one included
        self.window.add("rollout/queue_size", self.queued_samples.value)
        self._release(sample)
        self.last_trained = time.monotonic()
        self.since_trained.clear()

    def take_wait_s(self) -> float:
        """Seconds spent waiting for the worker since the last call."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def _next_sample(self) -> Sample | None:
        if self.carried is not None:
            self.pending.appendleft(self.carried)
            self.carried = None
        while True:
            while self.pending:
                sample = self.pending.popleft()
                stale = is_stale(self.version.value, sample.model_version, self.max_staleness)
                self.window.add("sample/dropped_stale_count", int(stale))  # 0s: always logged
                if not stale:
                    return sample
                self.since_trained["stale samples"] += 1
                self._drop(sample)
            group = self._arrival()
            if group is None:
                return None
            self.window.merge(group.records)
            self.pending.extend(group.samples)

    def _next_group(self) -> GroupResult | None:
        while not self.ledger.finished:
            try:
                group = self.groups.get(timeout=0.05)
            except queue.Empty:
                if self.ledger.all_arrived():
                    break  # the epoch's last groups are all here: train what is left
                self.check_worker()
                self._check_stall(clock=True)
                continue
            self.received += 1
            if group.samples:  # progress: these samples will train
                self.last_trained = time.monotonic()
            else:  # a position that cannot lead to training
                self.since_trained["empty"] += 1
                self.since_trained[f"{group.reason} groups"] += 1
            self._check_stall(clock=False)
            return group
        self.exhausted = True
        return None

    def _check_stall(self, clock: bool) -> None:
        """Raise `StalledRun` after an epoch of empty positions, or (`clock`: while waiting
        for the worker) after `stall_timeout` seconds without samples."""
        idle_s, seen = time.monotonic() - self.last_trained, self.since_trained
        if self.stall_positions is not None and seen["empty"] >= self.stall_positions:
            why = (f"{seen['empty']} prompt positions in a row (an epoch of "
                   f"{self.stall_positions} prompts) gave no sample to train")
            hint = ("GRPO learns only from groups whose rewards differ: check the reward "
                    "functions (a reward that gives every completion of a group the same "
                    "value leaves nothing to learn), filter_prompt, max_staleness, token_budget")
        elif clock and idle_s > self.stall_timeout:
            why = (f"no sample was trained for {idle_s:.0f} s (stall_timeout="
                   f"{self.stall_timeout:g} s)")
            hint = ("the worker is alive: look for a generation server that accepts requests "
                    "but does not answer, or a reward function that does not return")
        else:
            return
        counts = ", ".join(f"{n} {what}" for what, n in sorted(seen.items())
                           if n and what != "empty") or "nothing"
        raise StalledRun(f"{why}; what arrived instead: {counts}. {hint}")

    def _release(self, sample: Sample) -> None:
        """The sample left the queue: it no longer counts against the worker's allowance."""
        with self.queued_tokens.get_lock():
            self.queued_tokens.value -= sample.tokens
        with self.queued_samples.get_lock():
            self.queued_samples.value -= 1

    def _drop(self, sample: Sample) -> None:
        self._release(sample)
        self.ledger.consume(sample.position)
