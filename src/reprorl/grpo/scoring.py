"""A finished group of rollouts, from its rollouts to its samples: assembly, rewards, records.

`assemble_group` reconciles each rollout's turns into training sequences and builds the
`RolloutGroup` the hooks see; `score_rewards` sums every reward source (the reward functions,
an environment's get_reward(), `Rollout.reward`) into `group.rewards`; `group_samples` turns a
scored group and its advantages into `Sample`s; `content_records` gives the group's lengths,
rewards and tool calls as metrics records. The worker (`worker.py`) calls them in that order.
"""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np

from .agents import run_in_pool
from .samples import RolloutGroup, Sample, reconcile_turns


def reward_name(func) -> str:
    """Metric name of a reward function (a partial is named after what it wraps)."""
    func = getattr(func, "func", func)
    return getattr(func, "__name__", None) or type(func).__name__


def assemble_group(outcomes, row, row_index, group_id, version, position,
                   record) -> RolloutGroup:
    """The group of a row's rollouts (`outcomes`: per rollout, the prompt it started from, the
    rollout and its environment's reward), each rollout's turns reconciled into samples;
    `record` takes the reconciliation's metrics."""
    prompts, rollouts, env_rewards = (list(part) for part in zip(*outcomes))
    columns = {k: [v] * len(rollouts) for k, v in row.items() if k != "prompt"}
    sequences = []
    for rollout in rollouts:
        reconciled, drifts = reconcile_turns(rollout.turns)
        sequences.append(reconciled)
        record("rollout/samples_per_rollout", len(reconciled))
        for drift in drifts:  # turn transitions only: absent for single-turn rollouts
            record("rollout/fork_frac", float(drift > 0))
            record("rollout/drift_tokens_mean", drift)
            record("rollout/drift_tokens_max", drift)
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


async def call_reward(func, group: RolloutGroup, pool, limit: float) -> list:
    """One reward function's scores of the group, run in `pool` within `limit` seconds."""
    kwargs = dict(prompts=group.prompts, completions=group.completions,
                  completion_ids=group.completions_ids, **group.reward_kwargs)
    name = reward_name(func)
    try:
        values = await run_in_pool(func, pool, limit, kwargs)
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


async def score_rewards(group: RolloutGroup, reward_funcs: list, pool, limit: float) -> None:
    """Set `group.reward_by_func` and `group.rewards`: the reward functions run concurrently;
    a rollout's reward is the sum of the sources that scored it (NaN: none did)."""
    results = await asyncio.gather(*[call_reward(f, group, pool, limit) for f in reward_funcs])
    group.reward_by_func = {reward_name(f): r for f, r in zip(reward_funcs, results)}
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


def group_samples(group: RolloutGroup, rewards: np.ndarray,
                  advantages: np.ndarray) -> list[Sample]:
    """The samples of a scored group that has signal: each rollout's sequences, with its
    reward and advantage and the group's reward spreads (`rewards`: `group.rewards` as they
    were before `compute_advantages` ran, which may set others)."""
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
    return samples


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
