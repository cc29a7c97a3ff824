"""A GRPO checkpoint, `<output_dir>/checkpoint-<step>/`, written whole or not at all:

    adapter/ (use_peft) or model/  the trained weights, as the server loads them
    versions/v<N>/                 a fixed schedule's older versions it still samples from
    trainer_state.pt               optimizer, torch (and CUDA) RNG, global_step, num_tokens,
                                   loss_sum
    rollout_state.json             the resume cursor, model_version, global_step and the run's
                                   identity (`identity.py`)

`save` writes one (and keeps the `save_total_limit` newest); a resume takes one (`latest`, or
the caller's), checks that it is this run's (`identity.refuse_other_run`, on `rollout_state`),
then `restore`s the policy, the optimizer and the RNG from it. The pipeline (`grpo_run.py`)
reads the same files through `trainer_state` and `rollout_state`.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch

from reprorl.core import devices
from reprorl.core.layout import numbered
from reprorl.core.manifest import atomic_directory, atomic_write_bytes, read_json, write_json
from reprorl.model import lora

from .ledger import PositionLedger
from .policy import load_full_into
from .weight_sync import version_folder

PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.pt"
ROLLOUT_STATE = "rollout_state.json"
# a fixed schedule's older versions, as `weight_sync.version_folder` lays them
VERSIONS = "versions"


def policy_folder(use_peft: bool) -> str:
    """The checkpoint's folder of the trained weights: a PEFT adapter, or full weights."""
    return "adapter" if use_peft else "model"


def directory(output_dir: Path, step: int) -> Path:
    return output_dir / f"{PREFIX}{step}"


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix(PREFIX))


def found(output_dir: Path) -> list[Path]:
    """The checkpoint folders under `output_dir`, oldest first; a name that is not
    checkpoint-<step> (a user's `checkpoint-3-old` copy) is not one."""
    return numbered(output_dir, PREFIX)


def latest(output_dir: Path) -> Path:
    """The newest checkpoint folder (`resume_from_checkpoint=True`)."""
    folders = found(output_dir)
    if not folders:
        raise FileNotFoundError(f"no {PREFIX}* in {output_dir} to resume from")
    return folders[-1]


def trainer_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / TRAINER_STATE, weights_only=True, map_location="cpu")


def rollout_state(checkpoint: Path) -> dict:
    return read_json(checkpoint / ROLLOUT_STATE)


def scheduled_versions(checkpoint: Path | None, schedule_lag: int | None, version: int
                       ) -> list[tuple[int, Path]]:
    """The versions before `version` that a fixed schedule still samples the next blocks
    from, as `checkpoint` stores them (`versions/v<N>`); none when free-running."""
    if not schedule_lag or checkpoint is None:
        return []
    return [(v, version_folder(checkpoint / VERSIONS, v))
            for v in range(max(0, version - schedule_lag), version)]


def cursor_state(ledger: PositionLedger, version: int, args) -> dict:
    """The ledger's part of `rollout_state.json`. A fixed schedule resumes at its next block,
    whose positions are all generated again (seeded, by the versions the checkpoint keeps):
    the state then never depends on which later groups happened to have arrived."""
    if args.schedule_lag is None:
        return ledger.state()
    start = version * args.groups_per_step
    return PositionLedger(start if ledger.end is None else min(start, ledger.end)).state()


def save(output_dir: Path, run, args, export_policy, lora_dir: Path, device) -> Path:
    """`run` (the trainer's `TrainingRun`) at its current step, as `checkpoint-<step>`;
    `export_policy(folder)` writes the trained weights, `lora_dir` holds the versions as
    served. Then only the `save_total_limit` newest checkpoints are kept."""
    version = run.version.value
    folder = directory(output_dir, run.global_step)
    with atomic_directory(folder) as scratch:
        export_policy(scratch / policy_folder(args.use_peft))
        for v, _ in scheduled_versions(folder, args.schedule_lag, version):
            shutil.copytree(version_folder(lora_dir, v), version_folder(scratch / VERSIONS, v))
        rng = {"torch_rng": torch.get_rng_state()}
        gpus = devices.cuda_rng_states(device)
        if gpus is not None:  # a run on a GPU
            rng["cuda_rng"] = gpus
        buffer = io.BytesIO()
        torch.save({"optimizer": run.optimizer.state_dict(),
                    "global_step": run.global_step, "num_tokens": run.num_tokens,
                    **rng, "loss_sum": run.loss_sum}, buffer)
        atomic_write_bytes(scratch / TRAINER_STATE, buffer.getvalue())
        write_json(scratch / ROLLOUT_STATE, {
            **cursor_state(run.ledger, version, args), "model_version": version,
            "global_step": run.global_step, **run.identity})
    if args.save_total_limit:
        for old in found(output_dir)[: -args.save_total_limit]:
            shutil.rmtree(old)
    return folder


def restore(checkpoint: Path, model, optimizer, use_peft: bool) -> dict:
    """Policy, optimizer and RNG from `checkpoint`; returns the run's counters."""
    load = lora.load_peft_into if use_peft else load_full_into
    load(model, checkpoint / policy_folder(use_peft))
    saved = trainer_state(checkpoint)
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    if "cuda_rng" in saved:  # a run on a GPU
        devices.restore_cuda_rng(saved["cuda_rng"])
    return {"global_step": saved["global_step"], "num_tokens": saved["num_tokens"],
            "loss_sum": saved["loss_sum"]}
