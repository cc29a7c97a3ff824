"""In-rule checkpoints (`core/preempt.py`): cadence, signals, the work record, clean-up.

The stages themselves are stopped and continued for real in tests/test_crash.py."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from reprorl.core import layout
from reprorl.core.errors import Preempted, ReproError
from reprorl.core.preempt import Checkpoints, clear, job_signals_held, parse_every
from reprorl.core.state import first_difference


def test_checkpoint_every_is_steps_or_seconds():
    assert parse_every(5) == ("steps", 5) and parse_every("5") == ("steps", 5)
    assert parse_every("2.5s") == ("seconds", 2.5) and parse_every(None) == ("seconds", 60.0)
    with pytest.raises(ReproError, match="checkpoint_every '5m' is neither"):
        parse_every("5m")


def state_at(step: int) -> dict:
    return {"identity": {"run": 1}, "learned": {"w": torch.full((3,), float(step))},
            "updates": step}


def test_a_rerun_finds_the_latest_checkpoint_and_a_changed_job_none(in_tmp):
    first = Checkpoints("sft_continuous", {"run": 1}, every=2)
    first.start(0)
    for step in range(1, 6):
        first.reached(step, lambda step=step: state_at(step))
    again = Checkpoints("sft_continuous", {"run": 1}, every=2)
    assert first_difference(again.latest(), state_at(4)) is None  # steps 2 and 4, not 5
    assert Checkpoints("sft_continuous", {"run": 2}, every=2).latest() is None
    again.start(4)
    again.reached(5, lambda: state_at(5))
    again.write(lambda: state_at(5))  # the final state, kept as the last checkpoint
    work = again.finish()
    assert work["attempts"] == 2 and work["steps_computed"] == 6 and work["written"] == 1
    assert work["continued_from_step"] == 4
    assert first_difference(again.latest(), state_at(5)) is None
    clear("sft_continuous")  # a Snakemake run that ended well: every folder of the stage goes
    assert not list(layout.STAGE_SCRATCH.glob("*"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_writes_a_checkpoint_then_stops_the_stage(in_tmp, signum):
    before = signal.getsignal(signum)
    checkpoints = Checkpoints("ppo_resume", {"run": 1}, every=0)  # none but on a signal
    checkpoints.start(0)
    checkpoints.reached(1, lambda: state_at(1))
    assert checkpoints.latest() is None
    os.kill(os.getpid(), signum)  # recorded by the handler; the step goes on
    with pytest.raises(Preempted, match=f"{signum.name} received; checkpoint written after "
                                        "step 2") as stopped:
        checkpoints.reached(2, lambda: state_at(2))
    assert stopped.value.status == 128 + signum
    assert first_difference(checkpoints.latest(), state_at(2)) is None
    checkpoints.finish()
    assert signal.getsignal(signum) is before


def test_seconds_cadence_writes_when_the_time_has_passed(in_tmp, monkeypatch):
    clock = iter([0.0, 1.0, 3.5, 3.5, 3.6, 4.0])
    monkeypatch.setattr("reprorl.core.preempt.time.monotonic", lambda: next(clock))
    checkpoints = Checkpoints("base_model", {"run": 1}, every="3s")
    for step in (1, 2, 3):
        checkpoints.reached(step, lambda step=step: state_at(step))
    assert first_difference(checkpoints.latest(), state_at(2)) is None
    checkpoints.finish()


def test_a_signal_between_safe_points_waits_for_the_next(in_tmp):
    """A GRPO run's safe points are its metrics windows' ends: a signal after another step
    is answered at the next one, and a due checkpoint waits for it too."""
    checkpoints = Checkpoints("grpo_learned_continuous", {"run": 1}, every=2)
    checkpoints.start(0)
    os.kill(os.getpid(), signal.SIGTERM)
    for step in (1, 2, 3, 4):
        checkpoints.reached(step, lambda step=step: state_at(step), safe=False)
    assert checkpoints.latest() is None
    with pytest.raises(Preempted, match="after step 5"):
        checkpoints.reached(5, lambda: state_at(5), safe=True)
    assert first_difference(checkpoints.latest(), state_at(5)) is None
    work = checkpoints.finish()
    assert work["written"] == 1 and work["steps_computed"] == 5


def test_the_end_of_a_run_stops_only_if_asked(in_tmp):
    checkpoints = Checkpoints("grpo_learned_resume", {"run": 1}, every=0)
    checkpoints.start(3)
    checkpoints.stop_if_asked(3, lambda: state_at(3))  # nothing asked: the run finishes
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(Preempted):
        checkpoints.stop_if_asked(3, lambda: state_at(3))
    assert checkpoints.latest() is None  # the state it started from stands for step 3
    checkpoints.finish()


def test_children_started_under_held_signals_ignore_them(tmp_path):
    """A GRPO run's worker and server: started while SIGTERM and SIGUSR1 are held, they then
    ignore them (the trainer stops them after its checkpoint); one that reached the trainer
    meanwhile is not lost (another thread of this process may take it during the hold)."""
    script = ("import os, signal, sys, time\n"
              "from reprorl.core.preempt import ignore_job_signals\n"
              "time.sleep(0.5)\n"  # signals sent now are held, then discarded
              "ignore_job_signals()\n"
              "open(sys.argv[1], 'w').close()\n"
              "time.sleep(30)\n")
    ready = tmp_path / "ready"
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        with job_signals_held():
            child = subprocess.Popen([sys.executable, "-c", script, str(ready)])
            os.kill(child.pid, signal.SIGTERM)  # while it starts: held in the child
            os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)  # a signal runs its Python handler between bytecodes of this thread
        assert received == [signal.SIGUSR1]
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            child.send_signal(signum)
        time.sleep(0.3)
        assert child.poll() is None  # ignored
    finally:
        signal.signal(signal.SIGUSR1, previous)
        child.kill()
        child.wait()
