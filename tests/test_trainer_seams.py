"""The trainer's seam to its child processes (`grpo/launch.py`), driven with stand-ins.

The trainer holds the rollout worker and the generation server in `launch.Processes`, behind
the `RolloutWorker` and `GenerationServer` protocols; tests/test_grpo.py runs the real ones
(`processes.WorkerHandle`, `processes.ServerProcess`). The stand-ins here only record what the
trainer's teardown asks of them, so a stop that fails can be shown without a process to break.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from types import SimpleNamespace

import pytest

from reprorl.grpo.launch import GenerationServer, Processes, RolloutWorker
from reprorl.grpo.processes import ServerProcess, WorkerHandle, WorkerSignals
from reprorl.grpo.trainer import AsyncGRPOTrainer


class StandInWorker:
    """A `RolloutWorker` whose `stop` is recorded in `calls` and may raise."""

    def __init__(self, calls: list[str], stop_fails: bool = False):
        self.calls, self.stop_fails = calls, stop_fails
        self.failed, self.pid = False, None

    def start(self, target, args: tuple, payload=None) -> None: ...
    def check_starting(self, hint: str) -> None: ...
    def wait_started(self, hint: str) -> None: ...
    def send(self, part) -> None: ...
    def failure(self) -> str | None: ...
    def raise_if_failed(self, wait: float = 0.0) -> None: ...

    def stop(self) -> None:
        self.calls.append("worker.stop")
        if self.stop_fails:
            raise RuntimeError("the worker would not stop")


class StandInServer:
    """A `GenerationServer` whose `stop` is recorded in `calls`."""

    process = None

    def __init__(self, calls: list[str]):
        self.calls = calls

    def start(self, timeout: float, env=None, watch=None) -> str: ...

    def stop(self) -> None:
        self.calls.append("server.stop")


class StandInWeights:
    """The run's weight versions: `close` unloads them from a server that outlives the run."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def close(self) -> list[str]:
        self.calls.append("weights.close")
        return ["policy-ab12cd34-v3 was not unloaded"]


def trainer_with(worker, server, weights, log) -> AsyncGRPOTrainer:
    """A trainer as train() leaves it for `_stop_processes` (its model is not needed)."""
    trainer = AsyncGRPOTrainer.__new__(AsyncGRPOTrainer)
    trainer.processes, trainer.log = Processes(), log
    trainer.processes.worker, trainer.processes.server = worker, server
    trainer.run = SimpleNamespace(weights=weights)
    return trainer


def test_the_real_handles_and_the_stand_ins_satisfy_the_protocols():
    context = mp.get_context("spawn")  # the handle's signals, no process started
    assert isinstance(WorkerHandle(context, WorkerSignals.create(context), 1.0), RolloutWorker)
    assert isinstance(ServerProcess(["serve"], Path("port"), Path("log")), GenerationServer)
    assert isinstance(StandInWorker([]), RolloutWorker)
    assert isinstance(StandInServer([]), GenerationServer)


def test_a_worker_that_fails_to_stop_still_leaves_the_server_stopped():
    calls, logged = [], []
    trainer = trainer_with(StandInWorker(calls, stop_fails=True), StandInServer(calls),
                           StandInWeights(calls), logged.append)
    with pytest.raises(RuntimeError, match="would not stop"):
        trainer._stop_processes()
    # our own server is stopped (its adapters go with it), not asked to unload them
    assert calls == ["worker.stop", "server.stop"] and trainer.server is None
    assert trainer.worker is not None and logged == []  # its stop did not complete


def test_a_server_that_outlives_the_run_is_left_running_with_the_run_unloaded():
    calls, logged = [], []
    trainer = trainer_with(StandInWorker(calls), None, StandInWeights(calls), logged.append)
    trainer._stop_processes()
    assert calls == ["worker.stop", "weights.close"] and trainer.worker is None
    assert logged == ["warning: policy-ab12cd34-v3 was not unloaded"]
