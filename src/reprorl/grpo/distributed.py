"""Training across ranks with `torch.distributed`: DDP, launched by `torchrun`.

`torchrun --nproc-per-node N script.py` starts N trainer processes (ranks), each holding the
whole policy; DDP all-reduces their gradients, so every rank steps the same AdamW on the same
gradient and the copies stay equal. Rank 0 alone owns the rollout worker, the server
connection, weight sync, checkpoints and metrics. Each step it takes N times one rank's
micro-batches off the queue and sends each rank its own in one pickled scatter (`Ranks.scatter`
of `step_shares`): micro-batch i is rank i % N's, in accumulation slot i // N (`deal`), with,
per slot, only the trained tokens and the number of ranks there (what its loss needs). Slot k's
loss is normalised by the trained tokens of slot k's micro-batches on every rank
(`average_tokens_across_devices`), so N ranks compute the gradient one rank computes when each
slot's micro-batches are one (tests/test_grpo_ranks.py). A rank dealt no micro-batch forwards
one pad token with a zero loss, so that DDP's all-reduce still hears from every rank.

Messages from rank 0, all scattered, in order: a `Setup` once the server answers (the
batcher's budget), per step each rank's `StepShare`, at the end `Finished`, or `Abort` when
rank 0 failed while the others waited. Collectives per step: that scatter, DDP's all-reduce in
the last backward, and a gather of each rank's loss, token counts and metric records
(`RankReport`) to rank 0, which logs them. `Channel` sends and receives them; `lead` and
`follow` are the two sides of a run. docs/grpo.md lists where it departs from the seed.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from reprorl.core import devices


@dataclass
class Setup:
    """What the other ranks need before the first step, known once the server answers."""

    token_budget: int
    top_k: int


@dataclass
class Finished:
    loss_sum: float  # the run's summed step losses, as rank 0 logged them


@dataclass
class Abort:
    reason: str  # rank 0's error


class LeaderFailed(RuntimeError):
    """Raised on the other ranks when rank 0 failed (its error in the message)."""


@dataclass
class StepShare:
    """One rank's part of a step: its micro-batches (slot order) and, per accumulation slot of
    the step, the trained tokens of every rank's micro-batch there and how many ranks have one
    (the loss's denominator and weight)."""

    microbatches: list
    slot_tokens: list[int]
    slot_ranks: list[int]


@dataclass
class RankReport:
    """One rank's part of a step, gathered to rank 0."""

    loss: float  # its micro-batches' loss terms, as they entered the gradient (before DDP)
    forwarded_tokens: int
    real_tokens: int
    records: list = field(default_factory=list)  # ("value"|"rate", name, payload)


@dataclass
class Ranks:
    """This process's place among the trainer ranks (one rank, rank 0 of 1, without torchrun)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None  # the process group's, when there is one
    timeout_s: float | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def share(self, message=None):
        """Rank 0's `message` on every rank (the others pass nothing)."""
        if not self.distributed:
            return message
        box = [message if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def scatter(self, messages: list | None = None):
        """`messages[r]` on rank r: rank 0 passes one message per rank, the others nothing."""
        if not self.distributed:
            return messages[0]
        box = [None]
        dist.scatter_object_list(box, messages if self.main else None, src=0)
        return box[0]

    def gather(self, report) -> list | None:
        """Every rank's `report` on rank 0, in rank order (None on the others)."""
        if not self.distributed:
            return [report]
        reports = [None] * self.world_size if self.main else None
        dist.gather_object(report, reports, dst=0)
        return reports

    def wrap(self, model):
        """The module the loss forwards through: DDP across ranks, the model itself alone.
        Buffers are synced once, not at every forward: no rank changes them, and a sync
        would make every rank forward as often as the others."""
        if not self.distributed:
            return model
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # torch 2.13 renamed broadcast_buffers (deprecated there) to forward_sync_buffers
        known = inspect.signature(DistributedDataParallel).parameters
        name = ("forward_sync_buffers" if "forward_sync_buffers" in known
                else "broadcast_buffers")
        device = devices.of(model)
        ids = {"device_ids": [device.index]} if device.type == "cuda" else {}
        return DistributedDataParallel(model, **{name: False}, **ids)


_JOINED: dict = {}  # the backend and timeout this process joined its group with


def ranks_from_env(backend: str | None = None, timeout_s: float | None = None,
                   device=None) -> Ranks:
    """The ranks `torchrun` started (WORLD_SIZE, RANK, MASTER_ADDR/PORT in the environment),
    joining their process group on first use (unless given: NCCL for a model on a GPU
    `device`, else gloo; 1800 s); one rank when none was started. A later call that asks for
    another backend or timeout than the group was joined with is refused (None asks for
    nothing): the first caller decides them, and a silent mismatch would leave a profile's
    `ddp_timeout` unused."""
    if not dist.is_available():
        return Ranks()
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return Ranks()
        on_gpu = getattr(device, "type", "cpu") == "cuda"
        _JOINED.update(backend=backend or ("nccl" if on_gpu else "gloo"),
                       timeout_s=timeout_s or 1800.0)
        dist.init_process_group(_JOINED["backend"],
                                timeout=timedelta(seconds=_JOINED["timeout_s"]))
        atexit.register(_leave)
    elif _JOINED and (backend not in (None, _JOINED["backend"]) or timeout_s not in (
            None, _JOINED["timeout_s"])):
        raise RuntimeError(f"the trainer ranks joined their process group with "
                           f"{_JOINED['backend']} and a {_JOINED['timeout_s']:g} s timeout; "
                           f"{backend} and {timeout_s} s asked later cannot apply: "
                           "pass ddp_backend and ddp_timeout to the first ranks_from_env call")
    # a group the caller joined itself: its backend is known, its timeout is not
    return Ranks(dist.get_rank(), dist.get_world_size(),
                 _JOINED.get("backend", dist.get_backend()), _JOINED.get("timeout_s"))


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _JOINED.clear()  # a group joined later has its own settings


def deal(batches: list, world_size: int, rank: int) -> list:
    """`rank`'s micro-batches of a step, in slot order: micro-batch i is rank i % N's."""
    return batches[rank::world_size]


def by_slot(batches: list, world_size: int) -> list[list]:
    """A step's micro-batches per accumulation slot (slot k: micro-batches kN .. kN + N - 1,
    one per rank); as many slots as the busiest rank has micro-batches."""
    return [batches[k:k + world_size] for k in range(0, len(batches), world_size)]


def trained_tokens(slot: list) -> int:
    """The trained tokens of a slot's micro-batches on every rank: the loss's denominator
    under `average_tokens_across_devices`."""
    return sum(sum(s.sequence.trained) for samples in slot for s in samples)


def step_shares(batches: list, world_size: int) -> list[StepShare]:
    """Each rank's `StepShare` of a step's micro-batches, in rank order."""
    slots = by_slot(batches, world_size)
    tokens, counts = [trained_tokens(slot) for slot in slots], [len(slot) for slot in slots]
    return [StepShare(deal(batches, world_size, rank), tokens, counts)
            for rank in range(world_size)]


class Channel:
    """Rank 0's messages to the other ranks, on every rank. Rank 0 tells them of its failure
    (`Abort`) only while they wait for its next message: from a step's scatter until its
    gather they sit in collectives, where no message reaches them (`others_wait`)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.others_wait = True  # rank 0: whether the other ranks wait for its next message

    def tell(self, message) -> None:
        """Rank 0: the same `message` to every other rank."""
        self.ranks.scatter([message] * self.ranks.world_size)

    def receive(self):
        """A rank other than 0: rank 0's next message; an `Abort` raises `LeaderFailed`."""
        message = self.ranks.scatter()
        if isinstance(message, Abort):
            raise LeaderFailed(f"rank 0 stopped the run: {message.reason}")
        return message

    def deal(self, shares: list[StepShare]) -> StepShare:
        """Rank 0: each rank its share of a step (`step_shares`); returns rank 0's own."""
        self.others_wait = False  # from the scatter on, they wait in a collective
        return self.ranks.scatter(shares)

    def report(self, report: RankReport) -> list[RankReport] | None:
        """Every rank: its report of the step, gathered to rank 0 (in rank order; None on the
        others)."""
        reports = self.ranks.gather(report)
        if self.ranks.main:
            self.others_wait = True  # a failure from here on: they wait for a message
        return reports


def lead(channel: Channel, run: Callable[[], float], log) -> None:
    """Rank 0 (the only rank without torchrun): `run()` (the processes, the steps, the final
    checkpoint) returns the run's summed step losses, sent as `Finished`. The other ranks,
    waiting for a message when it fails, are told why."""
    channel.others_wait = True  # False from a step's micro-batches to its optimizer step
    try:
        loss_sum = run()
    except BaseException as error:
        if channel.ranks.distributed and channel.others_wait:
            try:
                channel.tell(Abort(f"{type(error).__name__}: {error}"))
            except RuntimeError as lost:  # they are gone already: the error stands
                log(f"warning: the other ranks were not told: {lost}")
        raise
    channel.tell(Finished(loss_sum))


def follow(channel: Channel, set_up: Callable[[Setup], None],
           train: Callable[[StepShare], None]) -> float:
    """A rank other than 0: `set_up(setup)` with rank 0's `Setup`, then `train(share)` on each
    step's share it deals this rank, until `Finished`; returns the step losses rank 0 added up
    over every rank."""
    set_up(channel.receive())
    while not isinstance(message := channel.receive(), Finished):
        train(message)
    return message.loss_sum
