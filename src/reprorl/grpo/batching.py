"""Micro-batches within a token budget: `TokenBudgetBatcher` packs samples into tree rows.

A micro-batch is up to `per_device_train_batch_size` rows, each a prefix trie of its samples
(`packing.py`) of at most `token_budget` tokens, a shared token counted once. Samples are placed
in queue order (the same samples in the same order give the same rows); a sample goes
1. to the row that holds its group (its prompt is there already), if it fits;
2. if that row is full: to a new row while the micro-batch has one left, else to a fitting row
   that does not become the costliest (splitting a group forwards its prompt twice), cost
   being the query-key pairs under the tree mask;
3. if its group is new: where it adds the fewest tokens (a shared system prompt or template
   opening), then where the cost stays lowest (with nothing shared, a new row while there is
   one, else the cheapest row, which balances the rows); a row with room for its whole group
   (`group_samples` samples) comes first;
otherwise the micro-batch closes. `oversize` tells the queue to drop a sample longer than
`token_budget`; `full` says no row has room for a sample as short as the shortest taken, so a
free-running step does not wait for a sample that cannot fit.

`MicroBatch` is what the loss reads: one forward per row (input ids, tree mask, position ids,
the kept positions `keep`, passed as `logits_to_keep`) and per sample the right-aligned loss
columns (B, W) of the padded layout (`pad_collate`, the reference of the tests and
`benchmarks/packing.py`), which `index` maps to the kept logits that predict them.
docs/grpo.md lists where it departs from TRL's TokenBudgetBatcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reprorl.model.encoding import OnDevice

from .metrics import MetricsWindow
from .packing import Row, attention_pairs, lay_out


@dataclass
class Forward(OnDevice):
    input_ids: torch.Tensor  # (R, L): a tree row (1, L); padded rows (B, L)
    attention_mask: torch.Tensor  # tree: (1, 1, L, L) bool; padded: (B, L)
    position_ids: torch.Tensor  # (R, L)
    keep: torch.Tensor  # (N,) positions whose logits the loss reads (R * N logits)


@dataclass
class MicroBatch(OnDevice):
    forwards: list[Forward]
    index: torch.Tensor  # (B, W) row of each loss column in the forwards' kept logits
    trained: torch.Tensor  # (B, W) bool
    targets: torch.Tensor  # (B, W) the token of each column
    sampler_logp: torch.Tensor  # (B, W)
    top_ids: torch.Tensor  # (B, W, K) sampler top tokens (0 where missing)
    top_sampler_logp: torch.Tensor  # (B, W, K) their sampler log-probs (-inf where missing)
    advantages: torch.Tensor  # (B,)
    # (B, W, C) the ids each column was sampled from under truncation, and which are real
    # (None: every column was sampled from the whole vocabulary)
    candidates: torch.Tensor | None
    candidates_valid: torch.Tensor | None
    # (B, L) every token of each sample, left-aligned, -1 pads: the tokens a repetition
    # penalty applied to when each column was sampled (token i of n precedes the columns
    # from i + W + 1 - n on)
    seen_ids: torch.Tensor
    row_tokens: list[int]  # tokens forwarded per row
    row_samples: list[int]  # samples per row
    row_costs: list[int]  # attention pairs per row
    sample_tokens: int  # the samples' tokens before packing
    padding: int  # pad tokens in input_ids
    trained_positions: int  # forwarded positions that hold a trained token

    @property
    def forwarded_tokens(self) -> int:
        return sum(int(f.input_ids.numel()) for f in self.forwards)

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
            "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
            **candidate_columns(samples, width), **seen_columns(samples)}


def candidate_columns(samples: list, width: int) -> dict:
    """Each column's candidate set (`TrainingSequence.sampling_mask`), padded to the largest;
    None when no token of the batch was sampled under truncation."""
    sets = [(s.sequence.sampling_mask or [])[max(0, s.tokens - width):] for s in samples]
    size = max((len(ids) for row in sets for ids in row if ids), default=0)
    if size == 0:
        return {"candidates": None, "candidates_valid": None}
    candidates = torch.zeros((len(samples), width, size), dtype=torch.long)
    valid = torch.zeros((len(samples), width, size), dtype=torch.bool)
    for b, row in enumerate(sets):
        for c, ids in enumerate(row, start=width - len(row)):
            if ids:
                candidates[b, c, : len(ids)] = torch.tensor(ids)
                valid[b, c, : len(ids)] = True
    return {"candidates": candidates, "candidates_valid": valid}


def seen_columns(samples: list) -> dict:
    """Each sample's tokens (vLLM's repetition penalty applies to every token of the request's
    prompt and output so far), left-aligned and padded with -1."""
    ids = torch.full((len(samples), max(s.tokens for s in samples)), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : s.tokens] = torch.tensor(s.sequence.input_ids)
    return {"seen_ids": ids}


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
        opening = len(self.rows) < self.max_rows
        if home is not None:  # its group's row is full: never make the costliest row costlier
            if opening:
                return len(self.rows)
            top = max(row.cost for row in self.rows)
            fitting = [r for r in fitting if self.rows[r].cost + added[r][1] <= top]
            return min(fitting, key=lambda r: (self.rows[r].cost + added[r][1], r),
                       default=None)
        # a new group: where it adds the fewest tokens, then where the cost stays lowest (a
        # new row adds every token at no cost yet: it wins when nothing is shared); first
        # among the rows with room for the rest of its group, each sample adding about its
        # part after the prompt, since a group split over rows forwards its prompt twice
        rest = (sample.group_samples - 1) * (len(ids) - _first_trained(sample))
        options = [(added[r][0], self.rows[r].cost + added[r][1], r,
                    self.rows[r].tokens + added[r][0] + rest <= self.budget) for r in fitting]
        if opening:
            options.append((len(ids), attention_pairs(len(ids)), len(self.rows),
                            len(ids) + rest <= self.budget))
        whole = [option for option in options if option[3]]
        return min(whole or options)[2] if options else None

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
        columns = loss_columns(samples, self.top_k, self.pad_id)
        trained = columns["trained"]
        width = trained.shape[1]
        forwards, places, trained_positions, offset = [], [], 0, 0
        for row in plan.rows:
            ids, positions, mask, indices = lay_out(row)
            predictors, seen = [], set()  # the token before each trained token; trained ones
            for s, where in zip(row.samples, indices):
                for j in range(s.tokens - width, s.tokens):
                    if j >= 1 and s.sequence.trained[j]:
                        predictors.append(where[j - 1])
                        seen.add(where[j])
            keep = sorted(set(predictors))
            forwards.append(Forward(ids, mask, positions, torch.tensor(keep, dtype=torch.long)))
            places.append((indices, {p: offset + i for i, p in enumerate(keep)}))
            trained_positions += len(seen)
            offset += len(keep)
        index = [[0] * width for _ in samples]  # untrained columns: any logits
        for b, (s, flags, (row, k)) in enumerate(zip(samples, trained.tolist(), plan.where)):
            indices, slot = places[row]
            for c in range(width):
                if flags[c]:
                    index[b][c] = slot[indices[k][s.tokens - width + c - 1]]
        return MicroBatch(forwards, torch.tensor(index, dtype=torch.long), **columns,
                          row_tokens=[row.tokens for row in plan.rows],
                          row_samples=[len(row.samples) for row in plan.rows],
                          row_costs=[row.cost for row in plan.rows],
                          sample_tokens=sum(s.tokens for s in samples), padding=0,
                          trained_positions=trained_positions)


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
    return MicroBatch([Forward(ids, attention, positions, keep)], index, **columns,
                      row_tokens=[length] * rows, row_samples=[1] * rows,
                      row_costs=[attention_pairs(length)] * rows, sample_tokens=total,
                      padding=rows * length - total,
                      trained_positions=int(columns["trained"].sum()))


def record_rows(w: MetricsWindow, batch: MicroBatch, token_budget: int) -> None:
    """The seed's row metrics of one micro-batch, measured on the rows it forwarded: per row,
    its samples, tokens and the share of token_budget they use; per micro-batch, the padding
    in what was forwarded (none in tree rows), the tokens before packing per forwarded token,
    the forwarded tokens that are not trained, and the costliest row's attention cost over the
    mean (what a rank running the cheaper rows would wait for)."""
    for samples, tokens in zip(batch.row_samples, batch.row_tokens):
        w.add("batch/samples_per_row", samples)
        w.add("batch/row_tokens_mean", tokens)
        w.add("batch/row_tokens_max", tokens)
        w.add("batch/row_fill_frac", tokens / token_budget)
    forwarded, costs = batch.forwarded_tokens, batch.row_costs
    w.add("batch/pad_frac", batch.padding / forwarded)
    w.add("batch/packing_ratio", batch.sample_tokens / forwarded)
    w.add("batch/masked_token_frac", 1 - batch.trained_positions / forwarded)
    w.add("batch/row_imbalance", max(costs) / (sum(costs) / len(costs)))
