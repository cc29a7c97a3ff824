"""Starting and stopping the trainer's child processes, behind the interfaces the trainer uses.

On rank 0 each `train()` call spawns the rollout worker (`Processes.new_worker`, then its
`start`; it shares a `WorkerLink` of queues and values with the trainer), starts the embedded
server (`embedded_server`: `reprorl serve`, run by module name) or waits for a given one
(`Processes.serve`), and stops both however the call ends (`Processes.stop`); SIGTERM unwinds
the call (`unwind_on_sigterm`) unless the caller handles it. What the worker is given is checked
first (`reward_functions`, `refuse_unscored`, `refuse_unpicklable`), and a trainer built while a
spawn imports a script without a main guard is refused (`refuse_spawned_import`). Both children
ignore SIGTERM and SIGUSR1, which a cluster sends every process of a job: the trainer stops
them. The trainer reaches the processes only through `RolloutWorker` and `GenerationServer`,
which `processes.py`'s `WorkerHandle` and `ServerProcess` satisfy: a test may hand `Processes`
stand-ins.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

# started by module name (`python -m`); imported so that the code hash covers it
from reprorl.serve import server as embedded_server_module
from reprorl.serve.client import ServerAdmin

from .processes import ServerProcess, WorkerHandle, WorkerSignals
from .weight_sync import lora_slots, refuse_unfit_server

MAIN_GUARD = ('put the code that builds and trains the trainer under `if __name__ == '
              '"__main__":` in your script: the rollout worker is a spawned process, which '
              'imports your script first')


def refuse_spawned_import() -> None:
    """A trainer built while a spawned child imports the parent's script (no main guard)
    would start a second server and rewrite the parent's output_dir: fail at once instead."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(f"AsyncGRPOTrainer built inside the spawned rollout worker: "
                           f"{MAIN_GUARD}")


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds train(), which stops the worker and the server


def unwind_on_sigterm():
    """Have SIGTERM raise SystemExit in this process; returns the handler it replaces, for
    `restore_sigterm` (None off the main thread, where Python sets no handler, and when the
    caller handles SIGTERM itself: the pipeline's stages checkpoint first, `core/preempt.py`)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return None
    return signal.signal(signal.SIGTERM, _terminate)


def restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def reward_functions(reward_funcs) -> list:
    """`reward_funcs` as a list of callables. A model id or a model object is refused: the
    seed's trainer takes Python callables only (a model behind a picklable callable works,
    as the pipeline's `LearnedReward` does)."""
    funcs = reward_funcs if isinstance(reward_funcs, list) else (
        [reward_funcs] if reward_funcs is not None else [])
    for func in funcs:
        if isinstance(func, (str, os.PathLike, torch.nn.Module)):
            what = f"the model id {str(func)!r}" if isinstance(func, (str, os.PathLike)) else (
                f"a {type(func).__name__} model")
            raise TypeError(
                f"reward_funcs got {what}: reward models are not taken by id or as a model "
                "(the rollout worker runs on the CPU and imports no model by name); pass a "
                "picklable callable (prompts, completions, **kwargs) -> list[float] that "
                "loads and scores with it, or serve the model and call it over HTTP")
        if not callable(func):
            raise TypeError(f"reward_funcs got a {type(func).__name__}, which is not callable")
    return funcs


def refuse_unscored(reward_funcs: list, env_owns_reward: dict, loop_cls,
                    rewardless_generate) -> None:
    """Refuse a run in which nothing scores a completion: no reward function, no environment
    (of those in `env_owns_reward`) defining get_reward(), and a `loop_cls` whose
    generate_one is `rewardless_generate` (`AsyncRolloutLoop`'s, whose rollouts carry none)."""
    unscored = [k for k, owns in env_owns_reward.items() if not owns]
    if not reward_funcs and (not env_owns_reward or unscored) and (
            loop_cls.generate_one is rewardless_generate):
        which = "" if unscored in ([], [None]) else f" (environments {unscored})"
        raise ValueError(
            f"nothing scores a completion{which}: reward_funcs is empty, no environment "
            "defines get_reward(), and the rollout loop "
            f"({loop_cls.__name__}) generates with AsyncRolloutLoop.generate_one, "
            "whose rollouts carry no reward; pass reward_funcs, an environment with "
            "get_reward(), or a loop_cls whose generate_one returns "
            "Rollout(..., reward=...)")


