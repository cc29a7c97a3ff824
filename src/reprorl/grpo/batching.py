"""Micro-batches within a token budget: `TokenBudgetBatcher` packs samples into tree rows.

A micro-batch is up to `per_device_train_batch_size` rows; a row is a prefix trie of its
samples (`packing.py`) holding at most `token_budget` tokens, a token shared by several samples
counted once, so how many samples a row holds is decided by the budget. A sample is placed,
in the order the queue offers it (the same samples in the same order give the same rows):
1. in the row that holds its group (its prompt is there already), if it fits;
2. else in a new row, while the micro-batch has one left;
3. else, for a sample of a new group, in the fitting row whose attention cost (query-key
   pairs under the tree mask) stays lowest, which balances the rows; a sample whose group's
   row is full goes only to a fitting row that does not become the costliest (splitting a
   group forwards its prompt twice); otherwise it does not fit and the micro-batch closes.
A sample longer than `token_budget` fits no row: `oversize` tells the queue to drop it.

`MicroBatch` is what the loss reads: the forward's inputs (`input_ids`, `attention_mask`,
`position_ids`), the positions whose logits are needed (`keep`, passed as `logits_to_keep`),
and per sample the loss columns (B, W) as in the padded layout that came before packing, right-
aligned to each sample's end, so every per-token tensor of the loss is the same whatever the
layout; `index` maps each column to the logits that predict it. `pad_collate` builds that
padded layout, one left-padded row per sample: the reference the tests and
`benchmarks/packing.py` compare packing against.

Departures from the source document (TRL's TokenBudgetBatcher): one process, so a
micro-batch's rows are forwarded together as one sequence (rows still bound the trie that
shares tokens, and balance the cost as ranks would); `full` says when waiting for another
group could not add to the micro-batch (no row has room for a sample as short as the shortest
taken), so a free-running step does not wait for a sample that cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import Row, attention_pairs, lay_out


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (R, L): packed (1, T); padded (B, L)
    attention_mask: torch.Tensor  # packed: (1, 1, T, T) bool tree mask; padded: (B, L)
    position_ids: torch.Tensor  # (R, L)
    keep: torch.Tensor  # (N,) positions whose logits the loss reads
    index: torch.Tensor  # (B, W) row of each loss column in the (R * N, V) logits
    trained: torch.Tensor  # (B, W) bool
    targets: torch.Tensor  # (B, W) the token of each column
    sampler_logp: torch.Tensor  # (B, W)
    top_ids: torch.Tensor  # (B, W, K) sampler top tokens (0 where missing)
    top_sampler_logp: torch.Tensor  # (B, W, K) their sampler log-probs (-inf where missing)
    advantages: torch.Tensor  # (B,)
    row_tokens: list[int]  # tokens forwarded per row
    row_samples: list[int]  # samples per row
    row_costs: list[int]  # attention pairs per row
    sample_tokens: int  # the samples' tokens before packing
    padding: int  # pad tokens in input_ids
    trained_positions: int  # forwarded positions that hold a trained token

    @property
    def forwarded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return self.forwarded_tokens - self.padding


def _first_trained(sample) -> int:
    first = sample.sequence.trained.index(1)
    if first == 0:
        raise ValueError("a sample's first token cannot be trained: no position predicts it")
    return first


def loss_columns(samples: list, top_k: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The loss's per-token tensors, (B, W): column c of sample b is its token n_b - W + c,
    W the longest span from a sample's first trained token to its end (pads before a shorter
    sample's tokens: target pad_id, untrained)."""
    width = max(s.tokens - _first_trained(s) for s in samples)
    rows = len(samples)
    trained = torch.zeros((rows, width), dtype=torch.bool)
    targets = torch.full((rows, width), pad_id, dtype=torch.long)
    sampler = torch.zeros((rows, width))
    top_ids = torch.zeros((rows, width, top_k), dtype=torch.long)
    top_logp = torch.full((rows, width, top_k), float("-inf"))
    for b, s in enumerate(samples):
        seq, start = s.sequence, max(0, s.tokens - width)
        column = width - (s.tokens - start)
        targets[b, column:] = torch.tensor(seq.input_ids[start:])
        trained[b, column:] = torch.tensor(seq.trained[start:], dtype=torch.bool)
        sampler[b, column:] = torch.tensor(seq.sampler_logprobs[start:])
        for c, top in enumerate(seq.sampler_top[start:], start=column):
            if top:
                best = sorted(top.items(), key=lambda kv: -kv[1])[:top_k]
                top_ids[b, c, : len(best)] = torch.tensor([k for k, _ in best])
                top_logp[b, c, : len(best)] = torch.tensor([v for _, v in best])
    return {"trained": trained, "targets": targets, "sampler_logp": sampler,
            "top_ids": top_ids, "top_sampler_logp": top_logp,
            "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32)}


class Plan:
    """Rows being filled, and where each sample went."""

    def __init__(self, budget: int, rows: int):
        self.budget, self.max_rows = budget, rows
        self.rows: list[Row] = []
        self.samples: list = []
        self.where: list[tuple[int, int]] = []  # per sample: (row, its place in the row)
        self.home: dict[int, int] = {}  # prompt position -> the row its group went to first

    def choose(self, sample) -> int | None:
        """The row `sample` goes to (len(rows): a new one), or None: it does not fit."""
        ids = sample.sequence.input_ids
        if len(ids) > self.budget:
            return None
        added = [row.added(ids) for row in self.rows]
        fitting = [r for r, (new, _) in enumerate(added)
                   if self.rows[r].tokens + new <= self.budget]
        home = self.home.get(sample.position)
        if home in fitting:
            return home
        if len(self.rows) < self.max_rows:
            return len(self.rows)
        if home is not None:  # its group's row is full: never make the costliest row costlier
            top = max(row.cost for row in self.rows)
            fitting = [r for r in fitting if self.rows[r].cost + added[r][1] <= top]
        return min(fitting, key=lambda r: (self.rows[r].cost + added[r][1], r), default=None)

    def place(self, sample) -> bool:
        row = self.choose(sample)
        if row is None:
            return False
        if row == len(self.rows):
            self.rows.append(Row())
        self.rows[row].add(sample)
        self.home.setdefault(sample.position, row)
        self.samples.append(sample)
        self.where.append((row, len(self.rows[row].samples) - 1))
        return True


class TokenBudgetBatcher:
    def __init__(self, token_budget: int, rows: int, top_k: int, pad_id: int):
        self.token_budget, self.rows = token_budget, rows
        self.top_k, self.pad_id = max(top_k, 1), pad_id
        self._last: Plan | None = None  # the plan of the latest samples asked about

    @property
    def capacity(self) -> int:
        """Forwarded tokens of a full micro-batch."""
        return self.rows * self.token_budget

    def oversize(self, sample) -> bool:
        return sample.tokens > self.token_budget

    def fits(self, samples: list, sample) -> bool:
        """Whether `sample` joins `samples`' micro-batch (it is then placed: the queue appends
        it, and the next call finds the plan made)."""
        return self._plan(samples).place(sample)

    def full(self, samples: list) -> bool:
        if not samples:
            return False
        plan, shortest = self._plan(samples), min(s.tokens for s in samples)
        return len(plan.rows) == self.rows and all(
            self.token_budget - row.tokens < shortest for row in plan.rows)

    def _plan(self, samples: list) -> Plan:
        last = self._last
        if last is None or len(last.samples) != len(samples) or any(
                a is not b for a, b in zip(last.samples, samples)):
            last = Plan(self.token_budget, self.rows)
            for sample in samples:
                if not last.place(sample):
                    raise ValueError(f"these {len(samples)} samples do not fit {self.rows} rows "
                                     f"of {self.token_budget} tokens: ask fits() first")
            self._last = last
        return last

    def collate(self, samples: list) -> MicroBatch:
        plan = self._plan(samples)
        ids, positions, mask, indices = lay_out(plan.rows)
        columns = loss_columns(samples, self.top_k, self.pad_id)
        trained = columns["trained"]
        width = trained.shape[1]
        predictor = torch.zeros(trained.shape, dtype=torch.long)  # index of the token before
        seen = set()  # forwarded positions of trained tokens (shared ones once)
        for b, (s, (row, k)) in enumerate(zip(samples, plan.where)):
            where = indices[row][k]
            for c in range(width):
                j = s.tokens - width + c
                if trained[b, c]:
                    predictor[b, c] = where[j - 1]
                    seen.add(where[j])
        keep = torch.unique(predictor[trained])  # sorted; every sample has a trained token
        index = torch.where(trained, torch.searchsorted(keep, predictor), 0)
        return MicroBatch(ids, mask, positions, keep, index, **columns,
                          row_tokens=[row.tokens for row in plan.rows],
                          row_samples=[len(row.samples) for row in plan.rows],
                          row_costs=[row.cost for row in plan.rows],
                          sample_tokens=sum(s.tokens for s in samples), padding=0,
                          trained_positions=len(seen))


def pad_collate(samples: list, top_k: int, pad_id: int) -> MicroBatch:
    """The layout before tree packing: one left-padded row per sample, every prompt
    forwarded once per sample and the pads with it."""
    top_k = max(top_k, 1)
    length = max(s.tokens for s in samples)
    rows = len(samples)
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, length), dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, length - s.tokens:] = torch.tensor(s.sequence.input_ids)
        attention[r, length - s.tokens:] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    columns = loss_columns(samples, top_k, pad_id)
    width = columns["trained"].shape[1]
    keep = torch.arange(length - width - 1, length - 1)  # column c is predicted one earlier
    index = torch.arange(rows * width).view(rows, width)
    total = sum(s.tokens for s in samples)
    return MicroBatch(ids, attention, positions, keep, index, **columns,
                      row_tokens=[length] * rows, row_samples=[1] * rows,
                      row_costs=[attention_pairs(length)] * rows, sample_tokens=total,
                      padding=rows * length - total,
                      trained_positions=int(columns["trained"].sum()))
