"""Flow control of the rollout worker: when the next group may start (the seed's "Concurrency").

- staleness: a new group starts only while queued + in-flight tokens fit the trainer's token
  allowance (`max(max_staleness, 1)` x the tokens of its last step; before the first step,
  full rows); until the first group finishes, one group at a time;
- server load: a live cap on rollouts in flight, started at the KV-cache capacity over
  max_model_len and adjusted from `/metrics` every 5 s (+25 % below 60 % usage with nothing
  waiting, -30 % above 80 %); `max_concurrent_rollouts` bounds it;
- a fixed schedule (`schedule_lag` L; `synchronous=True` is L = 0): the group of position p is
  sampled by version max(0, p // groups_per_step - L) and starts only once that version is
  published, so which version samples what never depends on timing; the allowance and the
  staleness rule play no part (the schedule bounds the lag). With max_steps or an interrupt,
  no group starts past the last block a step of the call can train (`position_limit`, the
  trainer's).
"""

from __future__ import annotations

import asyncio
import math
import time


def has_room(queued_tokens: float, in_flight_groups: int, group_tokens: list[float],
             allowance: float) -> bool:
    """The token-allowance rule: may a new group start?

    Queued + in-flight tokens (in-flight groups estimated at the mean size of recent groups),
    plus the new group, must fit the allowance. Until a first group has finished the size is
    unknown: one group at a time. With nothing queued or in flight a group always starts.
    """
    if in_flight_groups == 0 and queued_tokens <= 0:
        return True
    if not group_tokens:
        return in_flight_groups == 0
    estimate = sum(group_tokens) / len(group_tokens)
    return queued_tokens + (in_flight_groups + 1) * estimate <= allowance


class FlowControl:
    """The worker's admission of groups: `wait_for_room` returns once the schedule (or the
    token allowance) and the server-load cap let the next group start.

    The worker keeps the counts it reads here as groups and rollouts start and end:
    `in_flight_groups` (started, not yet scored), `in_flight_rollouts`, `tokens_per_group` (of
    each generated group), `finished_since_raise` (rollouts since the cap last rose). The
    shared values (`model_version`, `token_allowance`, `queued_tokens`, `position_limit`) are
    the trainer's; `stopping` and `record` are the worker's methods.
    """

    def __init__(self, config, model_version, token_allowance, queued_tokens, position_limit,
                 stopping, record):
        self.config, self.stopping, self.record = config, stopping, record
        self.model_version, self.token_allowance = model_version, token_allowance
        self.queued_tokens = queued_tokens
        self.position_limit = position_limit  # shared .value (-1: none), or None
        self.in_flight_groups = 0
        self.in_flight_rollouts = 0
        self.tokens_per_group: list[float] = []
        self.cap = config.max_concurrent_rollouts
        self.finished_since_raise = 0

    async def initial_cap(self, client) -> None:
        metrics = await client.metrics()
        if metrics is None:  # no /metrics: the configured bound is the cap
            return
        blocks = metrics.get("cache_config_info")
        if blocks:
            capacity = blocks["num_gpu_blocks"] * blocks["block_size"]
            fit = max(1, capacity // max(1, await client.max_model_len()))
            self.cap = min(self.config.max_concurrent_rollouts, fit)

    async def poll_metrics(self, client) -> None:
        last_preemptions = None
        while not self.stopping():
            await asyncio.sleep(5.0)
            metrics = await client.metrics()
            if metrics is None:
                continue
            usage, waiting = metrics.get("kv_cache_usage_perc", 0.0), metrics.get(
                "num_requests_waiting", 0.0)
            self.record("rollout/vllm_kv_cache_usage_frac", usage)
            self.record("rollout/vllm_running_requests", metrics.get("num_requests_running", 0))
            self.record("rollout/vllm_queued_requests", waiting)
            preemptions = metrics.get("num_preemptions_total", 0.0)
            if last_preemptions is not None:
                self.record("rollout/vllm_preemption_count", preemptions - last_preemptions)
            last_preemptions = preemptions
            if usage > 0.8:
                self.cap = max(1, math.floor(self.cap * 0.7))
            elif usage < 0.6 and waiting == 0 and self.finished_since_raise >= self.cap:
                self.cap = min(self.config.max_concurrent_rollouts, math.ceil(self.cap * 1.25))
                self.finished_since_raise = 0

    def room_for_group(self) -> bool:
        return has_room(self.queued_tokens.value, self.in_flight_groups,
                        self.tokens_per_group[-32:], self.token_allowance.value)

    def trainable(self, position: int) -> bool:
        limit = -1 if self.position_limit is None else self.position_limit.value
        return limit < 0 or position < limit

    async def wait_for_room(self, position: int) -> None:
        """Wait for the schedule (a fixed one's version and the run's end, or the free-running
        token allowance) and the concurrency cap; only the schedule's wait is
        `rollout/backpressure_s`."""
        held_back, version = 0.0, self.config.schedule_version(position)
        while not self.stopping():
            if version is None:
                room = self.room_for_group()
            else:  # the version that samples this position is published, and a step of the
                # call can still train it (`TrainerLifecycle._position_limit`)
                room = self.model_version.value >= version and self.trainable(position)
            if room and self.in_flight_rollouts + self.config.num_generations <= max(
                    self.cap, self.config.num_generations):
                break
            slept = time.monotonic()
            await asyncio.sleep(0.005)
            if not room:
                held_back += time.monotonic() - slept
        if held_back:
            self.record("rollout/backpressure_s", held_back)
