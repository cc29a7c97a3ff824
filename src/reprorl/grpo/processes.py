"""The trainer's child processes: the rollout worker and the embedded generation server.

Both die with the trainer (`die_with_parent`), so a killed trainer leaves neither behind.
`WorkerHandle` spawns the worker with the GPU hidden, hands it its arguments through a pipe
once it runs (in parts: the trainer sends the last once its server serves), reports a worker
that dies while starting, and tells a failed worker (its traceback), a dead one (its exit
code) and a hung one (no heartbeat) apart; `ServerProcess` starts `reprorl serve` and waits
for the port file it writes once listening. The trainer starts and stops them through
`launch.py`, where they are its `RolloutWorker` and `GenerationServer`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from reprorl.core.preempt import job_signals_held

PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when its parent dies. Linux only: elsewhere
    a no-op that returns False."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    return True


@contextlib.contextmanager
def gpu_hidden():
    """CUDA_VISIBLE_DEVICES="" while a child is spawned (it inherits the environment then):
    the worker generates over HTTP and must never claim the trainer's GPU."""
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


@dataclass
class WorkerSignals:
    """What trainer and worker share besides the samples. The heartbeat is a single-writer
    value without a lock: a worker killed mid-write cannot leave a lock held."""

    heartbeat: Any  # .value: time.time() of the worker's last beat (the worker writes)
    failed: Any  # event: the worker raised, after putting its traceback
    tracebacks: Any  # queue: the worker's formatted traceback
    stop: Any  # event: the trainer asks the worker to stop
    started: Any  # event: the worker's own code runs (the spawn's imports are done)

    @classmethod
    def create(cls, context) -> WorkerSignals:
        return cls(context.RawValue("d", time.time()), context.Event(), context.Queue(),
                   context.Event(), context.Event())

    def worker_kwargs(self) -> dict:
        """Their names among `AsyncRolloutLoop`'s arguments."""
        return {"heartbeat_value": self.heartbeat, "failed_event": self.failed,
                "exception_info_queue": self.tracebacks, "stop_event": self.stop}


def hand_over(writer, parts: queue.Queue, started, process) -> None:
    """Write the pickled parts from `parts` in order, once the worker runs (`started`: until
    then the spawn may still hold a copy of the pipe's read end here, and a write to a worker
    that died importing would wait for good); stop at a None, or at a worker that died first
    or unread. The pipe closes either way."""
    try:
        while not started.wait(0.05):
            # beside the trainer's own is_alive: whichever thread loses the waitpid race
            # sees the process alive once more and asks again next round
            if not process.is_alive():
                return
        while (blob := parts.get()) is not None:
            writer.send_bytes(blob)
    except OSError:
        pass
    finally:
        writer.close()


