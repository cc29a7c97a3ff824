"""What `tests/test_grpo_ranks.py` runs under `torchrun --nproc-per-node N` (gloo, CPU).

    torchrun --standalone --nproc-per-node N tests/grpo_ranks_job.py gradient MODEL OUT
        one step's gradient, before the optimizer, from the trainer's own `_train_on`: N = 2
        deals the step's micro-batches to two ranks; N = 1 trains each slot's micro-batches
        as one (the same global batch); two steps: 3 micro-batches (rank 1 has one slot
        fewer), then 1 (rank 1 has none and joins the all-reduce idle), then that one again
        with average_tokens_across_devices=False (a part-filled slot still counts fully)
    torchrun --standalone --nproc-per-node N tests/grpo_ranks_job.py train MODEL OUT NAME
        [--interrupt S | --resume]: a real run (embedded server, rollout worker) of 4 steps on
        a fixed schedule; each rank writes its final policy and the samples it trained
Every rank writes `OUT/<what>-rank<R>.pt`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from reprorl.grpo.distributed import Setup, step_shares
from reprorl.grpo.steps import Step
from reprorl.model import lora

BUDGET, ROWS = 48, 1


def token_sum_reward(completion_ids, **kwargs):  # module level: the worker imports it
    return [float(sum(ids) % 7) for ids in completion_ids]


class CountingTrainer(AsyncGRPOTrainer):
    """Counts the samples this rank trained, step by step."""

    trained: list[int]

    def _train_on(self, step, own):  # own: what rank 0 scattered to this rank
        self.trained.append(sum(len(samples) for samples in own.microbatches))
        super()._train_on(step, own)


def rows(count: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"question {i}"}]} for i in range(count)]


def microbatches(samples, rows_per_batch: int) -> list[list]:
    """The samples cut into micro-batches as the queue cuts them (`batcher.fits`)."""
    from reprorl.grpo.batching import TokenBudgetBatcher

    batcher, batches = TokenBudgetBatcher(BUDGET, rows_per_batch, 2, 0), [[]]
    for sample in samples:
        if not batcher.fits(batches[-1], sample):
            batches.append([])
            assert batcher.fits(batches[-1], sample)
        batches[-1].append(sample)
    return batches


def gradient(model: str, out: Path) -> None:
    from test_grpo_packing import random_groups  # the packing tests' random groups

    args = AsyncGRPOConfig(output_dir=str(out / "gradient-run"), per_device_train_batch_size=ROWS,
                           gradient_accumulation_steps=2, logging_steps=1, disable_tqdm=True)
    trainer = AsyncGRPOTrainer(model, token_sum_reward, args, rows(4), log=lambda m: None)
    ranks = trainer.ranks
    trainer.run = trainer._new_run(None)
    trainer.forward_model = ranks.wrap(trainer.model)
    parameters = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    results = []
    for seed, wanted, across in ((7, 3, True), (8, 1, True), (8, 1, False)):
        args.average_tokens_across_devices = across  # False: each rank's own token mean
        batches = microbatches(random_groups(seed, groups=4), ROWS)[:wanted]
        assert len(batches) == wanted, len(batches)
        if ranks.world_size == 1:  # slot k's micro-batches of two ranks as one
            batches = [batches[k] + batches[k + 1] if k + 1 < len(batches) else batches[k]
                       for k in range(0, len(batches), 2)]
            args.per_device_train_batch_size = 4 * ROWS  # room for the union's rows
        trainer.run.batcher = trainer._batcher(Setup(BUDGET, 2))
        step = Step(microbatches=len(batches))
        trainer._train_on(step, step_shares(batches, ranks.world_size)[ranks.rank])
        results.append({"loss": step.loss, "slots": step.slots,
                        "grads": {n: p.grad.clone() for n, p in parameters.items()}})
        trainer.run.optimizer.zero_grad(set_to_none=True)
    torch.save(results, out / f"gradient-world{ranks.world_size}-rank{ranks.rank}.pt")


def train(model: str, out: Path, name: str, interrupt: int | None, resume: bool) -> None:
    args = AsyncGRPOConfig(
        output_dir=str(out / name), embedded_server=True, embedded_server_max_model_len=128,
        max_completion_length=8, num_generations=4, per_device_train_batch_size=1,
        token_budget=100, groups_per_step=4, learning_rate=1e-3, logging_steps=1,
        max_steps=4, save_steps=2, max_staleness=1, schedule_lag=1, disable_tqdm=True,
        vllm_server_timeout=60.0, rollout_worker_timeout=60.0)
    trainer = CountingTrainer(model, token_sum_reward, args, rows(16), log=print)
    trainer.trained = []
    result = trainer.train(resume_from_checkpoint=resume or None,
                           interrupt_after_step=interrupt)
    rank = trainer.ranks.rank
    torch.save({"policy": {k: v.clone() for k, v in lora.peft_state(trainer.model).items()},
                "trained": trainer.trained, "global_step": result.global_step,
                "loss": result.training_loss},
               out / f"{name}-rank{rank}.pt")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("gradient", "train"))
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("name", nargs="?", default="run")
    parser.add_argument("--interrupt", type=int)
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args(argv)
    if options.what == "gradient":
        gradient(options.model, options.out)
    else:
        train(options.model, options.out, options.name, options.interrupt, options.resume)


if __name__ == "__main__":
    main(sys.argv[1:])
