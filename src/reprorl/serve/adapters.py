"""LoRA adapters as the engine applies them: in one decode forward, each row its own adapter.

A decode forward's rows may use different adapters (a weight version each, during GRPO). For
each forward, every adapter layer (`weights.Switch`) gets a list of entries, each one
adapter's (A, B, scale) applied to the rows that use it or, where batching keeps every row's
bits (`rows_invariant` at the adapter's rank), one stack of a rank's adapters applied in one
batched product whatever the mix. A prefill runs alone, under its one adapter (`activate`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .invariance import rows_invariant

STACKED_COMBINATIONS = 4  # combinations of adapters whose stacked weights are kept


@dataclass
class Adapter:
    name: str
    path: str
    weights: dict  # module name -> (A, B, scale)

    @property
    def rank(self) -> int:
        return next(iter(self.weights.values()))[0].shape[0]

    @property
    def scale(self) -> float:  # alpha / r, the same for every module
        return next(iter(self.weights.values()))[2]


def stack_adapters(adapters: tuple[Adapter, ...], switches: dict[str, torch.nn.Module]
                   ) -> list[tuple[tuple[Adapter, ...], dict]]:
    """`adapters` in stacks, one per LoRA rank, and for each stack, by module, their A^T and
    B^T stacked, [n, in, r] and [n, r, out] (`lora.with_row_adapters`), zeros where an
    adapter lacks the module."""
    stacks: dict[int, list[Adapter]] = {}
    for adapter in adapters:
        stacks.setdefault(adapter.rank, []).append(adapter)
    stacked = []
    for members in stacks.values():
        rank, weights = members[0].rank, {}
        for name, switch in switches.items():
            base = switch.base.weight
            zeros = (base.new_zeros(rank, base.shape[1], dtype=torch.float32),
                     base.new_zeros(base.shape[0], rank, dtype=torch.float32))
            pairs = [adapter.weights.get(name, zeros)[:2] for adapter in members]
            weights[name] = (torch.stack([a for a, _ in pairs]).transpose(1, 2),
                             torch.stack([b for _, b in pairs]).transpose(1, 2))
        stacked.append((tuple(members), weights))
    return stacked


class RowAdapters:
    """The model's adapter layers (`switches`, by name) and what each forward sets in them."""

    def __init__(self, model, switches: dict[str, torch.nn.Module], device: torch.device):
        self.model, self.switches, self.device = model, switches, device
        # sorted adapter ids -> `stack_adapters` of them, the latest combinations
        self.stacks: OrderedDict[tuple, list] = OrderedDict()
        self.ranks: dict[int, bool] = {}  # `rows_invariant` by LoRA rank (`stacks_rank`)

    def activate(self, adapter: Adapter | None) -> None:
        """`adapter` on every row (a prefill), or none."""
        weights = adapter.weights if adapter else {}
        for name, switch in self.switches.items():
            switch.active = weights.get(name)

    def clear(self) -> None:
        # in place: a module's attribute assignment costs ~4 us (twice 42 a forward)
        for switch in self.switches.values():
            switch.by_row.clear()

    def warm_up(self, counts) -> None:
        """Probe, for each weight shape and decode row count in `counts`, whether a product may
        read the weight's column-major copy (`invariance.linear`), as a forward would at its
        first call with that shape."""
        shapes = {}  # one switch per weight shape and bias: the probes' key
        for switch in self.switches.values():
            base = switch.base
            shapes.setdefault((tuple(base.weight.shape), base.bias is not None), switch)
        for switch in shapes.values():
            for count in counts:  # a decode forward's input: [rows, 1, hidden]
                switch.product(switch.base.weight.new_zeros(count, 1, switch.base.in_features))

    def stacks_rank(self, rank: int = 16) -> bool:
        """`rows_invariant` at `rank`, asked once per engine (the probe's key walks the
        model's modules): at 16 what `Engine.stacked` rests on; at an adapter's rank whether
        adapters of that rank may run stacked (on this project's CPUs every rank but 1)."""
        if rank not in self.ranks:
            self.ranks[rank] = rows_invariant(self.model, rank)
        return self.ranks[rank]

    def adapt_rows(self, count: int, decoding: int,
                   by_adapter: list[tuple[Adapter, list[int]]], stacked: bool) -> None:
        """Set every switch's per-row adapters for one decode forward of `count` rows, of
        which `decoding` hold a sequence: each entry a single adapter's (A, B, scale), or
        with `stacked` (`Engine.stacked`) and `stacks_rank` a stack of one rank's adapters
        (`stack_adapters`, kept for the last few combinations: one changes only when
        sequences come and go) with the row of the stacked results each row keeps and its
        scale; and the rows that keep the entry's result (None: all, when it serves every
        decoding row; the others are dummies)."""
        self.clear()
        if not by_adapter:
            return

        def keep(rows: list[int]) -> torch.Tensor | None:
            if len(rows) == decoding:
                return None
            mask = torch.zeros(count, 1, 1, dtype=torch.bool)
            mask[rows] = True
            return mask.to(self.device)

        # a rank whose batched products change with the stack runs each adapter on its own
        stacking = []
        for adapter, rows in by_adapter:
            if stacked and self.stacks_rank(adapter.rank):
                stacking.append((adapter, rows))
                continue
            kept = keep(rows)
            for name, switch in self.switches.items():
                if name in adapter.weights:
                    switch.by_row.append((adapter.weights[name], kept))
        if not stacking:
            return
        # an entry holds its adapters (stack_adapters' members), so no id in a key is reused
        key = tuple(sorted(id(adapter) for adapter, _ in stacking))
        if key not in self.stacks:
            self.stacks[key] = stack_adapters(tuple(a for a, _ in stacking), self.switches)
            while len(self.stacks) > STACKED_COMBINATIONS:
                self.stacks.popitem(last=False)
        self.stacks.move_to_end(key)
        rows_of = {id(adapter): rows for adapter, rows in stacking}
        every_row = torch.arange(count)
        for members, weights in self.stacks[key]:
            place = torch.zeros(count, dtype=torch.long)
            scale = torch.zeros(count, 1, 1)
            for index, adapter in enumerate(members):
                place[rows_of[id(adapter)]] = index
                scale[rows_of[id(adapter)]] = adapter.scale
            pick = (place * count + every_row).to(self.device)
            scale, kept = scale.to(self.device), keep(
                [row for adapter in members for row in rows_of[id(adapter)]])
            for name, switch in self.switches.items():
                switch.by_row.append(((*weights[name], pick, scale), kept))
