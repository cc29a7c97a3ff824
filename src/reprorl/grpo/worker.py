"""The rollout worker's process and asyncio loop, under the hooks of `AsyncRolloutLoop`.

`run_rollout_loop` is the spawned process's entry: it builds the trainer's `loop_cls` and runs
it. `RolloutLoopBase.run` opens the server's client and the thread pools and runs four tasks
until the trainer stops it or one fails: `_produce` walks the prompt positions and starts a
group when `FlowControl` (`flow.py`) lets it; a group (`_group`) runs its `num_generations`
rollouts concurrently (`_one`: in an environment when there are some) and queues them for
`_score`, which scores groups one at a time (`scoring.py`) and puts their samples on the
trainer's queue; the other two are the heartbeat and the server-load poll.

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

from reprorl.core import numerics
from reprorl.core.preempt import ignore_job_signals
from reprorl.model.grpo_losses import group_is_dropped
from reprorl.serve.client import CompletionClient

from .agents import (
    EnvironmentPool,
    environment_factories,
    environment_tools,
    observe,
    run_in_pool,
)
from .flow import FlowControl
from .processes import die_with_parent
from .rows import epoch_length, map_positions
from .samples import GroupResult, RolloutGroup
from .scoring import assemble_group, content_records, group_samples, score_rewards
from .weight_sync import served_name

_MODEL = contextvars.ContextVar("served_model_name")  # the adapter a group started under
_ROLLOUT = contextvars.ContextVar("rollout")  # [rollout key, requests so far]: request seeds


def request_seed(seed: int, rollout_key: int | None, request: int) -> int:
    """The sampling seed of a rollout's n-th request: a function of where the rollout sits in
    the run, never of a counter, so a resumed run does not repeat the seeds of its start
    (`rollout_key=None`: a request made outside a rollout, numbered by the loop)."""
    words = [seed % 2**32, 0, request] if rollout_key is None else [
        seed % 2**32, 1, rollout_key, request]
    return int(np.random.SeedSequence(words).generate_state(1)[0] % (2**31 - 1))


class RolloutLoopBase:
    """The loop the worker process runs; subclass `AsyncRolloutLoop` (`rollout.py`), which
    defines the hooks this class calls: `filter_prompt` per prompt position, `generate_one`
    per rollout, `compute_advantages` per scored group, `setup` and `close` around the run.
    Hooks may call `record`, `record_rate`, `served_name` and `stopping`. The constructor
    takes the trainer's arguments (`AsyncGRPOTrainer`, `WorkerSignals.worker_kwargs`)."""

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
        self.heartbeat = heartbeat_value
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
        self.records: list[tuple] = []
        self.last_rate_time = time.monotonic()
        # admission of groups (schedule, allowance, server-load cap) and the counts it reads
        self.flow = FlowControl(config, model_version_value, token_allowance, queued_tokens,
                                position_limit, self.stopping, self.record)

    # ------------------------------------------------------------ for the hooks too

    def record(self, name: str, value: float) -> None:
        self.records.append(("value", name, float(value)))

    def record_rate(self, name: str, amount: float, seconds: float) -> None:
        self.records.append(("rate", name, (float(amount), float(seconds))))

    def served_name(self, version: int | None = None) -> str:
        if self.lora_name is None:
            return self.model_name
        return served_name(self.lora_name,
                           self.model_version.value if version is None else version)

    def stopping(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    # a method too: `_emit` calls it through self, so a subclass may add records of its own
    content_records = staticmethod(content_records)

    def _next_seed(self) -> int:
        """The seed of the next sampling request: numbered within the rollout that makes it
        (`_one` set the task's context), else by the loop (a request a custom hook makes
        outside a rollout)."""
        rollout = _ROLLOUT.get(None)
        if rollout is None:  # called outside a rollout (a custom hook): a running count
            self.request_number += 1
            return request_seed(self.config.seed, None, self.request_number)
        rollout[1] += 1
        return request_seed(self.config.seed, rollout[0], rollout[1])

    def _group_model(self) -> str:
        """The served name the current group samples under (`_group` set the context)."""
        return _MODEL.get(self.model_name)

    # ------------------------------------------------------------ the loop

    def flush_records(self) -> None:
        if self.records:
            self.metrics_queue.put(self.records)
            self.records = []

    def _put(self, result: GroupResult) -> None:
        self.rollout_buffer.put(result)

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
            await self.flow.initial_cap(self.client)
            self.crashed = asyncio.get_running_loop().create_future()  # a group task's error
            tasks = [asyncio.create_task(c) for c in (
                self._produce(), self._score(), self._beat(),
                self.flow.poll_metrics(self.client))]
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

    async def _beat(self) -> None:
        while not self.stopping():
            self.heartbeat.value = time.time()
            self.flush_records()
            await asyncio.sleep(0.5)

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
                await self.flow.wait_for_room(position)
                if self.stopping():
                    break
                self.flow.in_flight_groups += 1
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
            group = assemble_group(outcomes, row, row_index, group_id, version, position,
                                   self.record)
            tokens = sum(len(s.input_ids) for seqs in group.completions_sequences for s in seqs)
            self.flow.tokens_per_group.append(tokens)
            self.record("rollout/group_duration_s", time.monotonic() - started)
            put_started = time.monotonic()
            group.queued_at = time.monotonic()
            await self.score_queue.put(group)
            self.record("rollout/score_block_s", time.monotonic() - put_started)
        except Exception as error:  # noqa: BLE001 (no one awaits this task: run() re-raises)
            self.flow.in_flight_groups -= 1  # a scored group leaves the count in _score
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
        self.flow.in_flight_rollouts += 1
        self.record("rollout/concurrency", self.flow.in_flight_rollouts)
        self.record("rollout/concurrency_cap", self.flow.cap)
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
            self.flow.in_flight_rollouts -= 1
            self.flow.finished_since_raise += 1
        self.record("rollout/duration_s", time.monotonic() - started)
        generated = sum(len(t.output_ids) for t in rollout.turns)
        now = time.monotonic()
        self.record_rate("rollout/generated_tokens_per_s", generated, now - self.last_rate_time)
        self.last_rate_time = now
        self.record("rollout/turns_mean", len(rollout.turns))
        self.record("rollout/turns_max", len(rollout.turns))
        return prompt, rollout, env_reward

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
                self.flow.in_flight_groups -= 1  # generated and scored: its samples are queued
                self.score_queue.task_done()

    async def _reward(self, group: RolloutGroup) -> None:
        await score_rewards(group, self.reward_funcs, self.reward_pool,
                            self.config.reward_timeout)

    def _emit(self, group: RolloutGroup) -> None:
        """Queue the group's samples (or, without signal, a zero_std marker)."""
        rewards = group.rewards
        advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
        dropped = group_is_dropped(rewards)
        records = self.content_records(group, dropped, self.has_tools)
        if dropped:
            self._put(GroupResult(group.position, [], "zero_std", records))
            return
        samples = group_samples(group, rewards, advantages)
        # the token allowance counts what waits on the trainer's queue
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
    ignore_job_signals()  # the trainer stops this process, after its own checkpoint
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
        numerics.check()  # the trainer's kernel pins reached this process
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
