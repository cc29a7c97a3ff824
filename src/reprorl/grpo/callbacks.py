"""Callbacks as transformers' Trainer calls them, and the logging integrations built on them.

The trainer keeps a `TrainerState` and a `TrainerControl` and calls its `TrainerCallback`s
through transformers' own `CallbackHandler`: first `DefaultFlowCallback` (should_log every
`logging_steps`, and at step 1 with `logging_first_step`; should_save every `save_steps`;
should_training_stop and should_save at `max_steps`), then one callback per `report_to`
integration (transformers' `TensorBoardCallback`, `TrackioCallback`, `WandbCallback`, ...),
then the caller's. `trainer.py` calls them on rank 0 at the Trainer's points and does what the
control asks once they have all answered. The trainer's own progress bar and console lines
stand in for `ProgressCallback` and `PrinterCallback`.
"""

from __future__ import annotations

import math

from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

REPORT_NONE = ("none", None)


def report_names(report_to) -> list[str]:
    """`report_to` as TrainingArguments reads it: "none" (or None, or []) none, "all" every
    integration installed, a name or a list of names; an unknown name is refused by
    transformers with the list it knows."""
    from transformers.integrations import get_available_reporting_integrations

    if report_to in REPORT_NONE or report_to in (["none"], []):
        return []
    if report_to in ("all", ["all"]):
        return get_available_reporting_integrations()
    return list(report_to) if isinstance(report_to, (list, tuple)) else [report_to]


def integration_callbacks(args) -> list:
    """One callback per integration of `args.report_to`, each refusing, when built, a library
    that is not installed (`pip install tensorboard`, `trackio`, `wandb`)."""
    from transformers.integrations import get_reporting_integration_callbacks
    from transformers.integrations.integration_utils import TensorBoardCallback

    callbacks = []
    for cls in get_reporting_integration_callbacks(report_names(args.report_to)):
        callback = cls()
        if isinstance(callback, TensorBoardCallback) and args.logging_dir is not None:
            callback.logging_dir = str(args.logging_dir)  # transformers 4's field
        callbacks.append(callback)
    return callbacks


def handler(args, callbacks, model, processing_class) -> CallbackHandler:
    """DefaultFlowCallback, the integrations, then `callbacks` (classes or instances)."""
    return CallbackHandler([DefaultFlowCallback, *integration_callbacks(args),
                            *(callbacks or [])], model, processing_class, None, None)


def planned_steps(args, rows: int | None) -> int:
    """The run's optimizer steps as `TrainerState.max_steps`: `max_steps`, or on a fixed
    schedule one per block of `groups_per_step` prompts; free-running, the steps of an epoch
    are not known in advance, and this is a bound no run reaches (one step per sample)."""
    if args.max_steps > 0:
        return args.max_steps
    positions = math.ceil(args.num_train_epochs * rows)
    if args.schedule_lag is not None:
        return math.ceil(positions / args.groups_per_step)
    return positions * args.num_generations


def new_state(args, max_steps: int, main: bool) -> TrainerState:
    """The state callbacks read: the schedule's steps (`steps_of`: fractions resolved)."""
    save_steps = args.steps_of("save_steps") if args.save_strategy == "steps" else 0
    return TrainerState(
        max_steps=max_steps, logging_steps=args.steps_of("logging_steps"),
        save_steps=save_steps, num_train_epochs=args.num_train_epochs,
        train_batch_size=args.per_device_train_batch_size, log_history=[],
        is_local_process_zero=main, is_world_process_zero=main)


def new_control() -> TrainerControl:
    return TrainerControl()
