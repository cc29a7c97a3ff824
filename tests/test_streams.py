"""A stream as train_dataset (issue 13, item 6): read row by row in the worker, never held in
memory, restarted at its end with set_epoch, resumed at the cursor; real worker and server."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from test_grpo import BASE, checkpoint_bytes, read_metrics, token_sum_reward

from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from reprorl.grpo.rows import StreamRows, as_rows


class EndlessPrompts:
    """A stream without an end (`list(stream)` would never return)."""

    def __iter__(self):
        for i in itertools.count():
            yield {"prompt": [{"role": "user", "content": f"question {i % 5}"}], "n": i}


class ShortStream:
    """Three rows, reshuffled by set_epoch as Hugging Face's IterableDataset.shuffle is."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = [0, 1, 2] if self.epoch % 2 == 0 else [2, 1, 0]
        for i in order:
            yield {"prompt": [{"role": "user", "content": f"row {i}"}], "n": i}


def test_a_stream_is_kept_lazy_and_needs_max_steps():
    with pytest.raises(ValueError, match="stream.*set max_steps > 0"):
        as_rows(EndlessPrompts())
    rows = as_rows(EndlessPrompts(), max_steps=3)
    assert isinstance(rows, StreamRows) and rows.first()["n"] == 0
    short = as_rows(ShortStream(), max_steps=3)
    read = [(p, e, i, row["n"]) for p, e, i, _, row in itertools.islice(short.positions(2), 5)]
    assert read == [(2, 0, 2, 2), (3, 1, 0, 2), (4, 1, 1, 1), (5, 1, 2, 0), (6, 2, 0, 0)]
    with pytest.raises(ValueError, match="stream row 0: 'prompt'"):
        next(as_rows(iter_of({"text": "no prompt"}), max_steps=1).positions(0))


class iter_of:  # noqa: N801 (used as a value)
    def __init__(self, row):
        self.row = row

    def __iter__(self):
        yield self.row


@pytest.mark.timeout(300)
def test_an_endless_stream_trains_and_resumes_byte_for_byte(tiny_model, tmp_path):
    def run(name, resume=False, interrupt=None):
        args = AsyncGRPOConfig(output_dir=str(tmp_path / name), **{
            **BASE, "max_steps": 3, "save_steps": 1, "schedule_lag": 1})
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                                   args=args, train_dataset=EndlessPrompts(),
                                   log=lambda message: None)
        trainer.train(resume_from_checkpoint=resume or None, interrupt_after_step=interrupt)
        return Path(args.output_dir)

    whole = run("whole")
    lines = [w for w in read_metrics(whole) if "loss" in w]
    assert len(lines) == 3 and all("epoch" not in w for w in lines)
    run("parts", interrupt=1)
    parts = run("parts", resume=True)
    assert checkpoint_bytes(whole / "checkpoint-3") == checkpoint_bytes(parts / "checkpoint-3")
