"""The resumable training branches: one runner for their three modes, one resume state.

A training branch (SFT, the reward model, PPO, each GRPO run) runs in three modes, one rule
each (`Branch` says what each mode does): `interrupt` stops at the branch's interrupt point and
saves its state, `resume` continues from that state in a fresh process and exports the
branch's final roles, `continuous` runs straight through. What makes `resume` end exactly where
`continuous` does is that the state holds everything the rest of the run depends on (a GRPO
run's state holds its trainer's checkpoint instead, `grpo_run.py`); for the others:
- `identity`: config, data, base model, code and initial tensors; a resume under another
  identity stops and names the first difference;
- `learned`: every role's adapters and heads (frozen roles too, to prove they stayed frozen);
- `optimizers`, `generators` (data order, sampling) and `rng` (python, numpy, torch);
- `updates` and `scheduler`: the schedule position, checked against this run's schedule;
- `progress`: the loop's own position and history (epoch, prompt cursor, consumed ids, ...).
`ResumableRun` restores them in that order and, at the end, checks that every frozen base and
every role without an optimiser is unchanged and every trained role moved, then saves. The
in-rule checkpoints a killed job continues from (`core/preempt.py`) are the same states, built
and restored by the same code. The `<branch>_resume_check` stages compare two final states bit
for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from reprorl.core import layout
from reprorl.core.errors import ReproError
from reprorl.core.manifest import refuse_to_overwrite, sha256_file, write_json
from reprorl.core.preempt import Checkpoints
from reprorl.core.stages import CURVES, exporting_mode
from reprorl.core.state import first_difference, load_state, restore_rng, rng_state, save_state
from reprorl.model.roles import (
    Role,
    frozen_identity,
    learned_identity,
    learned_state,
    load_learned,
)

from .exports import save_final


class Branch(NamedTuple):
    """One run of a training branch (`stages.EXPORTS`' names) in one of `stages.MODES`."""

    name: str
    mode: str

    @property
    def resumes(self) -> bool:
        return self.mode == "resume"

    @property
    def keeps_snapshots(self) -> bool:
        """A straight run keeps its actor at the curve's points (`snapshots.py`)."""
        return self.mode == "continuous" and self.name in CURVES

    def stop(self, interrupt_at: int, end: int) -> int:
        """Where this run stops: the interrupt point, or the end."""
        return interrupt_at if self.mode == "interrupt" else end

    def refuse_to_overwrite(self) -> None:
        """A state already written is preserved: move it away to run this mode again."""
        refuse_to_overwrite(layout.state(*self))

    def interrupt_state(self, identity: dict) -> dict:
        """The branch's interrupt state, which a resume continues from, refused (naming the
        first difference) unless it was written under `identity`."""
        state = load_state(layout.state(self.name, "interrupt"))
        difference = first_difference(state["identity"], identity, "identity")
        if difference:
            raise ReproError(f"the interrupt state cannot be resumed by this run ({difference});"
                             f" rerun {self.name}_interrupt with the same config, data and code")
        return state

    def checkpoints(self, identity: dict, every: int | str | None) -> Checkpoints:
        """This run's in-rule checkpoints (`core/preempt.py`), keyed by `identity` and, for a
        resume, by the interrupt state it starts from."""
        start = layout.state(self.name, "interrupt")
        return Checkpoints(f"{self.name}_{self.mode}", identity, every,
                           {"interrupt_state": sha256_file(start)}
                           if self.resumes and start.exists() else None)

    def save(self, state: dict) -> dict:
        """This run's final state, written whole; returns its storage record."""
        return save_state(layout.state(*self), state)

    def report(self, report: dict) -> None:
        """This run's learning report (its costs go to the manifest, not here)."""
        write_json(layout.learning_report(*self), report)

    def export(self, identity: dict, config: dict, roles: dict[str, Role]) -> None:
        """At the end of the exporting mode's run (a resume, or a straight run without its
        triple: `stages.exporting_mode`), the branch's final roles, by export name."""
        if self.mode == exporting_mode(config):
            for name, role in roles.items():
                save_final(role, name, identity, config)


class ResumableRun:
    """The torch state of an SFT, reward-model or PPO run: saved whole, restored in order."""

    def __init__(self, branch: Branch, identity: dict, roles: dict[str, Role],
                 optimizers: dict[str, torch.optim.Optimizer],
                 generators: dict[str, torch.Generator], schedule: Callable[[int], Any],
                 checkpoint_every: int | str | None = None, step_key: str | None = None):
        self.branch, self.identity, self.roles = branch, identity, roles
        self.optimizers, self.generators, self.schedule = optimizers, generators, schedule
        self.initial = {name: (learned_identity(role), frozen_identity(role))
                        for name, role in roles.items()}
        self.checkpoints = branch.checkpoints(identity, checkpoint_every)
        self.step_key = step_key  # the progress entry counting the stage's steps (else updates)

    def position(self, updates: int) -> dict:
        return {"next_update": updates, "next_lr": self.schedule(updates)}

    def resume(self) -> tuple[int, dict] | None:
        """Where this run starts: its own latest in-rule checkpoint (a rerun after a kill), else
        a resume's interrupt state, else the start (None); returns (updates, progress)."""
        # a resume reads its interrupt state either way: it is the stage's input, which the
        # manifest names, and the checkpoint descends from it
        start = self.branch.interrupt_state(self.identity) if self.branch.resumes else None
        state = self.checkpoints.latest() or start
        if state is None:
            self.checkpoints.start(0)
            return None
        for name, role in self.roles.items():
            load_learned(role, state["learned"][name])
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state["optimizers"][name])
        for name, generator in self.generators.items():
            generator.set_state(state["generators"][name])
        restore_rng(state["rng"])
        if state["scheduler"] != self.position(state["updates"]):
            raise ReproError(f"the saved {self.branch.name} schedule position does not match "
                             "this run's schedule")
        self.checkpoints.start(self.step(state["updates"], state["progress"]))
        return state["updates"], state["progress"]

    def step(self, updates: int, progress: dict) -> int:
        return progress[self.step_key] if self.step_key else updates

    def reached(self, updates: int, progress: dict) -> None:
        """A safe point (no work pending): an in-rule checkpoint when due, a stop if asked."""
        self.checkpoints.reached(self.step(updates, progress),
                                 lambda: self.state(updates, progress))

    def state(self, updates: int, progress: dict) -> dict:
        """The complete state: an in-rule checkpoint's, or (`save`) the run's final one."""
        return {
            "identity": self.identity,
            "learned": {name: {n: t.detach().clone() for n, t in learned_state(role).items()}
                        for name, role in self.roles.items()},
            "optimizers": {name: o.state_dict() for name, o in self.optimizers.items()},
            "generators": {name: g.get_state() for name, g in self.generators.items()},
            "rng": rng_state(next(iter(self.roles.values())).device),
            "updates": updates,
            "scheduler": self.position(updates),
            "progress": progress,
        }

    def save(self, updates: int, progress: dict) -> dict:
        """Check what must and must not have moved, then write the complete state."""
        branch = self.branch.name
        for name, role in self.roles.items():
            learned, frozen = self.initial[name]
            if frozen_identity(role) != frozen:
                raise ReproError(f"{branch}: the frozen base of the {name} role changed")
            moved = learned_identity(role) != learned
            if name in self.optimizers and not moved:
                raise ReproError(f"{branch}: training did not change the {name}")
            if name not in self.optimizers and moved:
                raise ReproError(f"{branch}: the frozen {name} role changed")
        storage = self.branch.save(self.state(updates, progress))
        # kept as the last in-rule checkpoint: a job whose end is lost reruns from here
        self.checkpoints.keep(layout.state(*self.branch))
        return storage


