"""One optimizer step's tallies (`Step`) and the metrics the trainer records from them.

Rank 0 adds up a step over every rank as it trains it; `record_samples` enters the step's
samples in the metrics window as they leave the queue, `record_step` the step itself once it
is done (the window reduces them per logging interval: `metrics.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import MetricsWindow
from .samples import Sample


@dataclass
class Step:
    """One optimizer step's micro-batches, added up (over every rank) for the ledger and the
    metrics."""

    samples: list[Sample] = field(default_factory=list)
    loss: float = 0.0
    microbatches: int = 0
    slots: int = 0  # micro-batches per rank, the busiest's: the gradient is a mean over them
    forwarded_tokens: int = 0  # what the rows forwarded (padding included, if any)
    sample_tokens: int = 0  # what the samples held in the queue: sets the next allowance
    fwd_s: float = 0.0
    fwd_bwd_s: float = 0.0
    wait_s: float = 0.0  # waiting for the worker
    grad_norm: float = 0.0
    learning_rate: float = 0.0
    optimizer_s: float = 0.0
    sync_s: float | None = None  # None: no weight sync after this step


def record_samples(w: MetricsWindow, samples: list[Sample], version: int,
                   taken_at: float) -> None:
    """`samples`, taken off the queue at `taken_at` while `version` was the newest."""
    for s in samples:
        staleness = version - s.model_version
        w.add("sample/staleness_mean", staleness)
        w.add("sample/staleness_max", staleness)
        w.add("sample/time_in_queue_s", taken_at - s.queued_at)
        w.add("sample/forwarded_tokens_mean", s.tokens)
        w.add("sample/forwarded_tokens_max", s.tokens)
        w.add("sample/trained_tokens_mean", sum(s.sequence.trained))
        w.add("reward_kept", s.reward)
        w.add("reward_group_std", s.group_std)
        for name, value in s.rewards_by_func.items():
            w.add(f"rewards/{name}/mean", value)
            w.add(f"rewards/{name}/group_std", s.group_std_by_func[name])


def record_step(w: MetricsWindow, step: Step, step_s: float) -> None:
    """`step`, `step_s` seconds from its first wait for samples through its weight sync."""
    trained_tokens = sum(sum(s.sequence.trained) for s in step.samples)
    for name, value in (
            ("loss", step.loss), ("grad_norm", step.grad_norm),
            ("learning_rate", step.learning_rate),
            ("batch/forwarded_tokens_per_step", step.forwarded_tokens),
            ("batch/trained_tokens_per_step", trained_tokens),
            ("batch/samples_per_step", len(step.samples)),
            ("batch/groups_per_step", len({s.position for s in step.samples})),
            ("batch/microbatches_per_step", step.microbatches),
            ("perf/step_s", step_s), ("perf/fwd_bwd_s", step.fwd_bwd_s),
            ("perf/fwd_s", step.fwd_s), ("perf/optimizer_s", step.optimizer_s),
            ("perf/rollout_wait_s", step.wait_s)):
        w.add(name, value)
    if step.sync_s is not None:
        w.add("perf/weight_sync_s", step.sync_s)
    w.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", step.forwarded_tokens, step.fwd_bwd_s)
    w.add_rate("perf/wall_clock_forwarded_tokens_per_s", step.forwarded_tokens, step_s)
    w.add_rate("perf/wall_clock_trained_tokens_per_s", trained_tokens, step_s)
