"""The learning rate at each optimizer step, from transformers' schedulers as TRL's Trainer
builds them: `lr_scheduler_type`, `warmup_steps` (below 1, a fraction of `max_steps`),
`lr_scheduler_kwargs`.

The trainer sets each step's rate itself, `learning_rate` times the schedule's multiplier at
that step (`rate`): a pure function of the step, so a resume needs no scheduler state and the
optimizer's state dict holds no scheduler key. The multiplier is the one `get_scheduler` builds,
read off a scheduler made on a throwaway optimizer. Schedules that follow a metric
(reduce_lr_on_plateau, greedy) are refused: nothing is evaluated here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

# those that need the run's length: max_steps must be set (an epoch's steps are not known)
NEEDS_LENGTH = frozenset({"linear", "cosine", "cosine_with_restarts", "polynomial",
                          "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                          "warmup_stable_decay"})
FOLLOWS_A_METRIC = frozenset({"reduce_lr_on_plateau", "greedy"})


def warmup_steps(args) -> int:
    warmup = args.warmup_steps
    return math.ceil(warmup * args.max_steps) if 0 < warmup < 1 else int(warmup)


def multiplier(args) -> Callable[[int], float]:
    """The schedule's multiplier of `learning_rate` at each step (from 0)."""
    import torch
    from transformers import get_scheduler

    # at the run's rate: polynomial decay reads the optimizer's initial rate
    throwaway = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    scheduler = get_scheduler(
        args.lr_scheduler_type, throwaway, num_warmup_steps=warmup_steps(args),
        num_training_steps=args.max_steps if args.max_steps > 0 else None,
        scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs or {}))
    return scheduler.lr_lambdas[0]


def problems(args):
    """What the config's schedule asks that cannot be done, each a line."""
    from transformers.trainer_utils import SchedulerType

    name, known = args.lr_scheduler_type, [t.value for t in SchedulerType]
    if name not in known:
        yield f"lr_scheduler_type must be one of {known}, got {name!r}"
    elif name in FOLLOWS_A_METRIC:
        yield (f"lr_scheduler_type={name!r} is refused: it follows an evaluation metric, and "
               "nothing is evaluated here")
    elif name in NEEDS_LENGTH and args.max_steps <= 0:
        yield (f"lr_scheduler_type={name!r} needs max_steps > 0 (the steps of an epoch are not "
               "known in advance)")
    elif not isinstance(args.lr_scheduler_kwargs, (dict, type(None))):
        yield "lr_scheduler_kwargs must be a dict (or its JSON)"
    elif 0 < args.warmup_steps < 1 and args.max_steps <= 0:
        yield "warmup_steps below 1 is a fraction of max_steps: set max_steps > 0"
    else:
        try:
            multiplier(args)(0)
        except (TypeError, ValueError) as error:
            yield f"lr_scheduler_kwargs do not fit {name!r}: {error}"


def rate(args, schedule: Callable[[int], float], step: int) -> float:
    """The learning rate of optimizer step `step` (from 0)."""
    return args.learning_rate * schedule(step)