def refuse_unpicklable(things: list[tuple[str, Any]]) -> None:
    """Each `(what, thing)` must pickle: the spawned worker gets it so, and an error here,
    before any process starts, names what to change."""
    for what, thing in things:
        try:
            pickle.dumps(thing)
        except Exception as error:
            raise TypeError(
                f"{what} cannot be pickled for the rollout worker process ({error}); use a "
                "module-level function, functools.partial or a callable instance, not a "
                "lambda or a closure") from error


@runtime_checkable
class RolloutWorker(Protocol):
    """The rollout worker as the trainer drives it (`processes.WorkerHandle`): spawned with
    its first arguments (`start`), sent the last once the server serves, asked whether it
    still delivers, stopped. Its samples arrive on the `WorkerLink`'s queue (`SampleQueue`
    reads them and calls `raise_if_failed` while it waits)."""

    def start(self, target, args: tuple, payload: Any = None) -> None: ...

    def check_starting(self, hint: str) -> None: ...

    def wait_started(self, hint: str) -> None: ...

    def send(self, part: Any) -> None: ...

    @property
    def failed(self) -> bool: ...

    def failure(self) -> str | None: ...

    def raise_if_failed(self, wait: float = 0.0) -> None: ...

    @property
    def pid(self) -> int | None: ...  # for whoever must signal it (None before the spawn)

    def stop(self) -> None: ...


@runtime_checkable
class GenerationServer(Protocol):
    """The embedded server as the trainer drives it (`processes.ServerProcess`): started (its
    URL once it listens), its process polled while it loads, stopped."""

    process: Any  # .poll(), .returncode while it runs; None once stopped

    def start(self, timeout: float, env: dict[str, str] | None = None, watch=None) -> str: ...

    def stop(self) -> None: ...


@dataclass
class WorkerLink:
    """What the trainer and the worker share, created before the spawn (only a spawn may pass
    them). Both sides update the queued counters, under their locks; every other value has
    one writer and no lock, so a worker killed mid-access cannot hang the trainer."""

    groups: Any  # queue of the worker's GroupResults (`SampleQueue` reads it)
    metrics: Any  # queue of the worker's metric records
    queued_tokens: Any  # .value: tokens of the samples queued (both sides)
    queued_samples: Any  # .value: samples queued (both sides)
    allowance: Any  # .value: tokens the worker may keep queued or in flight (the trainer)
    position_limit: Any  # .value: the worker samples no position from it on (the trainer)
    signals: WorkerSignals

    @classmethod
    def create(cls, context, position_limit: int) -> WorkerLink:
        groups, metrics = context.Queue(), context.Queue()
        queued_tokens, queued_samples = context.Value("q", 0), context.Value("q", 0)
        allowance = context.RawValue("d", 0.0)  # set with the server's token budget
        return cls(groups, metrics, queued_tokens, queued_samples, allowance,
                   context.RawValue("q", position_limit), WorkerSignals.create(context))

    def spawn_args(self, version) -> tuple:
        """`run_rollout_loop`'s arguments after its inbox: what only a spawn may pass (by
        their names among `AsyncRolloutLoop`'s arguments; `version`, shared .value, is the
        newest published weight version), the trainer's pid, the worker's started event."""
        shared = {"rollout_buffer": self.groups, "model_version_value": version,
                  "token_allowance": self.allowance, "position_limit": self.position_limit,
                  "metrics_queue": self.metrics,
                  "queued_tokens": self.queued_tokens, "queued_samples": self.queued_samples,
                  **self.signals.worker_kwargs()}
        return shared, os.getpid(), self.signals.started