class WorkerHandle:
    def __init__(self, context, signals: WorkerSignals, timeout: float):
        self.context, self.signals = context, signals
        self.timeout = timeout  # seconds without a heartbeat before the worker counts as hung
        self.process = None
        self.outbox: queue.Queue | None = None  # pickled parts for the hand-over thread
        self.waiting = False  # the worker waits for the last part of its arguments

    def start(self, target, args: tuple, payload: Any = None) -> None:
        """Spawn `target(*args)`, or with a `payload` `target(inbox, *args)`: `args` holds
        what only a spawn may pass (queues, events, shared values) and stays small; `payload`
        (the loop's class and arguments) is pickled here, so an unpicklable argument fails in
        the trainer, and a thread writes it to `inbox` (a pipe's read end) once the worker
        runs, while the trainer goes on (it starts the server meanwhile); `send` writes the rest.
        Sent with the spawn, arguments over a pipe's 64 KiB would block the trainer for good
        when the worker dies importing the trainer's script: the worker never reads them, and
        the trainer holds the spawn pipe's other end. This pipe's read end lives in the worker
        alone, so a worker that dies unread breaks the write instead."""
        inbox = writer = None
        if payload is not None:
            blob = ForkingPickler.dumps(payload)
            inbox, writer = self.context.Pipe(duplex=False)
            args = (inbox, *args)
        try:
            with gpu_hidden(), job_signals_held():
                process = self.context.Process(target=target, args=args,
                                               name="rollout-worker", daemon=True)
                process.start()
        except BaseException:
            if writer is not None:
                writer.close()
            raise
        finally:
            if inbox is not None:
                inbox.close()  # the worker has its own copy
        self.process = process  # only once started: stop() joins it
        if writer is not None:
            self.outbox, self.waiting = queue.Queue(), True
            self.outbox.put(blob)
            threading.Thread(target=hand_over, name="worker-payload", daemon=True,
                             args=(writer, self.outbox, self.signals.started, process)).start()

    def send(self, part: Any) -> None:
        """The last part of the payload, written after the first (pickled here: an
        unpicklable one fails in the trainer). A worker waiting for it beats no heartbeat
        (its loop does, once built), so its silence counts from here: the server may have
        taken longer than `timeout` to come up."""
        blob = ForkingPickler.dumps(part)
        self.signals.heartbeat.value = time.time()  # the worker writes it only once it runs
        self.outbox.put(blob)
        self.waiting = False

    def close_outbox(self) -> None:
        """No more parts: the hand-over thread closes the pipe once it has written the rest
        (a worker still waiting for a part reads the end of the pipe)."""
        if self.outbox is not None:
            self.outbox.put(None)
            self.outbox = None

    def check_starting(self, hint: str) -> None:
        """Raise if the worker exited before it ran its own code: it failed while the spawn
        imported the parent's script (its error went to stderr); say so, with `hint`, the
        usual fix. Or if it ran and failed (reading its arguments) or died since."""
        alive = self.process.is_alive()
        if not self.signals.started.is_set() and not alive:
            raise RuntimeError(
                f"the rollout worker exited with code {self.process.exitcode} while "
                f"starting, before any of its own code ran (its error is on stderr above): "
                f"{hint}")
        if self.failed or not alive:  # `failure` says which; no heartbeat to judge yet
            raise RuntimeError(self.failure())

    def wait_started(self, hint: str) -> None:
        """Return once the worker runs its own code (`check_starting` meanwhile)."""
        started = time.monotonic()
        while not self.signals.started.wait(0.05):
            self.check_starting(hint)
            if time.monotonic() - started > self.timeout:
                raise RuntimeError(f"the rollout worker did not start within {self.timeout:g} s "
                                   "(rollout_worker_timeout)")

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def failed(self) -> bool:
        """The worker reported an exception."""
        return self.signals.failed.is_set()

    def failure(self) -> str | None:
        """Why the worker can no longer deliver, or None while it is healthy."""
        if self.failed:
            try:
                tb = self.signals.tracebacks.get(timeout=5)
            except queue.Empty:
                tb = "(no traceback arrived)"
            return f"the rollout worker failed:\n{tb}"
        if not self.process.is_alive():
            return (f"the rollout worker exited with code {self.process.exitcode} without a "
                    "traceback (killed?)")
        silent = time.time() - self.signals.heartbeat.value
        if silent > self.timeout:
            return (f"the rollout worker sent no heartbeat for {silent:.0f} s (limit "
                    f"rollout_worker_timeout={self.timeout:g} s): it is hung")
        return None

    def raise_if_failed(self, wait: float = 0.0) -> None:
        """Raise the worker's failure, waiting up to `wait` seconds for its report."""
        self.signals.failed.wait(wait)
        failure = self.failure()
        if failure:
            raise RuntimeError(failure)

    def stop(self) -> None:
        """Ask the worker to stop, then kill it 10 s later (it ignores SIGTERM:
        `ignore_job_signals`); one still waiting for its arguments has nothing to finish and
        is killed at once."""
        waiting = self.waiting
        self.close_outbox()
        process, self.process = self.process, None
        if process is None:
            return
        self.signals.stop.set()
        if not waiting:
            process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


class ServerProcess:
    """`command` (a `reprorl serve --ignore-job-signals` writing its port to `port_file`) as a
    child process whose output goes to `log_path`, stopped by SIGINT, also when this process
    dies."""

    def __init__(self, command: list[str], port_file: Path, log_path: Path):
        self.command, self.port_file, self.log_path = command, port_file, log_path
        self.process: subprocess.Popen | None = None
        self.log = None

    def start(self, timeout: float, env: dict[str, str] | None = None, watch=None) -> str:
        """Start it (with `env` added to this process's environment: secrets go there, not on
        the command line that `ps` shows) and return its URL once it listens; `watch()`,
        called while it loads, may raise to stop waiting (the worker failed meanwhile)."""
        self.port_file.unlink(missing_ok=True)
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop)
        with job_signals_held():
            self.process = subprocess.Popen(
                self.command, stdout=self.log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                preexec_fn=functools.partial(die_with_parent, signal.SIGINT))  # noqa: PLW1509
        started = time.monotonic()
        while not self.port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"the embedded server exited with code "
                                   f"{self.process.returncode}:\n"
                                   f"{self.log_path.read_text()[-2000:]}")
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"the embedded server did not start; see {self.log_path}")
            if watch is not None:
                watch()
            time.sleep(0.1)
        return f"http://127.0.0.1:{int(self.port_file.read_text())}"

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self.log is not None:
            self.log.close()
            self.log = None
