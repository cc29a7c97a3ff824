"""What a rollout produces and what reaches the trainer, as plain data.

The worker (`worker.py`) records each sampling request as a `TurnRecord`; a finished
`Rollout` holds a completion's turns; `reconcile_turns` turns them into `TrainingSequence`s
(context plus trained tokens, each with what the sampler saw), a new sequence wherever a turn's
prompt does not extend the one before (a multi-turn fork). A prompt's `num_generations`
rollouts are scored together as a `RolloutGroup`, and each trained sequence reaches the trainer
as a `Sample` carrying its group's advantage, inside a `GroupResult`: one queue item per
position, with samples or the reason it has none.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .agents import ToolCall


@dataclass
class TurnRecord:
    """One sampling request: the prompt sent and the tokens the sampler produced."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None  # 1 = train on the token (None: all)
    # per token, the ids it was drawn from under top-k/top-p/min-p (None: the vocabulary)
    output_sampling_mask: list[list[int]] | None = None
    output_sampler_logprobs: list[dict[int, float]] | None = None  # sampler top tokens
    finish_reason: str = "stop"  # "stop" (EOS or stop token) or "length"


@dataclass
class Rollout:
    """A finished rollout, as `generate_one` returns it: the completion's messages (assistant
    and tool), every generated token in order, and the sampling requests that made them."""

    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tool_calls: list[ToolCall] = field(default_factory=list)  # ours: for the tools/ metrics
    tool_batches: list[int] = field(default_factory=list)  # calls per tool-calling turn
    loop_exhausted: bool = False  # stopped by max_tool_calling_iterations while calling


@dataclass
class TrainingSequence:
    """Tokens of one sample: context plus trained tokens, each with what the sampler saw."""

    input_ids: list[int]
    trained: list[int]  # 1 where the token is trained
    sampler_logprobs: list[float]  # per token; 0.0 for context
    sampler_top: list[dict[int, float] | None]  # per token; None for context
    sampling_mask: list[list[int] | None] = field(default_factory=list)  # per token; None:
    # the whole vocabulary (context, or a sampler without truncation)


@dataclass
class RolloutGroup:
    """The `num_generations` rollouts of one prompt, scored together."""

    prompts: list[list[dict[str, Any]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, Any]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    model_version: int
    group_id: int
    row_index: int
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None
    position: int = 0  # epoch * rows + index in the epoch order: the resume cursor's unit
    truncated: list[bool] = field(default_factory=list)
    reward_by_func: dict[str, list[float]] = field(default_factory=dict)
    env_rewards: list[tuple[type, float] | None] = field(default_factory=list)  # class, value
    rollouts: list[Rollout] = field(default_factory=list)

    @property
    def tool_call_counts(self) -> list[int]:
        return [r.tool_call_count for r in self.rollouts]

    @property
    def tool_failure_counts(self) -> list[int]:
        return [r.tool_failure_count for r in self.rollouts]


@dataclass
class Sample:
    """What the trainer consumes: one training sequence with its advantage."""

    sequence: TrainingSequence
    advantage: float
    reward: float
    rewards_by_func: dict[str, float]
    group_std: float
    group_std_by_func: dict[str, float]
    model_version: int
    group_id: int
    position: int
    group_samples: int  # samples this position produced in all
    tokens: int
    queued_at: float
    rollout_id: str
    completion_text: str


@dataclass
class GroupResult:
    """One queue item: a position's samples, or why it produced none, and the metric records
    of its content (rewards, lengths). Those travel with the group, not on the metrics queue,
    so the trainer enters them when it consumes the position: a fixed schedule's windows then
    hold the same values whatever the timing."""

    position: int
    samples: list[Sample]
    reason: str = "trained"  # or "filtered", "zero_std"
    records: list = field(default_factory=list)  # ("value", name, v), as MetricsWindow.merge


def reconcile_turns(turns: list[TurnRecord]) -> tuple[list[TrainingSequence], list[int]]:
    """Turns -> sequences, and the drift of each turn transition.

    A turn whose prompt extends the running sequence continues it (the added prompt tokens are
    context; drift 0); any other turn forks a new sequence, and its drift is the number of
    retained tokens after the point where its prompt diverges (what the fork re-renders).
    """
    sequences: list[TrainingSequence] = []
    drifts: list[int] = []
    current = None
    for turn in turns:
        n = len(turn.output_ids)
        mask = turn.output_mask if turn.output_mask is not None else [1] * n
        top = turn.output_sampler_logprobs or [None] * n
        candidates = turn.output_sampling_mask or [None] * n
        if current is not None and turn.prompt_ids[: len(current.input_ids)] == current.input_ids:
            extra = turn.prompt_ids[len(current.input_ids):]
            drifts.append(0)
        else:
            if current is not None:
                shared = 0
                for a, b in zip(turn.prompt_ids, current.input_ids):
                    if a != b:
                        break
                    shared += 1
                drifts.append(len(current.input_ids) - shared)
            current = TrainingSequence([], [], [], [], [])
            sequences.append(current)
            extra = list(turn.prompt_ids)
        current.input_ids += extra + list(turn.output_ids)
        current.trained += [0] * len(extra) + list(mask)
        current.sampler_logprobs += [0.0] * len(extra) + list(turn.output_log_probs)
        current.sampler_top += [None] * len(extra) + list(top)
        current.sampling_mask += [None] * len(extra) + list(candidates)
    return [s for s in sequences if any(s.trained)], drifts