def embedded_server(args, model_path: str, output_dir: Path, lora_dir: Path,
                    lora_rank: int | None, dtype: str) -> ServerProcess:
    """`reprorl serve` for this run, not started: the policy's base model in `dtype`, loading
    adapters from `lora_dir` only, writing its port and its log under `output_dir`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    port_file = output_dir / "server.port"
    command = [sys.executable, "-m", embedded_server_module.__name__, "--model", model_path,
               "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
               "--lora-root", str(lora_dir),
               "--threads", str(args.embedded_server_threads),
               "--max-num-seqs", str(args.embedded_server_max_num_seqs),
               "--max-loras", str(lora_slots(args.max_staleness)),
               "--max-lora-rank", str(max(lora_rank or 0, 8)),
               "--max-logprobs", str(max(args.num_sampler_logprobs, 1)),
               "--dtype", dtype, "--seed", str(args.seed),
               "--device", args.embedded_server_device, "--ignore-job-signals"]
    if args.trust_remote_code:
        command.append("--trust-remote-code")
    if args.embedded_server_max_model_len:
        command += ["--max-model-len", str(args.embedded_server_max_model_len)]
    if args.truncated_sampling:  # as the seed's vLLM command: the candidate sets
        command += ["--enable-scale-out", "--return-sampling-mask"]
    return ServerProcess(command, port_file, output_dir / "server.log")


def sampling_mask(admin: ServerAdmin, args, model_path: str, prompt_ids: list[int],
                  log) -> bool:
    """Whether the server returns the candidate set each token was drawn from (asked
    only with top_k/top_p/min_p set: `truncated_sampling`); a warning when it cannot."""
    if not args.truncated_sampling:
        return False
    missing = admin.sampling_mask_missing(model_path, prompt_ids)
    if missing:
        log(f"WARNING: top_k/top_p/min_p are set, but the server at {admin.base_url} "
            f"cannot say which tokens each one was drawn from: {missing}. The trainer "
            "normalises over the whole vocabulary, so every importance ratio is biased "
            "low by the probability mass the truncation removed")
    return missing is None


class Processes:
    """The rollout worker and the generation server of the train() call that runs them (None
    before and after): started here, stopped by `stop` whatever happened in between."""

    def __init__(self) -> None:
        self.worker: RolloutWorker | None = None
        self.server: GenerationServer | None = None  # only one this process started

    def new_worker(self, position_limit: int, timeout: float
                   ) -> tuple[RolloutWorker, WorkerLink]:
        """The rollout worker, not spawned yet (its `start` spawns it), and what it will share
        with the trainer; `timeout`: seconds without a heartbeat before it counts as hung."""
        context = mp.get_context("spawn")
        link = WorkerLink.create(context, position_limit)
        self.worker = WorkerHandle(context, link.signals, timeout)
        return self.worker, link

    def serve(self, args, embedded: Callable[[], GenerationServer], log_path: Path
              ) -> ServerAdmin:
        """The generation server, once it answers: the embedded one (`embedded()`, started
        here), or the one at `vllm_server_base_url`, refused if it cannot hold this run. Sets
        `args`' URL and API key: the worker reads them from the config it is sent."""
        if args.embedded_server:
            args.vllm_server_api_key = secrets.token_urlsafe(32)  # this run's, nobody else's
            self.server = embedded()
            # watch: a script without a main guard fails at once, not once the model loaded
            args.vllm_server_base_url = self.server.start(
                args.vllm_server_timeout, {"VLLM_API_KEY": args.vllm_server_api_key},
                watch=lambda: self.worker.check_starting(MAIN_GUARD))
        else:
            args.vllm_server_api_key = args.vllm_server_api_key or os.environ.get(
                "VLLM_API_KEY")
        admin = ServerAdmin(args.vllm_server_base_url, args.vllm_request_timeout,
                            args.vllm_server_api_key)
        admin.wait_ready(args.vllm_server_timeout, self.server and self.server.process,
                         log_path)
        if not args.embedded_server:  # a server started by somebody else: can it hold us?
            refuse_unfit_server(admin.base_url, admin.metrics(),
                                lora_slots(args.max_staleness) if args.use_peft else 0)
        return admin

    def stop(self, weights, log) -> None:
        """Stop the worker, then (even if that failed) the server started here, or, on a
        server that outlives the run, unload what `weights` left loaded (its errors logged
        as warnings)."""
        try:
            if self.worker is not None:
                self.worker.stop()
                self.worker = None
        finally:
            if weights is not None and self.server is None:  # a server that outlives us
                for error in weights.close():
                    log(f"warning: {error}")
            if self.server is not None:
                self.server.stop()
                self.server = None
