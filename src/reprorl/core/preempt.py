"""In-rule checkpoints: a training stage that a cluster stops keeps its work.

Every `checkpoint_every` a training stage writes its resume state (the format and the code of
the DAG's interrupt states, `pipeline/resumable.py`) to a scratch folder outside its declared
outputs, `layout.stage_scratch(stage, key)`, the key a hash of the stage's identity (config,
inputs, code, initial tensors): a rerun of the same job finds it, a changed job never does. A
rerun continues from it and ends with the bytes of an uninterrupted run; the final state is
kept too, and the scratch goes when a Snakemake run ends well. SIGTERM (a SLURM time limit or
preemption) and SIGUSR1 (`sbatch --signal=USR1@<s>`) ask for a checkpoint at the next safe
point, after which the stage exits with 128 + the signal's number, a failure Snakemake
retries. A SIGKILL loses the work since the last checkpoint; a checkpoint is written whole or
not at all.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from . import layout
from .errors import Preempted, ReproError
from .manifest import atomic_write_bytes, sha256_json
from .state import first_difference, load_state, save_state

# what a cluster sends every process of a job at its time limit or on preemption
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DEFAULT_EVERY = "60s"  # the schema's default too
STATE, WORK = "state.pt.gz", "work.log"
_asked: list[int] = []  # the signals received, in order (a handler only records)


def parse_every(value: int | str | None) -> tuple[str, float]:
    """`checkpoint_every`: a whole number of the stage's steps (updates, iterations), a number
    of seconds written `<n>s`, or 0 for none (signals still checkpoint); None, the default."""
    value = DEFAULT_EVERY if value is None else value
    if str(value).isdigit():
        return "steps", int(value)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s", str(value))
    if not match:
        raise ReproError(f"checkpoint_every {value!r} is neither a number of steps nor seconds "
                         "written like '60s'; set it to one of those (0 for none)")
    return "seconds", float(match.group(1))


def _ask(signum, frame) -> None:
    _asked.append(signum)


@contextlib.contextmanager
def job_signals_held():
    """SIGNALS blocked in this thread while a child process starts: the child inherits the
    block, so one that arrives before it ignores them (`ignore_job_signals`) cannot end it.
    Here none is lost: another thread takes it, or it arrives once the block ends. For the
    children a stage stops itself once checkpointed (a GRPO run's rollout worker and server)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_job_signals() -> None:
    """In a child started under `job_signals_held`: SIGNALS ignored (its parent stops it, its
    parent's death ends it), then unblocked, which discards any held."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


class Checkpoints:
    """One training stage's in-rule checkpoints; `reached` at each safe point, `finish` at the
    end. Each step's work is logged beside them, so the finished stage reports what every
    attempt computed (`finish`)."""

    def __init__(self, stage: str, identity: dict, every: int | str | None = None,
                 inputs: dict | None = None):
        """`inputs`: what else the job starts from (a resume's interrupt state), in the key."""
        self.stage, self.identity = stage, identity
        self.unit, self.every = parse_every(every)
        key = sha256_json({"identity": identity, "inputs": inputs or {}})
        self.folder = layout.stage_scratch(stage, key[:16])
        self.last_time, self.started_at = time.monotonic(), 0
        self.last_step = -1  # of the newest checkpoint (the start's state counts as one)
        self.written, self.writing_s = 0, 0.0  # this attempt's checkpoints, their cost
        _asked.clear()
        self.handlers = {signum: signal.signal(signum, _ask) for signum in SIGNALS}

    def latest(self) -> dict | None:
        """The latest complete checkpoint of this very job, or None; it is scratch, not an
        input (the manifest of a resumed run is an uninterrupted run's)."""
        path = self.folder / STATE
        if not path.exists():
            return None
        state = load_state(path, record=False)
        difference = first_difference(state["identity"], self.identity, "identity")
        if difference:  # the key is the identity's hash: only a collision or an edit gets here
            raise ReproError(f"{path} is not this stage's checkpoint ({difference}); delete it")
        return state

    def start(self, step: int) -> None:
        """The run starts (or continues) at `step`."""
        self.started_at = self.last_step = step
        self._log(f"start {step}")

    def reached(self, step: int, state: Callable[[], dict], safe: bool = True) -> None:
        """The run has computed `step` steps; at a safe point (`safe`: a GRPO run's are its
        metrics windows' ends) a checkpoint when one is due or a signal asked, then, if one
        did, stop."""
        self._log(str(step))
        if safe:
            due = (self.every and (step - self.last_step >= self.every if self.unit == "steps"
                                   else time.monotonic() - self.last_time >= self.every))
            if due:
                self.write(state, step)
            self.stop_if_asked(step, state)

    def stop_if_asked(self, step: int, state: Callable[[], dict]) -> None:
        """If a signal asked: a checkpoint after `step` steps (unless one was just written
        there), then stop with `Preempted`."""
        if not _asked:
            return
        if self.last_step != step:
            self.write(state, step)
        name = signal.Signals(_asked[0]).name
        self._log(f"stop {step} {name}")
        raise Preempted(_asked[0], f"{self.stage}: {name} received; checkpoint written after "
                                   f"step {step} in {self.folder}, which a rerun of the same "
                                   "job continues from")

    def write(self, state: Callable[[], dict], step: int | None = None) -> None:
        """A checkpoint now (after `step` steps, where the caller counts them)."""
        started = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        save_state(self.folder / STATE, state())
        self.last_time = time.monotonic()
        if step is not None:
            self.last_step = step
        self.written += 1
        self.writing_s += self.last_time - started

    def keep(self, saved: Path) -> None:
        """The run's final state, just saved at `saved`, as the last checkpoint: the same
        bytes, copied rather than built and packed again."""
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.folder / STATE, saved.read_bytes())

    def finish(self) -> dict:
        """The outputs are written: what every attempt computed, for the manifest's run
        section. The last checkpoint stays (`keep`: a job whose end is lost, killed by its
        time limit while Snakemake wraps it up, reruns in seconds); the scratch goes when a
        Snakemake run ends well (`onsuccess`, rules/common.smk)."""
        work = self.folder / WORK
        lines = work.read_text().splitlines() if work.exists() else []
        record = {"attempts": sum(line.startswith("start") for line in lines),
                  "steps_computed": sum(line.isdigit() for line in lines),
                  "continued_from_step": self.started_at,
                  "written": self.written, "writing_seconds": round(self.writing_s, 3)}
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        return record

    def _log(self, line: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / WORK, "a") as log:
            log.write(line + "\n")


def clear(stage: str) -> None:
    """Every scratch folder of `stage` (its outputs are complete)."""
    for folder in layout.STAGE_SCRATCH.glob(f"{stage}-*"):
        shutil.rmtree(folder, ignore_errors=True)
