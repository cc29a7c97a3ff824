"""`AsyncGRPOTrainer`: trains a LoRA policy on samples a spawned rollout worker streams in.

The trainer (this process) owns the policy, the optimizer and the weight versions; the worker
(`rollout.py`, a spawned CPU process) owns generation and scoring; a generation server (a real
`vllm serve`, or `reprorl serve` started here when `embedded_server=True`) samples.
Per optimizer step: take `gradient_accumulation_steps` micro-batches from the queue (samples
more than `max_staleness` versions old are dropped), compute the loss of `loss.py`, step
AdamW, set the worker's token allowance, and every `weight_sync_steps` steps publish a new
version through the LoRA path: a PEFT adapter written atomically under
`<output_dir>/.vllm_lora/v<N>/`, loaded by name, `max_staleness + 1` versions kept live.

Departures from the seed (TRL's trainer): the policy is always a LoRA adapter (weights sync
through the LoRA path; no merged full-weight sync); one training process; no callbacks, hub or
optimizer overrides; tools and environments arrive with a later release (`generate_one` is
where they plug in). The resume cursor also lists the positions already consumed beyond it, so
a resumed worker neither skips nor replays a prompt.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import math
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .. import lora
from ..manifest import atomic_directory, atomic_write_bytes, read_json, write_json
from . import server as embedded_server  # started by module name; imported for the code hash
from .batching import PaddedBatcher
from .client import ServerAdmin
from .config import AsyncGRPOConfig
from .identity import refuse_other_run, run_identity
from .loss import (
    centered_score_loss,
    clip_fractions,
    clipped_surrogate_loss,
    importance_weights,
    token_mean,
)
from .metrics import MetricsLog, MetricsWindow, console_line
from .rollout import AsyncRolloutLoop, GroupResult, drain, is_stale, reward_name, run_rollout_loop

logger = logging.getLogger("reprorl.grpo")


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds train(), which stops the worker and the server


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel signal this process when its parent dies, so a killed trainer
    never leaves a server or a worker behind (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def disable_dropout(model) -> None:
    """Training mode (gradient checkpointing needs it) without dropout's noise, as TRL does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def checkpointing(model, on: bool) -> None:
    """Activation (gradient) checkpointing on or off; transformers 5 renamed the methods."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def checkpointing_on(model) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict


def as_rows(dataset) -> list[dict]:
    """Any sequence of mappings with a conversational `prompt` column, as plain dicts."""
    if dataset is None:
        raise ValueError("train_dataset is required (rows with a conversational 'prompt')")
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # pandas
        rows = dataset.to_dict("records")
    else:
        rows = [dict(row) for row in dataset]
    if not rows:
        raise ValueError("train_dataset is empty")
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
            raise ValueError(f"train_dataset row {i}: 'prompt' must be a conversation, a list "
                             "of {'role': ..., 'content': ...} messages")
    return rows


def lora_settings(model) -> tuple[int, float] | None:
    for module in model.modules():
        if isinstance(module, lora.LoRALinear):
            return module.rank, module.alpha
    return None


class AsyncGRPOTrainer:
    loop_cls = AsyncRolloutLoop

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None,
                 train_dataset=None, processing_class=None, peft_config=None,
                 lora_path: str | None = None, tools=None, environment_factory=None,
                 log=print):
        self.args = args or AsyncGRPOConfig(output_dir="grpo-output")
        if self.args.output_dir is None:
            raise ValueError("AsyncGRPOConfig.output_dir is required")
        if tools or environment_factory:
            raise ValueError("tools and environment_factory are not supported yet: override "
                             "AsyncRolloutLoop.generate_one to run a multi-turn rollout")
        self.reward_funcs = reward_funcs if isinstance(reward_funcs, list) else (
            [reward_funcs] if reward_funcs is not None else [])
        self.rows = as_rows(train_dataset)
        self.log = log
        remote = self.args.trust_remote_code
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            self.model_path = model
            kwargs = dict(self.args.model_init_kwargs or {})
            dtype = self.args.dtype
            kwargs.setdefault("dtype", dtype if dtype == "auto" else getattr(torch, dtype))
            model = AutoModelForCausalLM.from_pretrained(
                model, local_files_only=True, trust_remote_code=remote, **kwargs)
        else:
            self.model_path = str(model.name_or_path)
        self.model = model.eval()
        if processing_class is None:
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(
                self.model_path, local_files_only=True, trust_remote_code=remote)
        self.tokenizer = processing_class
        if lora_settings(model) is None:  # fresh adapter: peft_config, else the config's r
            rank = getattr(peft_config, "r", self.args.lora_rank)
            alpha = getattr(peft_config, "lora_alpha", self.args.lora_alpha)
            lora.inject(model, rank, alpha, self.args.seed)
        if lora_path is not None:
            lora.load_peft_into(model, lora_path)
        self.rank, self.alpha = lora_settings(model)
        self.output_dir = Path(self.args.output_dir)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)

    # ------------------------------------------------------------ set-up

    def _check_picklable(self) -> None:
        things: list[tuple[str, Any]] = [
            *[(f"reward function {reward_name(f)!r}", f) for f in self.reward_funcs],
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

    def _start_server(self) -> None:
        self.server = None
        if not self.args.embedded_server:
            self.base_url = self.args.vllm_server_base_url
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        port_file, log_path = self.output_dir / "server.port", self.output_dir / "server.log"
        port_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", embedded_server.__name__, "--model", self.model_path,
                   "--port", "0", "--port-file", str(port_file),
                   "--threads", str(self.args.embedded_server_threads),
                   "--max-num-seqs", str(self.args.embedded_server_max_num_seqs),
                   "--max-loras", str(self.args.max_staleness + 2),
                   "--max-lora-rank", str(max(self.rank, 8)),
                   "--max-logprobs", str(max(self.args.num_sampler_logprobs, 1)),
                   "--dtype", self.serving_dtype(), "--seed", str(self.args.seed)]
        if self.args.trust_remote_code:
            command.append("--trust-remote-code")
        if self.args.embedded_server_max_model_len:
            command += ["--max-model-len", str(self.args.embedded_server_max_model_len)]
        self.server_log = open(log_path, "w")  # noqa: SIM115 (closed by _stop_server)
        self.server = subprocess.Popen(command, stdout=self.server_log, stderr=subprocess.STDOUT,
                                       preexec_fn=die_with_parent)  # noqa: PLW1509 (a prctl)
        started = time.monotonic()
        while not port_file.exists():
            if self.server.poll() is not None:
                raise RuntimeError(f"the embedded server exited with code "
                                   f"{self.server.returncode}:\n{log_path.read_text()[-2000:]}")
            if time.monotonic() - started > self.args.vllm_server_timeout:
                raise TimeoutError("the embedded server did not start; see " + str(log_path))
            time.sleep(0.1)
        self.base_url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.args.vllm_server_base_url = self.base_url

    def serving_dtype(self) -> str:
        """The dtype the policy was actually loaded in (model_init_kwargs may override)."""
        name = str(getattr(self.model, "dtype", "")).removeprefix("torch.")
        return name if name in ("float32", "bfloat16", "float16") else self.args.dtype

    def _stop_server(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
            self.server_log.close()
            self.server = None

    # ------------------------------------------------------------ weight versions

    def _adapter_name(self, version: int) -> str:
        return f"{self.lora_name}-v{version}"

    def _sync(self, version: int) -> float:
        """Publish `version`. The LoRA path neither pauses the server nor waits on other
        processes (one trainer), so of the seed's pause/barrier/transfer split only
        `perf/weight_sync_transfer_s` (write + load) exists here."""
        started = time.monotonic()
        directory = self.lora_dir / f"v{version}"
        shutil.rmtree(directory, ignore_errors=True)
        lora.export_peft(self.model, directory, self.model_path, self.rank, self.alpha)
        self.admin.load_lora_adapter(self._adapter_name(version), str(directory.resolve()))
        self.window.add("perf/weight_sync_transfer_s", time.monotonic() - started)
        self.version.value = version
        self.live_versions.append(version)
        while len(self.live_versions) > self.args.max_staleness + 1:
            old = self.live_versions.popleft()  # unloaded first, then deleted
            self.admin.unload_lora_adapter(self._adapter_name(old))
            shutil.rmtree(self.lora_dir / f"v{old}", ignore_errors=True)
        return time.monotonic() - started

    # ------------------------------------------------------------ checkpoints

    def _latest_checkpoint(self) -> Path:
        found = sorted(self.output_dir.glob("checkpoint-*"),
                       key=lambda p: int(p.name.split("-")[1]))
        if not found:
            raise FileNotFoundError(f"no checkpoint-* in {self.output_dir} to resume from")
        return found[-1]

    def _save_checkpoint(self) -> Path:
        directory = self.output_dir / f"checkpoint-{self.global_step}"
        with atomic_directory(directory) as scratch:
            lora.export_peft(self.model, scratch / "adapter", self.model_path, self.rank,
                             self.alpha)
            buffer = io.BytesIO()
            torch.save({"optimizer": self.optimizer.state_dict(),
                        "global_step": self.global_step, "num_tokens": self.num_tokens,
                        "torch_rng": torch.get_rng_state(), "loss_sum": self.loss_sum}, buffer)
            atomic_write_bytes(scratch / "trainer_state.pt", buffer.getvalue())
            write_json(scratch / "rollout_state.json", {
                "next_prompt_index": self.cursor,
                "consumed_after_cursor": sorted(self.done),
                "model_version": self.version.value,
                "global_step": self.global_step,
                **self.identity,
            })
        if self.args.save_total_limit:
            found = sorted(self.output_dir.glob("checkpoint-*"),
                           key=lambda p: int(p.name.split("-")[1]))
            for old in found[: -self.args.save_total_limit]:
                shutil.rmtree(old)
        return directory

    def _restore(self, checkpoint: Path) -> dict:
        state = read_json(checkpoint / "rollout_state.json")
        refuse_other_run(checkpoint, state, self.identity, self.args)
        lora.load_peft_into(self.model, checkpoint / "adapter")
        saved = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.global_step, self.num_tokens = saved["global_step"], saved["num_tokens"]
        self.loss_sum = saved["loss_sum"]
        torch.set_rng_state(saved["torch_rng"])
        return state

    # ------------------------------------------------------------ the worker

    def _spawn_worker(self, start: int, skip: list[int]) -> None:
        context = mp.get_context("spawn")
        self.buffer = context.Queue()
        self.metrics_queue = context.Queue()
        self.exception_queue = context.Queue()
        self.failed = context.Event()
        self.stop_event = context.Event()
        # single-writer values without a lock: a worker killed mid-access cannot hang us
        self.heartbeat = context.RawValue("d", time.time())
        self.allowance = context.RawValue("d", float(
            max(self.args.max_staleness, 1) * self.args.gradient_accumulation_steps
            * self.token_budget))  # before the first step: full rows
        self.queued_tokens = context.Value("q", 0)
        self.queued_samples = context.Value("q", 0)
        self.sync_state = context.RawArray("q", 2)  # worker writes: [batch complete, results]
        self.received = 0
        kwargs = {
            "config": self.args, "model_name": self.model_path, "dataset": self.rows,
            "reward_funcs": self.reward_funcs, "processing_class": self.tokenizer,
            "eos_token_ids": self.eos_token_ids, "rollout_buffer": self.buffer,
            "model_version_value": self.version, "token_allowance": self.allowance,
            "heartbeat_value": self.heartbeat, "failed_event": self.failed,
            "exception_info_queue": self.exception_queue, "metrics_queue": self.metrics_queue,
            "lora_name": self.lora_name, "dataset_start_index": start,
            "queued_tokens": self.queued_tokens, "queued_samples": self.queued_samples,
            "sync_state": self.sync_state if self.args.synchronous else None,
            "stop_event": self.stop_event,
            "skip_positions": skip}
        previous = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the child inherits it at spawn
        try:
            worker = context.Process(target=run_rollout_loop,
                                     args=(self.loop_cls, kwargs, os.getpid()),
                                     name="rollout-worker", daemon=True)
            worker.start()  # set on self only once started: _stop_worker joins it
            self.worker = worker
        finally:
            if previous is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = previous

    def _stop_worker(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is None:
            return
        self.stop_event.set()
        worker.join(timeout=10)
        if worker.is_alive():
            worker.terminate()
            worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
            worker.join()
        self.worker = None

    def _worker_failure(self) -> str | None:
        if self.failed.is_set():
            try:
                tb = self.exception_queue.get(timeout=5)
            except queue.Empty:
                tb = "(no traceback arrived)"
            return f"the rollout worker failed:\n{tb}"
        if not self.worker.is_alive():
            return f"the rollout worker exited with code {self.worker.exitcode} without a " \
                   "traceback (killed?)"
        silent = time.time() - self.heartbeat.value
        if silent > self.args.rollout_worker_timeout:
            return (f"the rollout worker sent no heartbeat for {silent:.0f} s (limit "
                    f"rollout_worker_timeout={self.args.rollout_worker_timeout:g} s): it is hung")
        return None

    def _all_arrived(self) -> bool:
        return all(p in self.arrived or p in self.done for p in range(self.cursor, self.end))

    def _next_group(self) -> GroupResult | None:
        while True:
            if self.end is not None and self.cursor >= self.end:
                self.exhausted = True
                return None
            try:
                group = self.buffer.get(timeout=0.05)
                self.received += 1
                return group
            except queue.Empty:
                if self.end is not None and self._all_arrived():
                    self.exhausted = True
                    return None  # the epoch's last groups are all here: train what is left
                if self.args.synchronous and self.sync_state[0] and (
                        self.received == self.sync_state[1]):
                    return None  # baseline: the worker's batch is all here, train on it
                failure = self._worker_failure()
                if failure:
                    raise RuntimeError(failure)

    # ------------------------------------------------------------ sample accounting

    def _resolve(self, position: int, count: int = 1) -> None:
        self.remaining[position] -= count
        if self.remaining[position] <= 0:
            del self.remaining[position]
            self.done.add(position)
            while self.cursor in self.done:
                self.done.discard(self.cursor)
                self.cursor += 1

    def _release_tokens(self, sample) -> None:
        with self.queued_tokens.get_lock():
            self.queued_tokens.value -= sample.tokens
        with self.queued_samples.get_lock():
            self.queued_samples.value -= 1

    def _next_sample(self):
        while True:
            if self.carry is not None:  # checked again: a step and a sync may have passed
                self.pending.appendleft(self.carry)
                self.carry = None
            while self.pending:
                sample = self.pending.popleft()
                stale = is_stale(self.version.value, sample.model_version,
                                 self.args.max_staleness)
                self.window.add("sample/dropped_stale_count", int(stale))  # 0s: always logged
                if stale:
                    self._release_tokens(sample)
                    self._resolve(sample.position)
                    continue
                return sample
            waited = time.monotonic()
            group = self._next_group()
            self.wait_s += time.monotonic() - waited
            if group is None:
                return None
            self.arrived.add(group.position)
            if not group.samples:
                self.remaining[group.position] = 1
                self._resolve(group.position)
            else:
                self.remaining[group.position] = len(group.samples)
                self.pending.extend(group.samples)

    def _microbatch(self) -> list:
        samples = []
        while True:
            if len(samples) >= self.batcher.max_samples:
                return samples  # full: waiting for one more group could not change it
            sample = self._next_sample()
            if sample is None:
                return samples
            oversize = self.batcher.oversize(sample)
            self.window.add("batch/dropped_oversize_count", int(oversize))
            if oversize:
                logger.warning("dropping a sample of %d tokens: over token_budget=%d",
                               sample.tokens, self.token_budget)
                self.log(f"warning: dropped a {sample.tokens}-token sample (token_budget "
                         f"{self.token_budget})")
                self._release_tokens(sample)
                self._resolve(sample.position)
                continue
            if not self.batcher.fits(samples, sample):
                self.carry = sample
                return samples
            # Taken: no longer queued. Released now, not after the step, or a step that holds
            # the whole allowance would wait for a group the worker may not start.
            # queue_size: the scored samples that were waiting, this one included
            self.window.add("rollout/queue_size", self.queued_samples.value)
            self._release_tokens(sample)
            samples.append(sample)

    # ------------------------------------------------------------ the loss

    def _loss(self, samples: list) -> tuple[torch.Tensor, dict, object]:
        args, batch = self.args, self.batcher.collate(samples)
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16
                    else contextlib.nullcontext())
        with autocast:
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                position_ids=batch.position_ids, use_cache=False,
                                logits_to_keep=batch.width + 1).logits[:, :-1]
        scores = (logits.float() / args.temperature).log_softmax(-1)
        logp = scores.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
        trained = batch.trained
        ratio, keep = importance_weights(logp.detach(), batch.sampler_logp,
                                         args.vllm_importance_sampling_clip_min,
                                         args.vllm_importance_sampling_clip_max)
        keep = keep & trained
        if args.score_centering:
            topk_logp = scores.gather(-1, batch.top_ids)
            per_token = centered_score_loss(logp, topk_logp, batch.top_sampler_logp,
                                            batch.advantages, ratio, keep)
        else:
            per_token = clipped_surrogate_loss(logp, batch.sampler_logp, batch.advantages, keep,
                                               args.epsilon, args.epsilon_high)
        loss = token_mean(per_token, trained)
        with torch.no_grad():
            t = trained
            diff = (logp.detach() - batch.sampler_logp).abs()[t]
            entropy = -(scores.exp() * scores).sum(-1)[t]
            clipped = clip_fractions(ratio, batch.advantages, t, args.epsilon,
                                     args.epsilon_high)
            stats = {
                "sampling/sampling_logp_difference/mean": diff.tolist(),
                "sampling/sampling_logp_difference/max": diff.tolist(),
                "sampling/importance_sampling_ratio/min": ratio[t].tolist(),
                "sampling/importance_sampling_ratio/mean": ratio[t].tolist(),
                "sampling/importance_sampling_ratio/max": ratio[t].tolist(),
                "sampling/masked_mean": (~keep[t]).float().tolist(),
                "entropy": entropy.tolist(),
                "clip_ratio/region_mean": clipped["region"].tolist(),
                "clip_ratio/low_mean": clipped["low"].tolist(),
                "clip_ratio/low_min": clipped["low"].tolist(),
                "clip_ratio/high_mean": clipped["high"].tolist(),
                "clip_ratio/high_max": clipped["high"].tolist(),
            }
            if args.score_centering:
                mass = batch.top_sampler_logp.exp().sum(-1)[t]
                stats["sampling/sampler_mass"] = mass.tolist()
        return loss, stats, batch

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

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        args = self.args
        self._check_picklable()
        self.lora_name = "policy"
        self.lora_dir = self.output_dir / ".vllm_lora"
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            parameters, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon, weight_decay=args.weight_decay,
            fused=args.optim == "adamw_torch_fused")
        self.identity = run_identity(args, self.rows)  # once: the rows do not change
        self.logging_every = args.steps_of("logging_steps")
        self.save_every = args.steps_of("save_steps") if args.save_strategy == "steps" else 0
        self.global_step, self.num_tokens, self.loss_sum = 0, 0, 0.0
        rows = len(self.rows)
        self.end = math.ceil(args.num_train_epochs * rows) if args.max_steps <= 0 else None
        self.cursor, self.done, self.remaining, self.arrived = 0, set(), {}, set()
        version, resumed = 0, False
        if resume_from_checkpoint:
            checkpoint = (self._latest_checkpoint() if resume_from_checkpoint is True
                          else Path(resume_from_checkpoint))
            state = self._restore(checkpoint)
            self.cursor, self.done = state["next_prompt_index"], set(
                state["consumed_after_cursor"])
            version, resumed = state["model_version"], True
            self.log(f"resumed from {checkpoint}: step {self.global_step}, next prompt "
                     f"{self.cursor}, version {version}")
        self.metrics_log = MetricsLog(self.output_dir / "metrics.jsonl", resume=resumed)
        self.version = mp.get_context("spawn").RawValue("q", version)  # trainer writes
        self.live_versions: collections.deque = collections.deque()
        self.pending, self.carry, self.exhausted = collections.deque(), None, False
        self.window, self.wait_s = MetricsWindow(), 0.0
        self.worker = None
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _terminate)
        model_state = self.model.training, checkpointing_on(self.model)
        disable_dropout(self.model)
        checkpointing(self.model, args.gradient_checkpointing)
        self.model.train(args.gradient_checkpointing)  # HF checkpoints in training mode only
        try:
            self._start_server()
            self.admin = ServerAdmin(self.base_url, args.vllm_server_timeout)
            self.admin.wait_ready(self.server, self.output_dir / "server.log")
            self.max_model_len = self.admin.max_model_len()
            self.token_budget = args.token_budget or self.max_model_len
            top = args.num_sampler_logprobs if args.score_centering else 1
            self.batcher = PaddedBatcher(self.token_budget, args.per_device_train_batch_size,
                                         top, self.tokenizer.pad_token_id or 0)
            shutil.rmtree(self.lora_dir, ignore_errors=True)
            self._sync(version)  # cold sync: the server serves this policy before any rollout
            self._spawn_worker(self.cursor, sorted(self.done))
            self._loop()
            if self.failed.is_set():  # e.g. every position arrived filtered, then it raised
                raise RuntimeError(self._worker_failure())
            final = self.output_dir / f"checkpoint-{self.global_step}"
            if args.save_strategy != "no" and not final.exists():
                self._save_checkpoint()
        finally:
            try:
                self._stop_worker()
            finally:
                self._stop_server()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            checkpointing(self.model, model_state[1])  # the caller's model as it was given
            self.model.train(model_state[0])
        mean_loss = self.loss_sum / max(1, self.global_step)
        return TrainOutput(self.global_step, mean_loss, {"train_loss": mean_loss})

    def _loop(self) -> None:
        args = self.args
        from ..progress import progress

        total = args.max_steps if args.max_steps > 0 else self.end
        bar = progress(total, "grpo", initial=self.global_step if args.max_steps > 0
                       else self.cursor)
        bar.disable = bool(args.disable_tqdm)
        while args.max_steps <= 0 or self.global_step < args.max_steps:
            step_started = time.monotonic()
            self.wait_s = 0.0
            fwd_bwd = fwd = 0.0
            samples_in_step, loss_total, forwarded, consumed = [], 0.0, 0, 0
            microbatches, costs = 0, []
            for _ in range(args.gradient_accumulation_steps):
                samples = self._microbatch()
                if not samples:
                    break
                t0 = time.monotonic()
                loss, stats, batch = self._loss(samples)
                fwd += time.monotonic() - t0
                (loss / args.gradient_accumulation_steps).backward()
                fwd_bwd += time.monotonic() - t0
                loss_total += float(loss.detach()) / args.gradient_accumulation_steps
                for name, values in stats.items():
                    self.window.extend(name, values)
                microbatches += 1
                forwarded += batch.forwarded_tokens
                costs.append(batch.attention_cost)
                consumed += sum(s.tokens for s in samples)
                self._record_batch(samples, batch)
                samples_in_step += samples
            if not samples_in_step:
                if self.exhausted:
                    break  # every prompt of the last epoch has been consumed
                time.sleep(0.01)  # synchronous baseline: the worker is starting the next batch
                continue
            # fewer micro-batches than asked (the epoch's end; in the synchronous baseline, a
            # batch thinned by dropped groups): the loss is a mean over the step's own
            if microbatches < args.gradient_accumulation_steps:
                scale = args.gradient_accumulation_steps / microbatches
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
                loss_total *= scale
            t0 = time.monotonic()
            for group in self.optimizer.param_groups:
                group["lr"] = self._learning_rate(self.global_step)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], args.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            optimizer_s = time.monotonic() - t0
            self.global_step += 1
            self.loss_sum += loss_total
            for sample in samples_in_step:
                self._resolve(sample.position)
            self.allowance.value = float(max(args.max_staleness, 1) * consumed)
            sync_s = 0.0
            if self.global_step % args.weight_sync_steps == 0:
                sync_s = self._sync(self.version.value + 1)
                self.window.add("perf/weight_sync_s", sync_s)
            step_s = time.monotonic() - step_started
            w = self.window
            w.add("loss", loss_total)
            w.add("grad_norm", float(grad_norm))
            w.add("learning_rate", self.optimizer.param_groups[0]["lr"])
            w.add("batch/forwarded_tokens_per_step", forwarded)
            trained_tokens = sum(sum(s.sequence.trained) for s in samples_in_step)
            w.add("batch/trained_tokens_per_step", trained_tokens)
            w.add("batch/samples_per_step", len(samples_in_step))
            w.add("batch/groups_per_step", len({s.position for s in samples_in_step}))
            w.add("batch/microbatches_per_step", microbatches)
            w.add("batch/row_imbalance", max(costs) / (sum(costs) / len(costs)))
            w.add("perf/step_s", step_s)
            w.add("perf/fwd_bwd_s", fwd_bwd)
            w.add("perf/fwd_s", fwd)
            w.add("perf/optimizer_s", optimizer_s)
            w.add("perf/rollout_wait_s", self.wait_s)
            w.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, fwd_bwd)
            w.add_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
            w.add_rate("perf/wall_clock_trained_tokens_per_s", trained_tokens, step_s)
            if self.global_step % self.logging_every == 0:
                self._log_window(samples_in_step)
            if self.save_every and self.global_step % self.save_every == 0:
                self._save_checkpoint()
            bar.n = self.global_step if args.max_steps > 0 else min(self.cursor, total)
            bar.refresh()
        bar.close()
        time.sleep(0.6)  # the worker ships its records every 0.5 s
        for records in drain(self.metrics_queue):
            self.window.merge(records)
        if self.window.values or self.window.rates:
            self._log_window([])

    def _record_batch(self, samples: list, batch) -> None:
        w, now = self.window, time.time()
        self.num_tokens += batch.real_tokens
        for s in samples:
            staleness = self.version.value - s.model_version
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
        w.add("batch/samples_per_row", len(samples))
        w.add("batch/row_tokens_mean", batch.forwarded_tokens)
        w.add("batch/row_tokens_max", batch.forwarded_tokens)
        w.add("batch/row_fill_frac", batch.forwarded_tokens / self.token_budget)
        w.add("batch/pad_frac", 1 - batch.real_tokens / batch.forwarded_tokens)
        w.add("batch/packing_ratio", 1.0)
        w.add("batch/masked_token_frac",
              1 - float(batch.trained.sum()) / batch.forwarded_tokens)

    def _log_window(self, samples: list) -> None:
        for records in drain(self.metrics_queue):
            self.window.merge(records)
        metrics = self.window.reduce()
        metrics["num_tokens"] = self.num_tokens
        metrics["epoch"] = self.cursor / len(self.rows)
        self.metrics_log.write(self.global_step, metrics)
        self.log(console_line(self.global_step, metrics))
        if self.args.log_completions and samples:
            count = self.args.num_completions_to_print or self.args.num_generations
            for s in samples[:count]:
                self.log(f"  [{s.reward:+.3f}] {s.completion_text!r}")
        self.window = MetricsWindow()
        self.last_metrics = metrics
