"""The state of one `train()` call, `TrainingRun`, and where it starts (`new_run`).

A run starts fresh or from a checkpoint of the same run (refused otherwise, before any process
starts or any file is written): its optimizer, counters, resume cursor and weight version come
back from there. `position_limit` is the first prompt position no step of the call can train,
which bounds the worker under a fixed schedule.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoints, optimizers
from .batching import TokenBudgetBatcher
from .distributed import Ranks
from .identity import refuse_other_run, run_identity
from .launch import WorkerLink
from .ledger import PositionLedger
from .metrics import MetricsLog, MetricsWindow, metrics_file
from .sample_queue import SampleQueue
from .weight_sync import AdapterVersions, MergedVersions


@dataclass
class TrainingRun:
    """The state of one `train()` call. The fields up to `window` exist before any process
    starts (a resume restores them from the checkpoint); the rest as the worker is spawned
    (`link`: what it shares with the trainer, `samples`: its queue's trainer end) and the
    server serves (`weights`, `batcher`)."""

    optimizer: torch.optim.Optimizer
    identity: dict  # what a checkpoint shares with the run that resumes it
    ledger: PositionLedger
    version: Any  # shared .value: the newest published weight version (the trainer writes)
    metrics_log: MetricsLog
    checkpoint: Path | None = None  # the one this run resumed from
    global_step: int = 0
    num_tokens: int = 0  # real (unpadded) tokens trained on so far
    loss_sum: float = 0.0
    interrupt_after_step: int | None = None  # train(interrupt_after_step=...)
    saved: tuple[int, int] | None = None  # (step, version) of the last checkpoint written
    window: MetricsWindow = field(default_factory=MetricsWindow)  # since the last log line
    weights: AdapterVersions | MergedVersions | None = None
    batcher: TokenBudgetBatcher | None = None
    link: WorkerLink | None = None  # the worker's allowance, position limit, metric records
    samples: SampleQueue | None = None


def new_run(model, args, rows, ranks: Ranks, sources: dict, output_dir: Path,
            resume_from_checkpoint, log) -> TrainingRun:
    """The run's bookkeeping for `model` (its trained parameters), restored from a checkpoint
    under `output_dir` when resuming; `sources` (what scores and acts in a rollout, by name)
    is part of the run's identity. Only rank 0 writes metrics and logs the resume."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizers.build(parameters, args)
    identity = run_identity(args, rows, ranks.world_size, sources)  # the rows stay
    end = math.ceil(args.num_train_epochs * len(rows)) if args.max_steps <= 0 else None
    # (a stream has max_steps: rows.as_rows)
    ledger, version, counters, checkpoint = PositionLedger(end=end), 0, {}, None
    # as TrainingArguments' seed does: torch's start-up RNG differs per process, and the
    # checkpoint keeps this one (a resume restores it below)
    torch.manual_seed(args.seed)
    if resume_from_checkpoint:
        checkpoint = (checkpoints.latest(output_dir) if resume_from_checkpoint is True
                      else Path(resume_from_checkpoint))
        state = checkpoints.rollout_state(checkpoint)
        refuse_other_run(checkpoint, state, identity, args)
        counters = checkpoints.restore(checkpoint, model, optimizer, args.use_peft)
        ledger, version = PositionLedger.from_state(state, end), state["model_version"]
    run = TrainingRun(optimizer, identity, ledger,
                      mp.get_context("spawn").RawValue("q", version),
                      MetricsLog(metrics_file(output_dir),
                                 resume=checkpoint is not None) if ranks.main else None,
                      checkpoint, **counters)
    if checkpoint is not None and ranks.main:
        run.saved = (run.global_step, version)
        log(f"resumed from {checkpoint}: step {run.global_step}, next prompt "
            f"{ledger.cursor}, version {version}")
    return run


def position_limit(args, version: int, global_step: int, interrupt: int | None) -> int:
    """The first position no step of this train() call can train, under a fixed schedule
    whose last step is known (max_steps, or `interrupt` after that step; each step trains the
    next block, an empty block publishes a version and trains none), from `version` and
    `global_step` now: the worker samples none from there on, so the last steps do not share
    the server with blocks nobody trains here (a resume samples them again, from its
    checkpoint). -1: no such bound (free-running, or epochs without an interrupt: the
    epochs' end bounds the worker)."""
    ends = [args.max_steps] if args.max_steps > 0 else []
    if interrupt is not None and interrupt > global_step:  # else it never fires
        ends.append(interrupt)
    if args.schedule_lag is None or not ends:
        return -1
    return (version + min(ends) - global_step) * args.groups_per_step
