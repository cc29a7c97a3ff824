"""The prompts a run draws from: a map-style dataset held as rows, or a stream.

A map-style dataset (a list of dicts, a Hugging Face `Dataset`, a pandas frame) becomes plain
dicts, checked once; each epoch visits them in a seeded order (`epoch_order`). A stream (a
Hugging Face `IterableDataset`, or any re-iterable object without `__len__`) is never held in
memory: the rollout worker reads it row by row, in its own order, and starts it again at its
end (calling `set_epoch(epoch)` when it has one, as `IterableDataset.shuffle` expects); its
rows are checked as they are read, off the worker's event loop. Positions count rows in
reading order across epochs, so a resume at position p reads and drops the first p rows again
(it keeps none of them): a stream that yields the same rows in the same order resumes exactly.
A stream has no length: the run's length is `max_steps`, an epoch metric is not logged, and a
checkpoint cannot prove it resumes the same stream (its identity names the stream's type only).
An environment without a dataset draws from an endless stream of empty rows (`EmptyRows`).
"""

from __future__ import annotations

import functools

import numpy as np


class StreamRows:
    """A dataset read as a stream (see the module docstring)."""

    def __init__(self, dataset, prompt_optional: bool = False):
        self.dataset, self.prompt_optional = dataset, prompt_optional  # optional: environments

    def first(self) -> dict:
        for row in self.dataset:
            return checked_row(row, "the stream's first row", self.prompt_optional)
        raise ValueError("train_dataset (a stream) yields no row")

    def positions(self, start: int):
        """(position, epoch, index in the epoch, the same index, row) from `start` on."""
        position, epoch = 0, 0
        while True:
            if callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(epoch)
            index = -1
            for index, row in enumerate(self.dataset):
                if position >= start:
                    yield position, epoch, index, index, checked_row(
                        row, f"stream row {index}", self.prompt_optional)
                position += 1
            if index < 0:
                raise ValueError("train_dataset (a stream) yields no row")
            epoch += 1


class EmptyRows:
    """Rows without columns, without end: an environment that makes its own tasks."""

    def __iter__(self):
        while True:
            yield {}


# a stream has no epoch to judge a stall by: this many positions without a trained sample
STREAM_STALL_POSITIONS = 1024


def epoch_length(rows) -> int | None:
    """Rows per epoch; None for a stream (its length is not known)."""
    return None if isinstance(rows, StreamRows) else len(rows)


def first_row(rows) -> dict:
    return rows.first() if isinstance(rows, StreamRows) else rows[0]


def is_stream(dataset) -> bool:
    return not hasattr(dataset, "__len__") and hasattr(dataset, "__iter__")


def checked_row(row, where: str, prompt_optional: bool = False) -> dict:
    row = dict(row)
    prompt = row.get("prompt")
    if prompt_optional and prompt is None:
        return row
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
        raise ValueError(f"train_dataset {where}: 'prompt' must be a conversation, a list "
                         "of {'role': ..., 'content': ...} messages")
    return row


def as_rows(dataset, factories: dict | None = None, max_steps: int = -1):
    """Rows with a conversational `prompt` column, as plain dicts, or a `StreamRows`. With an
    environment the prompt may be left to its reset() (an empty user message before it), and
    one environment for every row may go without a dataset: a stream of empty rows, as long
    as `max_steps` (the environment makes each task)."""
    if dataset is None and factories and None in factories:
        if max_steps <= 0:
            raise ValueError("an environment_factory without a train_dataset sets the run's "
                             "length by max_steps: set max_steps > 0")
        return StreamRows(EmptyRows(), prompt_optional=True)
    if dataset is None:
        raise ValueError("train_dataset is required (rows with a conversational 'prompt'"
                         + (", and an 'environment' column naming each row's environment)"
                            if factories else ")"))
    if is_stream(dataset):
        if max_steps <= 0:
            raise ValueError("train_dataset is a stream (no length), so the run's length is "
                             "max_steps: set max_steps > 0")
        if iter(dataset) is dataset:
            raise ValueError("train_dataset is a one-shot iterator (a generator or iter(...)): "
                             "a stream is read again each epoch and by the worker process; "
                             "pass an object whose __iter__ starts it over (an IterableDataset)")
        return StreamRows(dataset, bool(factories))
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # pandas
        rows = dataset.to_dict("records")
    else:
        rows = [dict(row) for row in dataset]
    if not rows:
        raise ValueError("train_dataset is empty")
    return [checked_row(row, f"row {i}", bool(factories)) for i, row in enumerate(rows)]


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, rows: int, shuffle: bool = True) -> tuple[int, ...]:
    """The rows of an epoch: a seeded random order (`train_sampling_strategy="random"`) or the
    dataset's (`"sequential"`). Positions count through it, so a resume cursor names the same
    prompt in any process."""
    if not shuffle:
        return tuple(range(rows))
    return tuple(int(i) for i in np.random.default_rng([seed, epoch]).permutation(rows))


def map_positions(rows: list[dict], start: int, seed: int, shuffle: bool):
    """(position, epoch, index in the epoch, row index, row) from `start` on, forever, each
    epoch in its order."""
    position = start
    while True:
        epoch, index = divmod(position, len(rows))
        row_index = epoch_order(seed, epoch, len(rows), shuffle)[index]
        yield position, epoch, index, row_index, rows[row_index]
        position += 1
