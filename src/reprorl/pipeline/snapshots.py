"""Where a straight training run keeps its actor for the over-optimisation curves.

The `continuous` run of PPO and of each GRPO run writes its actor's adapters (PEFT format) after
each quarter of its iterations or optimizer steps, points fixed before it starts; `curves.py`
measures them. Kept apart from the measurement so that editing it re-runs no training.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from reprorl.core.layout import numbered
from reprorl.core.manifest import write_json
from reprorl.model import lora
from reprorl.model.roles import LORA_ALPHA, LORA_RANK

QUARTERS = 4
PLAN = "plan.json"  # beside the snapshots: the run's planned length and its points
SNAPSHOT_PREFIX = "step-"  # then the step, 4 digits at least


def every(total: int) -> int:
    """Iterations or steps between two kept actors: a quarter of `total`, rounded up."""
    return max(1, math.ceil(total / QUARTERS))


def points(total: int) -> list[int]:
    """Where a straight run of `total` iterations or steps keeps its actor: each quarter
    (rounded up to whole steps) and the end."""
    return sorted({*range(every(total), total, every(total)), total})


def snapshot_name(step: int) -> str:
    return f"{SNAPSHOT_PREFIX}{step:04d}"


def step_of(snapshot: Path) -> int:
    return int(snapshot.name.removeprefix(SNAPSHOT_PREFIX))


def found(folder: Path) -> list[Path]:
    """The snapshots kept in `folder`, in step order."""
    return numbered(folder, SNAPSHOT_PREFIX)


def keep(model, folder: Path, step: int, base_path: str) -> None:
    """The model's adapters as they are now (after iteration or step `step`), in PEFT format,
    into a straight run's scratch snapshot folder (replacing the same step's from a killed
    attempt of the same job, which a rerun writes again from its last checkpoint)."""
    shutil.rmtree(folder / snapshot_name(step), ignore_errors=True)
    lora.export_peft(model, folder / snapshot_name(step), base_path, LORA_RANK, LORA_ALPHA)


def write_plan(folder: Path, total: int) -> None:
    """The planned length beside the snapshots: a run that ends early (a GRPO run whose blocks
    all come back empty) keeps fewer points, each still a fraction of the plan."""
    write_json(folder / PLAN, {"planned": total, "points": points(total)})