def optimizer_step(optimizer: torch.optim.Optimizer, lr: float, loss: torch.Tensor,
                   max_grad_norm: float, what: str) -> float:
    """Backward, refuse missing or non-finite gradients, clip, step; returns the gradient
    norm before clipping."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss.backward()
    parameters = optimizer.param_groups[0]["params"]
    if any(p.grad is None or not torch.isfinite(p.grad).all() for p in parameters):
        raise ReproError(f"{what}: missing or non-finite gradients")
    norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
    optimizer.step()
    return norm


def resume_check(branch: str) -> dict:
    """PASS only if `<branch>-resume` equals `<branch>-continuous` bit for bit (every tensor,
    RNG, schedule position and history); the first difference is named. The report is
    written either way; a FAIL also stops the stage."""
    continuous, resumed = layout.state(branch, "continuous"), layout.state(branch, "resume")
    final = load_state(resumed)
    difference = first_difference(load_state(continuous), final)
    result = {
        "status": "PASS" if difference is None else "FAIL",
        "first_difference": difference,
        "continuous_sha256": sha256_file(continuous),
        "resume_sha256": sha256_file(resumed),
        "branch": branch,
        "updates": final["updates"],
        "compared": "every learned tensor, optimizer state, generator and RNG state, the "
                    "schedule position and the loop's progress and history (timings are kept "
                    "outside the state)",
    }
    write_json(layout.resume_check(branch), result)
    if difference is not None:
        raise ReproError(f"{branch} resume check FAILED: {difference}")
    return result


def stage(name: str, config: dict, run, log=print) -> dict:
    result = resume_check(name.removesuffix("_resume_check"))
    run.finish(summary=result)
    return result
