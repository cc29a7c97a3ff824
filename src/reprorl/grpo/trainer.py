"""`AsyncGRPOTrainer`: trains a policy on samples a spawned rollout worker streams in.

Per optimizer step: take `gradient_accumulation_steps` micro-batches off the worker's queue
(samples more than `max_staleness` versions old dropped), compute their loss
(`microbatch_loss.py`), step AdamW, set the worker's token allowance, and every
`weight_sync_steps` steps publish a new weight version to the generation server. Under
torchrun, rank 0 deals each step's micro-batches to the other ranks (`distributed.py`).
Building the trainer and starting and stopping its processes are its base's (`lifecycle.py`).
docs/grpo.md maps the other parts and says where this departs from TRL's trainer.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from . import checkpoints, schedule
from .batching import MicroBatch, record_rows
from .distributed import RankReport, Setup, StepShare, follow, lead, step_shares
from .launch import (
    refuse_unscored,
    restore_sigterm,
    unwind_on_sigterm,
)
from .lifecycle import TrainerLifecycle
from .metrics import console_line
from .microbatch_loss import microbatch_loss
from .policy import training_mode
from .rollout import AsyncRolloutLoop
from .rows import epoch_length
from .sample_queue import StalledRun
from .samples import Sample
from .steps import Step, record_samples, record_step
from .worker import drain


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict


class AsyncGRPOTrainer(TrainerLifecycle):
    """Built as `TrainerLifecycle` says (the constructor's arguments are TRL's); `train()`
    runs the steps."""

    def _save_checkpoint(self) -> Path:
        run = self.run
        run.saved = (run.global_step, run.version.value)
        folder = self.save_checkpoint_into(self.output_dir)
        self._event("on_save")
        return folder

    def save_checkpoint_into(self, folder: Path) -> Path:
        """A checkpoint of the run as it is now, `<folder>/checkpoint-<step>`, which
        `resume_from_checkpoint` continues (a caller's own copy: see `safe_point`)."""
        return checkpoints.save(Path(folder), self.run, self.args, self._export_policy,
                                self.lora_dir, self.device)

    # ------------------------------------------------------------ the loss

    def _loss(self, batch: MicroBatch, trained_tokens: int | None = None
              ) -> tuple[torch.Tensor, dict]:
        return microbatch_loss(self.model, self.args, batch, trained_tokens, self.forward_model)

    def _learning_rate(self, step: int) -> float:
        return schedule.rate(self.args, self.lr_schedule, step)

    # ------------------------------------------------------------ training

    def train(self, resume_from_checkpoint: str | bool | None = None, *,
              interrupt_after_step: int | None = None,
              safe_point: Callable[[int, bool], None] | None = None) -> TrainOutput:
        """Train to the end of the run, or (`interrupt_after_step`) stop after that optimizer
        step and save a checkpoint there: the run's schedule and end stay those of the whole
        run (as `max_steps` would not), so `resume_from_checkpoint` later finishes it.
        `safe_point(step, window_end)` is called after each optimizer step; at a metrics
        window's end (`window_end`) a checkpoint (`save_checkpoint_into`) continues the run
        with the same bytes, and an exception raised there stops it (the pipeline's
        in-rule checkpoints, `core/preempt.py`)."""
        args = self.args
        if interrupt_after_step is not None and args.save_strategy == "no":
            raise ValueError("interrupt_after_step needs a checkpoint to resume from: "
                             "save_strategy='no' writes none; use save_strategy='steps'")
        refuse_unscored(self.reward_funcs, self.env_owns_reward, self.loop_cls,
                        AsyncRolloutLoop.generate_one)
        self._check_picklable()
        run = self.run = self._new_run(resume_from_checkpoint)
        run.interrupt_after_step, self.safe_point = interrupt_after_step, safe_point
        previous = unwind_on_sigterm()  # SIGTERM unwinds this call: its finally stops them
        with training_mode(self.model, args.gradient_checkpointing):  # restored after
            self.forward_model = self.ranks.wrap(self.model)  # every rank: DDP syncs them here
            if self.ranks.distributed and self.ranks.main:
                timeout = ("" if self.ranks.timeout_s is None
                           else f", ddp_timeout {self.ranks.timeout_s:g} s")
                self.log(f"trainer ranks: {self.ranks.world_size} "
                         f"({self.ranks.backend}{timeout})")
            try:
                if self.ranks.main:
                    lead(self.channel, self._lead, self.log)
                else:
                    run.loss_sum = follow(self.channel, self._set_up, self._train_share)
            finally:
                self._stop_processes()
                self.forward_model = self.model
                restore_sigterm(previous)
        mean_loss = run.loss_sum / max(1, run.global_step)
        return TrainOutput(run.global_step, mean_loss, {"train_loss": mean_loss})

    def _lead(self) -> float:
        """Rank 0 (the only rank without torchrun): the processes, the steps, the final
        checkpoint; returns the summed step losses (`distributed.lead` tells the others)."""
        run, args = self.run, self.args
        self.callback_handler.optimizer = run.optimizer
        self._update_state()
        self.state.log_history = run.metrics_log.records()  # a resume's windows before it
        self._event("on_train_begin")
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
        self._event("on_train_end")
        return run.loss_sum

    def _set_up(self, setup: Setup) -> None:
        """A rank other than 0: what it needs before the first step, from rank 0."""
        self.run.batcher = self._batcher(setup)

    def _train_share(self, share: StepShare) -> None:
        """A rank other than 0: one step on the micro-batches rank 0 dealt it."""
        step = Step(microbatches=sum(share.slot_ranks))
        self._train_on(step, share)
        self._optimizer_step(step)

    def _loop(self) -> None:
        """Optimizer steps until max_steps, or until the epochs' prompts are all consumed. A
        fixed schedule steps once per block of `groups_per_step` positions (version N trained
        blocks 0..N-1, and a block whose groups all dropped publishes the same weights)."""
        run, args = self.run, self.args
        bar, fixed = self._progress_bar(), args.schedule_lag is not None
        begun = False  # on_step_begin once per optimizer step (an empty block is no step)
        while ((args.max_steps <= 0 or run.global_step < args.max_steps)
               and run.global_step != run.interrupt_after_step):  # a resume from there: done
            if not begun:
                self._event("on_step_begin")
                begun = True
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
                run.link.position_limit.value = self._position_limit()  # one more block
                continue
            self._optimizer_step(step)
            begun = False
            for sample in step.samples:
                run.ledger.consume(sample.position)
            # the worker may keep max(max_staleness, 1) steps' worth of tokens in the pipeline
            run.link.allowance.value = float(max(args.max_staleness, 1) * step.sample_tokens)
            if run.global_step % args.weight_sync_steps == 0:
                step.sync_s = self._sync(run.version.value + 1)
            self._record_step(step, time.monotonic() - started)
            self._update_state()
            # DefaultFlowCallback asks for a window every logging_steps, a checkpoint every
            # save_steps, and the end at max_steps; the caller's callbacks may change that
            self._event("on_step_end")
            window_end = self.control.should_log
            if self.control.should_log:
                self._log_window(step.samples)
            if self.control.should_evaluate:
                raise RuntimeError("a callback set control.should_evaluate, but evaluation is "
                                   "not implemented (no eval_dataset): leave it False")
            if self.control.should_save:
                self._save_checkpoint()
            self._advance(bar)
            if self.safe_point is not None:
                self.safe_point(run.global_step, window_end)
            if self.control.should_training_stop:
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
            own = self.channel.deal(step_shares(batches, ranks.world_size))
            self._train_on(step, own)
            record_samples(run.window, step.samples, run.version.value, taken_at)
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
        reports = self.channel.report(report)
        if ranks.main:
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
        self._event("on_pre_optimizer_step")
        run.optimizer.step()
        self._event("on_optimizer_step")
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

    # ------------------------------------------------------------ metrics

    def _record_step(self, step: Step, step_s: float) -> None:
        record_step(self.run.window, step, step_s)

    def _merge_worker_metrics(self) -> None:
        for records in drain(self.run.link.metrics):
            self.run.window.merge(records)

    def _log_window(self, samples: list[Sample]) -> None:
        run = self.run
        self._merge_worker_metrics()
        metrics = run.window.reduce()
        run.window.clear()
        metrics["num_tokens"] = run.num_tokens
        if epoch_length(self.rows):  # a stream's is not known
            metrics["epoch"] = self._epoch()
        record = run.metrics_log.write(run.global_step, metrics)
        self.log(console_line(run.global_step, metrics))
        self.state.log_history.append(record)
        self._event("on_log", logs={k: v for k, v in record.items()
                                    if k != "step" and v is not None})
        if self.args.log_completions and samples:
            count = self.args.num_completions_to_print or self.args.num_generations
            for s in samples[:count]:
                self.log(f"  [{s.reward:+.3f}] {s.completion_text!r}")

    def _epoch(self) -> float | None:
        """Epochs consumed, by the resume cursor (None for a stream, whose length is not
        known)."""
        if not epoch_length(self.rows):
            return None
        cursor = checkpoints.cursor_state(self.run.ledger, self.run.version.value, self.args)
        return cursor["next_prompt_index"] / epoch_length(self.rows)

    def _update_state(self) -> None:
        """The run's counters into the `TrainerState` the callbacks read."""
        run = self.run
        self.state.global_step, self.state.epoch = run.global_step, self._epoch()
        self.state.num_input_tokens_seen = run.num_tokens

    def _event(self, name: str, **kwargs) -> None:
        """Call every callback's `name` (rank 0 alone), keeping the control they return."""
        if self.ranks.main:
            self.control = getattr(self.callback_handler, name)(
                self.args, self.state, self.control, **kwargs)

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
