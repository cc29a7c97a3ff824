"""The rollout worker: generates, scores and queues samples in its own spawned process.

`AsyncRolloutLoop` runs one asyncio loop. Each prompt passes, in order, through
`filter_prompt` -> `num_generations` x `generate_one` (each calling `generate_one_turn` per
sampling request) -> scoring of the complete group -> `compute_advantages` -> the drop rule ->
samples onto the trainer's queue. Subclass it, override a hook, and set the subclass as the
trainer's `loop_cls` (define it at module level: the loop is built in the spawned process).
What the hooks take and return (`TurnRecord`, `Rollout`, `RolloutGroup`) and what reaches the
trainer (`Sample`, `GroupResult`) are plain data, in `samples.py`.

Flow control (the seed's "Concurrency"):
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
Positions count through each epoch's seeded shuffle of the rows. Every position reaches the
trainer exactly once: as samples, or as a "consumed" marker (filtered prompt, dropped group),
so the trainer can keep the resume cursor; a resumed worker starts at the cursor and skips
`consumed_after_cursor`.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
import pickle
import queue
import signal
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from reprorl.model.grpo_losses import group_advantages, group_is_dropped
from reprorl.serve.client import CompletionClient, ServerRequestError

from .agents import (
    EnvironmentPool,
    assistant_message,
    call_tool,
    environment_factories,
    environment_tools,
    observe,
    parse_tool_calls,
    run_in_pool,
    tool_name,
)
from .processes import die_with_parent
from .rows import epoch_length, epoch_order, map_positions  # noqa: F401 (epoch_order: hooks')
from .samples import (
    GroupResult,
    Rollout,
    RolloutGroup,
    Sample,
    TrainingSequence,
    TurnRecord,
    reconcile_turns,
)
from .weight_sync import served_name

_MODEL = contextvars.ContextVar("served_model_name")  # the adapter a group started under
_ROLLOUT = contextvars.ContextVar("rollout")  # [rollout key, requests so far]: request seeds


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


def request_seed(seed: int, rollout_key: int | None, request: int) -> int:
    """The sampling seed of a rollout's n-th request: a function of where the rollout sits in
    the run, never of a counter, so a resumed run does not repeat the seeds of its start
    (`rollout_key=None`: a request made outside a rollout, numbered by the loop)."""
    words = [seed % 2**32, 0, request] if rollout_key is None else [
        seed % 2**32, 1, rollout_key, request]
    return int(np.random.SeedSequence(words).generate_state(1)[0] % (2**31 - 1))


def reward_name(func) -> str:
    """Metric name of a reward function (a partial is named after what it wraps)."""
    func = getattr(func, "func", func)
    return getattr(func, "__name__", None) or type(func).__name__


def prompt_token_ids(tokenizer, prompt: list[dict], chat_template_kwargs=None,
                     tools=None) -> list[int]:
    """A conversation as the token ids a turn sends (the generation prompt appended)."""
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                         tools=tools or None, **(chat_template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class AsyncRolloutLoop:
    def __init__(self, config, model_name: str, dataset, reward_funcs: list, processing_class,
                 eos_token_ids: list[int], rollout_buffer, model_version_value, token_allowance,
                 heartbeat_value, failed_event, exception_info_queue, metrics_queue,
                 tools=None, environment_factory=None, score_queue_maxsize: int = 16,
                 lora_name: str | None = None, dataset_start_index: int = 0, *,
                 queued_tokens=None, queued_samples=None, stop_event=None,
                 consumed_after_cursor=(), sampling_mask: bool = False, position_limit=None):
        self.config, self.model_name, self.dataset = config, model_name, dataset
        self.reward_funcs, self.tokenizer = list(reward_funcs), processing_class
        self.eos_token_ids = set(eos_token_ids)
        self.rollout_buffer, self.model_version = rollout_buffer, model_version_value
        self.token_allowance, self.heartbeat = token_allowance, heartbeat_value
        self.position_limit = position_limit  # shared .value (-1: none), or None
        self.failed_event, self.exception_info_queue = failed_event, exception_info_queue
        self.metrics_queue, self.tools = metrics_queue, list(tools or [])
        self.environments = EnvironmentPool(environment_factories(environment_factory))
        self.has_tools = bool(self.tools or self.environments.factories)
        self.score_queue_maxsize = score_queue_maxsize
        self.lora_name, self.start = lora_name, dataset_start_index
        self.queued_tokens, self.queued_samples = queued_tokens, queued_samples
        self.stop_event = stop_event
        self.consumed_after_cursor = set(consumed_after_cursor)  # a resume skips these
        self.sampling_mask = sampling_mask  # the trainer found the server returns the sets
        self.request_number = 0
        self.in_flight_groups = 0
        self.in_flight_rollouts = 0
        self.tokens_per_group: list[float] = []
        self.cap = config.max_concurrent_rollouts
        self.finished_since_raise = 0
        self.records: list[tuple] = []
        self.last_rate_time = time.monotonic()

    # ------------------------------------------------------------ hooks

    def filter_prompt(self, row_index: int, row: dict, epoch: int) -> bool:
        """Whether to generate for this prompt; a rejected one counts as consumed."""
        return True

    async def generate_one(self, prompt: list[dict], tools: list, group_id: int = 0) -> Rollout:
        """One rollout: the tool loop. Each turn renders the whole conversation (with the
        tools' schemas), samples a reply, and runs the tool calls in it, in order, appending
        their results as tool messages; it ends at a turn without calls, a turn cut at
        max_completion_length, or after `max_tool_calling_iterations` tool-calling turns."""
        by_name = {tool_name(t): t for t in tools}
        limit = self.config.max_tool_calling_iterations
        rollout = Rollout([], [], [])
        while True:
            prompt_ids = prompt_token_ids(self.tokenizer, prompt + rollout.completion,
                                          self.config.chat_template_kwargs, tools)
            turn = await self.generate_one_turn(prompt_ids)
            rollout.turns.append(turn)
            rollout.completion_ids += turn.output_ids
            ids = turn.output_ids
            body = ids[:-1] if ids and ids[-1] in self.eos_token_ids else ids
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            content, calls = parse_tool_calls(text) if tools else (text, [])
            if calls and turn.finish_reason != "stop":  # cut mid-reply: nothing is called
                content, calls = text, []
            rollout.completion.append(assistant_message(content, calls))
            if not calls:
                return rollout
            if limit is not None and len(rollout.tool_batches) >= limit:
                rollout.loop_exhausted = True
                return rollout
            rollout.tool_batches.append(len(calls))
            for call in calls:
                done = await call_tool(by_name, call["name"], call["arguments"],
                                       self.tool_pool, self.config.tool_timeout)
                rollout.tool_calls.append(done)
                if not done.unknown:
                    self.record("tools/latency_s", done.latency_s)
                    self.record(f"tools/{done.name}/latency_s", done.latency_s)
                rollout.tool_call_count += 1
                rollout.tool_failure_count += done.failed
                rollout.completion.append(
                    {"role": "tool", "name": done.name, "content": done.result})

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the config's settings and a fresh seed."""
        rollout = _ROLLOUT.get(None)
        if rollout is None:  # called outside a rollout (a custom hook): a running count
            self.request_number += 1
            seed = request_seed(self.config.seed, None, self.request_number)
        else:
            rollout[1] += 1
            seed = request_seed(self.config.seed, rollout[0], rollout[1])
        top = self.config.num_sampler_logprobs if self.config.score_centering else 0
        settings = {"prompt_ids": prompt_ids, "max_tokens": self.config.max_completion_length,
                    "temperature": self.config.temperature, "seed": seed, "logprobs": top}
        config = self.config
        settings["sampling"] = {"top_k": config.top_k, "top_p": config.top_p,
                                "min_p": config.min_p or 0.0,
                                "repetition_penalty": config.repetition_penalty}
        if self.config.truncated_sampling:  # the candidate sets too, when the server has them
            settings["sampling_mask"] = self.sampling_mask
        model = _MODEL.get(self.model_name)
        try:
            reply, retries = await self.client.complete(model=model, **settings)
        except ServerRequestError as error:
            # the group's adapter left the live window (max_staleness 0) before this request
            # got through: sample under the current one; the group keeps its older version,
            # so the trainer's staleness rule still judges it conservatively
            if error.status != 404 or self.lora_name is None or model == self.served_name() or (
                    self.config.schedule_lag is not None):  # a fixed schedule never swaps
                raise
            reply, retries = await self.client.complete(model=self.served_name(), **settings)
        self.record("rollout/vllm_retry_count", retries)  # 0s too: the metric is always there
        return TurnRecord(prompt_ids, reply.token_ids, reply.logprobs,
                          output_sampling_mask=reply.sampling_mask,
                          output_sampler_logprobs=reply.top_logprobs if top else None,
                          finish_reason=reply.finish_reason)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """GRPO: each reward standardised within the group; NaN rewards get 0."""
        return group_advantages(group.rewards)

    async def setup(self) -> None:
        """Create resources for the other hooks (runs on the loop before the first prompt)."""

    async def close(self) -> None:
        """Release what setup created (runs when the loop stops, also on failure)."""

    # ------------------------------------------------------------ plumbing

    def record(self, name: str, value: float) -> None:
        self.records.append(("value", name, float(value)))

    def record_rate(self, name: str, amount: float, seconds: float) -> None:
        self.records.append(("rate", name, (float(amount), float(seconds))))

    def flush_records(self) -> None:
        if self.records:
            self.metrics_queue.put(self.records)
            self.records = []

    def _put(self, result: GroupResult) -> None:
        self.rollout_buffer.put(result)

    def served_name(self, version: int | None = None) -> str:
        if self.lora_name is None:
            return self.model_name
        return served_name(self.lora_name,
                           self.model_version.value if version is None else version)

    async def run(self) -> None:
        self.client = CompletionClient(self.config.vllm_server_base_url,
                                       self.config.vllm_request_timeout,
                                       self.config.vllm_max_retries,
                                       self.config.vllm_server_api_key)
        # sync reward functions run here, not in asyncio's default pool: asyncio.run() waits
        # for the default pool's threads, so a hung one would keep the worker from reporting
        # its failure; the thread itself lives on until the trainer terminates the worker
        self.reward_pool = ThreadPoolExecutor(max(1, len(self.reward_funcs)),
                                              thread_name_prefix="reward")
        # tools and environments: a slow one holds up its own rollout only (the seed's size)
        self.tool_pool = ThreadPoolExecutor(self.config.max_concurrent_rollouts,
                                            thread_name_prefix="tool")
        self.score_queue: asyncio.Queue = asyncio.Queue(self.score_queue_maxsize)
        self.slots = asyncio.Condition()
        await self.client.open()
        try:
            await self.setup()
            await self._initial_cap()
            self.crashed = asyncio.get_running_loop().create_future()  # a group task's error
            tasks = [asyncio.create_task(c) for c in (
                self._produce(), self._score(), self._beat(), self._poll_metrics())]
            tasks.append(self.crashed)
            # _score and `crashed` never finish on their own, so waiting for every task would
            # only end when the trainer kills the process: stop once stop_event is set (the
            # heartbeat task then returns) or as soon as a task fails.
            pending = set(tasks)
            try:
                while pending and not self.stopping():
                    done, pending = await asyncio.wait(pending,
                                                       return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        if not task.cancelled() and task.exception() is not None:
                            raise task.exception()
            finally:
                for task in pending:
                    task.cancel()
        finally:
            try:
                await self.close()
            finally:
                self.reward_pool.shutdown(wait=False, cancel_futures=True)
                self.tool_pool.shutdown(wait=False, cancel_futures=True)
                await self.client.aclose()
                self.flush_records()

    def stopping(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    async def _beat(self) -> None:
        while not self.stopping():
            self.heartbeat.value = time.time()
            self.flush_records()
            await asyncio.sleep(0.5)

    async def _initial_cap(self) -> None:
        metrics = await self.client.metrics()
        if metrics is None:  # no /metrics: the configured bound is the cap
            return
        blocks = metrics.get("cache_config_info")
        if blocks:
            capacity = blocks["num_gpu_blocks"] * blocks["block_size"]
            fit = max(1, capacity // max(1, await self.client.max_model_len()))
            self.cap = min(self.config.max_concurrent_rollouts, fit)

    async def _poll_metrics(self) -> None:
        last_preemptions = None
        while not self.stopping():
            await asyncio.sleep(5.0)
            metrics = await self.client.metrics()
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

    def _room_for_group(self) -> bool:
        return has_room(self.queued_tokens.value, self.in_flight_groups,
                        self.tokens_per_group[-32:], self.token_allowance.value)

    def _trainable(self, position: int) -> bool:
        limit = -1 if self.position_limit is None else self.position_limit.value
        return limit < 0 or position < limit

    async def _wait_for_room(self, position: int) -> None:
        """Wait for the schedule (a fixed one's version and the run's end, or the free-running
        token allowance) and the concurrency cap; only the schedule's wait is
        `rollout/backpressure_s`."""
        held_back, version = 0.0, self.config.schedule_version(position)
        while not self.stopping():
            if version is None:
                room = self._room_for_group()
            else:  # the version that samples this position is published, and a step of the
                # call can still train it (`AsyncGRPOTrainer._position_limit`)
                room = self.model_version.value >= version and self._trainable(position)
            if room and self.in_flight_rollouts + self.config.num_generations <= max(
                    self.cap, self.config.num_generations):
                break
            slept = time.monotonic()
            await asyncio.sleep(0.005)
            if not room:
                held_back += time.monotonic() - slept
        if held_back:
            self.record("rollout/backpressure_s", held_back)

    async def _produce(self) -> None:
        length = epoch_length(self.dataset)  # None: a stream, whose epochs end unannounced
        stream, end = length is None, None
        if self.config.max_steps <= 0:  # a stream has max_steps (rows.as_rows)
            end = math.ceil(self.config.num_train_epochs * length)
        source = self.dataset.positions(self.start) if stream else map_positions(
            self.dataset, self.start, self.config.data_order_seed,
            self.config.train_sampling_strategy == "random")
        accepted_in_epoch, current_epoch = 0, None
        group_id, tasks = 0, set()
        while not self.stopping():
            # a stream may read from disk or the network: off the loop, so heartbeats go on
            position, epoch, index, row_index, row = (
                await asyncio.to_thread(next, source) if stream else next(source))
            if end is not None and position >= end:
                break
            if epoch != current_epoch:
                if stream and current_epoch is not None and accepted_in_epoch == 0:
                    raise RuntimeError(f"filter_prompt rejected every prompt of epoch "
                                       f"{current_epoch}: no sample can reach the trainer; "
                                       "loosen the filter")
                current_epoch, accepted_in_epoch = epoch, 0
            if position in self.consumed_after_cursor:
                continue
            if self.filter_prompt(row_index, row, epoch):
                accepted_in_epoch += 1
                await self._wait_for_room(position)
                if self.stopping():
                    break
                self.in_flight_groups += 1
                task = asyncio.create_task(self._group(position, row_index, row, group_id))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                group_id += 1
            else:
                self._put(GroupResult(position, [], "filtered"))
            if not stream and index == length - 1 and accepted_in_epoch == 0:
                raise RuntimeError(f"filter_prompt rejected every prompt of epoch {epoch}: no "
                                   "sample can reach the trainer; loosen the filter")
        while tasks and not self.stopping():  # let the last groups finish
            await asyncio.sleep(0.05)
        await self.score_queue.join()
        while not self.stopping():
            await asyncio.sleep(0.1)

    async def _group(self, position: int, row_index: int, row: dict, group_id: int) -> None:
        version = self.config.schedule_version(position)
        if version is None:  # free-running: the newest (read once: name and tag must agree)
            version = self.model_version.value
        token = _MODEL.set(self.served_name(version))
        try:
            started = time.monotonic()
            k = self.config.num_generations
            outcomes = await asyncio.gather(*[
                self._one(row, group_id, position * k + i) for i in range(k)])
            group = self._assemble(outcomes, row, row_index, group_id, version, position)
            tokens = sum(len(s.input_ids) for seqs in group.completions_sequences for s in seqs)
            self.tokens_per_group.append(tokens)
            self.record("rollout/group_duration_s", time.monotonic() - started)
            put_started = time.monotonic()
            group.queued_at = time.monotonic()
            await self.score_queue.put(group)
            self.record("rollout/score_block_s", time.monotonic() - put_started)
        except Exception as error:  # noqa: BLE001 (no one awaits this task: run() re-raises)
            self.in_flight_groups -= 1  # a scored group leaves the count in _score
            if not self.crashed.done():
                self.crashed.set_exception(error)
        finally:
            _MODEL.reset(token)

    async def _environment_call(self, method, what: str, kwargs: dict):
        """reset() or get_reward() in the tool pool; a failure there fails the run (it is the
        environment's fault, not the policy's)."""
        started = time.monotonic()
        label = f"{type(method.__self__).__name__}.{method.__name__}()"
        try:
            value = await run_in_pool(method, self.tool_pool, self.config.tool_timeout,
                                      kwargs)
        except TimeoutError as error:
            raise RuntimeError(f"{label} took more than tool_timeout="
                               f"{self.config.tool_timeout:g} s") from error
        except Exception as error:
            raise RuntimeError(f"{label} raised {type(error).__name__}: {error}") from error
        self.record(what, time.monotonic() - started)
        return value

    async def _one(self, row: dict, group_id: int, rollout_key: int):
        """One rollout of a row, in an environment when there are some: the instance is reset
        with the row's columns, its methods join the tools, and its get_reward() scores the
        rollout. Returns the prompt it started from, the rollout and the environment's
        reward (its class, the value)."""
        _ROLLOUT.set([rollout_key, 0])  # this task's own context: its requests' seeds
        self.in_flight_rollouts += 1
        self.record("rollout/concurrency", self.in_flight_rollouts)
        self.record("rollout/concurrency_cap", self.cap)
        started = time.monotonic()
        prompt, tools, env_reward = row.get("prompt"), self.tools, None
        key = environment = None
        try:
            if self.environments.factories:
                key = self.environments.key_of(row)
                environment = await asyncio.get_running_loop().run_in_executor(
                    self.tool_pool, self.environments.take, key)  # __init__ off the loop
                columns = {k: v for k, v in row.items() if not (key and k == "environment")}
                observation = await self._environment_call(environment.reset, "env/reset_s",
                                                           columns)
                prompt = observe(prompt, observation)
                tools = [*self.tools, *environment_tools(environment)]
            rollout = await self.generate_one(prompt, tools, group_id)
            if callable(getattr(environment, "get_reward", None)):
                value = await self._environment_call(environment.get_reward, "env/reward_s",
                                                     {})
                env_reward = (type(environment), value)
            # not reused after a failure (the run stops) or a tool call that timed out (its
            # thread may still be changing the instance)
            if environment is not None and not any(c.timed_out for c in rollout.tool_calls):
                self.environments.give_back(key, environment)
        finally:
            self.in_flight_rollouts -= 1
            self.finished_since_raise += 1
        self.record("rollout/duration_s", time.monotonic() - started)
        generated = sum(len(t.output_ids) for t in rollout.turns)
        now = time.monotonic()
        self.record_rate("rollout/generated_tokens_per_s", generated, now - self.last_rate_time)
        self.last_rate_time = now
        self.record("rollout/turns_mean", len(rollout.turns))
        self.record("rollout/turns_max", len(rollout.turns))
        return prompt, rollout, env_reward

    def _assemble(self, outcomes, row, row_index, group_id, version, position):
        prompts, rollouts, env_rewards = (list(part) for part in zip(*outcomes))
        columns = {k: [v] * len(rollouts) for k, v in row.items() if k != "prompt"}
        sequences = []
        for rollout in rollouts:
            reconciled, drifts = reconcile_turns(rollout.turns)
            sequences.append(reconciled)
            self.record("rollout/samples_per_rollout", len(reconciled))
            for drift in drifts:  # turn transitions only: absent for single-turn rollouts
                self.record("rollout/fork_frac", float(drift > 0))
                self.record("rollout/drift_tokens_mean", drift)
                self.record("rollout/drift_tokens_max", drift)
        return RolloutGroup(
            prompts=prompts, reward_kwargs=columns,
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=sequences,
            model_version=version, group_id=group_id, row_index=row_index,
            rollout_rewards=[r.reward for r in rollouts],
            position=position,
            truncated=[bool(r.turns) and r.turns[-1].finish_reason != "stop" for r in rollouts],
            env_rewards=env_rewards, rollouts=rollouts,
        )

    # ------------------------------------------------------------ scoring

    async def _score(self) -> None:
        while True:
            group = await self.score_queue.get()
            try:
                self.record("rollout/score_queue_size", self.score_queue.qsize())
                self.record("rollout/score_wait_s", time.monotonic() - group.queued_at)
                started = time.monotonic()
                await self._reward(group)
                self.record("rollout/score_s", time.monotonic() - started)
                self._emit(group)
            finally:
                self.in_flight_groups -= 1  # generated and scored: its samples are queued
                self.score_queue.task_done()

    async def _call_reward(self, func, group: RolloutGroup) -> list:
        kwargs = dict(prompts=group.prompts, completions=group.completions,
                      completion_ids=group.completions_ids, **group.reward_kwargs)
        name, limit = reward_name(func), self.config.reward_timeout
        try:
            values = await run_in_pool(func, self.reward_pool, limit, kwargs)
        except TimeoutError as error:
            raise RuntimeError(f"reward function {name!r} took more than reward_timeout="
                               f"{limit:g} s to score one group: it is hung, or raise "
                               "reward_timeout if it is only slow") from error
        except Exception as error:
            raise RuntimeError(f"reward function {name!r} raised {type(error).__name__}: "
                               f"{error}") from error
        if len(values) != len(group.completions):
            raise RuntimeError(f"reward function {name!r} returned {len(values)} rewards for "
                               f"{len(group.completions)} completions")
        return [math.nan if v is None else float(v) for v in values]

    async def _reward(self, group: RolloutGroup) -> None:
        results = await asyncio.gather(*[self._call_reward(f, group) for f in self.reward_funcs])
        group.reward_by_func = {reward_name(f): r for f, r in zip(self.reward_funcs, results)}
        environments = []  # an environment's get_reward: one more source, named by its class
        for kind in dict.fromkeys(e[0] for e in group.env_rewards if e is not None):
            environments.append([
                float(e[1]) if e is not None and e[0] is kind and e[1] is not None else math.nan
                for e in group.env_rewards])
            group.reward_by_func[kind.__name__] = environments[-1]
        # every source counts, also two functions of one name (the metrics keep the last)
        columns = list(results) + environments + [
            [math.nan if v is None else v for v in group.rollout_rewards]]
        table = np.array(columns, dtype=np.float64)  # sources x rollouts
        scored = ~np.isnan(table)
        totals = np.where(scored, table, 0.0).sum(0)
        group.rewards = np.where(scored.any(0), totals, np.nan)

    @staticmethod
    def content_records(group: RolloutGroup, dropped: bool, has_tools: bool = False) -> list:
        """The group's lengths, rewards and tool calls, as records that travel with its
        GroupResult (tool metrics only when the run has tools)."""
        records = []

        def add(name: str, value: float) -> None:
            records.append(("value", name, float(value)))

        for i, ids in enumerate(group.completions_ids):
            for stat in ("mean", "min", "max"):
                add(f"completions/{stat}_length", len(ids))
                if not group.truncated[i]:
                    add(f"completions/{stat}_terminated_length", len(ids))
            add("completions/clipped_ratio", float(group.truncated[i]))
            add("completions/duplicate_frac", float(ids in group.completions_ids[:i]))
            if not math.isnan(group.rewards[i]):
                add("reward", group.rewards[i])
                if dropped:
                    add("reward_dropped", group.rewards[i])
        add("frac_reward_zero_std", float(dropped))
        for rollout in group.rollouts if has_tools else ():
            calls, failures = rollout.tool_call_count, rollout.tool_failure_count
            add("tools/call_frequency", calls)
            add("tools/loop_exhausted_frac", float(rollout.loop_exhausted))
            # a mean over calls (the public counters: a custom generate_one sets only those);
            # NaN: a window without a call has no failure rate
            for i in range(calls) if calls else [None]:
                add("tools/failure_frequency", math.nan if i is None else float(i < failures))
            add("tools/unknown_name_count", sum(call.unknown for call in rollout.tool_calls))
            for call in rollout.tool_calls:
                if not call.unknown:
                    add(f"tools/{call.name}/call_count", 1)
                    add(f"tools/{call.name}/failure_count", float(call.failed))
            for calls in rollout.tool_batches:
                add("tools/parallel_calls_mean", calls)
        return records

    def _emit(self, group: RolloutGroup) -> None:
        """Queue the group's samples (or, without signal, a zero_std marker)."""
        rewards = group.rewards
        advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
        dropped = group_is_dropped(rewards)
        records = self.content_records(group, dropped, self.has_tools)
        if dropped:
            self._put(GroupResult(group.position, [], "zero_std", records))
            return
        scored = rewards[~np.isnan(rewards)]
        group_std = float(scored.std(ddof=1))
        std_by = {n: float(np.nanstd(np.array(v, dtype=float), ddof=1))
                  if np.sum(~np.isnan(np.array(v, dtype=float))) >= 2 else 0.0
                  for n, v in group.reward_by_func.items()}
        samples = []
        for i, sequences in enumerate(group.completions_sequences):
            for sequence in sequences:
                samples.append(Sample(
                    sequence=sequence, advantage=float(advantages[i]), reward=float(rewards[i]),
                    rewards_by_func={n: v[i] for n, v in group.reward_by_func.items()},
                    group_std=group_std, group_std_by_func=std_by,
                    model_version=group.model_version, group_id=group.group_id,
                    position=group.position, group_samples=0, tokens=len(sequence.input_ids),
                    queued_at=time.time(), rollout_id=group.rollouts[i].rollout_id,
                    completion_text=group.completions[i][-1]["content"]))
        for sample in samples:
            sample.group_samples = len(samples)
        with self.queued_tokens.get_lock():
            self.queued_tokens.value += sum(s.tokens for s in samples)
        with self.queued_samples.get_lock():
            self.queued_samples.value += len(samples)
        self._put(GroupResult(group.position, samples, records=records))


def run_rollout_loop(inbox, shared: dict, parent_pid: int | None = None,
                     started=None) -> None:
    """Entry point of the spawned worker process (CPU only, its own event loop); `started`
    (an event) is set first thing, so the trainer can tell a failed spawn apart. The loop's
    class and arguments then arrive pickled through `inbox` (a pipe's read end:
    `WorkerHandle.start`) in two parts: the loop's class and the arguments the trainer has
    at once (read while the trainer starts the server), then those that name the server
    and the policy (`config`, `lora_name`, `sampling_mask`); `shared` adds the queues,
    events and values only a spawn may pass."""
    if started is not None:
        started.set()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if parent_pid is not None:
        armed = die_with_parent(signal.SIGKILL)  # killed with the trainer, whatever it runs
        if armed and os.getppid() != parent_pid:  # the trainer died before prctl took effect
            return
    import torch

    torch.set_num_threads(1)
    # The worker exits only when the trainer stops it or it fails; either way the trainer
    # reads no more samples or records, so do not block the exit flushing them into a full
    # pipe (the traceback queue is left alone: the trainer reads it).
    shared["rollout_buffer"].cancel_join_thread()
    shared["metrics_queue"].cancel_join_thread()
    try:
        with inbox:
            loop_cls, kwargs = pickle.loads(inbox.recv_bytes())
            try:
                last = inbox.recv_bytes()
            except EOFError:  # the trainer stopped before its server served: nothing to do
                return
        kwargs.update(pickle.loads(last))
        loop = loop_cls(**kwargs, **shared)
        asyncio.run(loop.run())
    except BaseException:
        shared["exception_info_queue"].put(traceback.format_exc())
        shared["failed_event"].set()
        raise


def drain(q, limit: int = 10_000) -> list:
    items = []
    try:
        while len(items) < limit:
            items.append(q.get_nowait())
    except queue.Empty:
        pass
    return items


__all__ = ["AsyncRolloutLoop", "GroupResult", "Rollout", "RolloutGroup", "Sample",
           "TrainingSequence", "TurnRecord", "run_rollout_loop"]
