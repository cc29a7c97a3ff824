"""The engine's KV cache: one preallocated slot per running sequence, and the recent prefills.

`KVSlots` owns the slots, [slots, kv heads, max_model_len, head dim] per layer, allocated once
at the first prefill: a running sequence holds one row from offset 0, handed out lowest first.
`PrefixCache` keeps recent prefills (per-layer KV and last logits) by adapter and prompt, so
a group's samples share one prefill and a prompt may reuse the head it shares with another.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .invariance import HEAD_BLOCK

log = logging.getLogger("reprorl.serve")
PREFIX_CACHE_PROMPTS = 16  # recent prefills kept for reuse (a few groups' prompts)


class SlotLayer(CacheLayerMixin):
    """One layer's KV slots, [slots, kv heads, max_model_len, head dim], allocated once: each
    running sequence owns one row from offset 0. A decode step works on one window of rows and
    of length (`window`): it writes the new key and value of each decoding row at that row's
    own position and attends over the window's length, the positions beyond each row masked
    out; the window's other rows compute but write nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.window = (0, 0, 0)  # first row, end row, length
        self.rows = self.positions = None  # decoding rows (in the window) and their positions

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        first, end, length = self.window
        keys, values = self.keys[first:end, :, :length], self.values[first:end, :, :length]
        keys[self.rows, :, self.positions] = key_states[self.rows, :, 0]
        values[self.rows, :, self.positions] = value_states[self.rows, :, 0]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window[2], 0

    def get_seq_length(self) -> int:
        return self.window[2] - 1  # queries sit at the last place: no causal cut

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class KVSlots:
    """`slots` rows of `max_len` tokens: which are free, how far each was written, the KV."""

    def __init__(self, slots: int, max_len: int):
        self.slots, self.max_len = slots, max_len
        self.free = list(range(slots))  # kept sorted: `take` hands out the lowest
        # per slot: its first `written` positions may hold an earlier occupant's KV, the rest
        # are still the allocation's zeros (`fill` zeroes only what it must)
        self.written = [0] * slots
        self.cache: Cache | None = None  # allocated at the first prefill (its shapes, dtype)

    def take(self) -> int:
        return self.free.pop(0)

    def vacate(self, slot: int, length: int) -> None:
        """`slot` back among the free ones, noting how far its sequence wrote its KV there: up
        to its `length` at most (the decode writes a row's last token at `length - 1`)."""
        self.written[slot] = max(self.written[slot], length)
        bisect.insort(self.free, slot)

    def fill(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one sequence's per-layer (keys, values), [kv heads, its length, head dim],
        at the start of `slot`, and zero what an earlier occupant left beyond it: a masked
        position still meets its weight 0 in the attention sum, and 0 x Inf would be NaN.
        Past `written` the slot holds zeros already, so only that stretch is zeroed (zeroing
        the whole slot took about 7 % of the prefills' time on the default model)."""
        if self.cache is None:  # at the first prefill: its shapes and dtype
            self.cache = self.allocate(kv)
        length = kv[0][0].shape[1]
        # raised first: a fill that fails half-way leaves at most `length` positions written
        written = self.written[slot] = max(self.written[slot], length)
        for slot_layer, pair in zip(self.cache.layers, kv):
            for store, tensor in zip((slot_layer.keys, slot_layer.values), pair):
                store[slot, :, length:written].zero_()
                store[slot, :, :length] = tensor
        self.written[slot] = length

    def read(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `length` positions of `slot`, per layer (a view: `fill` copies it)."""
        return [(layer.keys[slot, :, :length], layer.values[slot, :, :length])
                for layer in self.cache.layers]

    def allocate(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
        """The KV slots, shaped after one prompt's per-layer (keys, values): [kv heads, its
        length, head dim]."""
        log.info("KV slots: %d x %d tokens x %d layers", self.slots, self.max_len, len(kv))
        return Cache(layers=[
            SlotLayer(keys.new_zeros(shape), values.new_zeros(shape))
            for keys, values in kv
            for shape in [(self.slots, keys.shape[0], self.max_len, keys.shape[2])]])


def shared_blocks(a: tuple[int, ...], b: tuple[int, ...], most: int) -> int:
    """How many first tokens `a` and `b` share, in whole HEAD_BLOCKs, `most` at most."""
    length = 0
    while length + HEAD_BLOCK <= most and (
            a[length:length + HEAD_BLOCK] == b[length:length + HEAD_BLOCK]):
        length += HEAD_BLOCK
    return length


class PrefixCache:
    """(adapter id, prompt) -> (adapter, per-layer KV, last logits) of recent prefills: a
    group's samples share one prompt, and the same forward would give the same bits.

    `store`: one to share with other engines on the same weights and thread count, which
    keeps every prompt (its owner drops it when the weights change); without one, the last
    PREFIX_CACHE_PROMPTS prefills are kept."""

    def __init__(self, store: OrderedDict | None = None):
        self.entries: OrderedDict[tuple, tuple] = OrderedDict() if store is None else store
        self.limit = PREFIX_CACHE_PROMPTS if store is None else None

    def get(self, adapter, tokens: tuple[int, ...]) -> tuple | None:
        """(KV, logits) of `tokens` prefilled with this very `adapter` object, or None."""
        key = (id(adapter), tokens)
        hit = self.entries.get(key)
        if hit is None or hit[0] is not adapter:  # the same object: the same weights
            return None
        self.entries.move_to_end(key)
        return hit[1:]

    def put(self, adapter, tokens: tuple[int, ...], kv: list, logits: torch.Tensor) -> None:
        self.entries[id(adapter), tokens] = (adapter, kv, logits)
        if self.limit is not None and len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every prefill (their KV and logits belong to the old weights)."""
        self.entries.clear()

    def longest_head(self, adapter, tokens: tuple[int, ...], most: int, limit: int
                     ) -> tuple[list | None, int]:
        """The KV of the prompt under `limit` tokens, prefilled with `adapter`, with which
        `tokens` share the most whole HEAD_BLOCKs (`most` tokens at most), and that length;
        (None, 0) where none shares a block."""
        best, length = None, 0
        for (_, prompt), (owner, kv, _) in self.entries.items():
            if owner is adapter and len(prompt) < limit:
                shared = shared_blocks(prompt, tokens, most)
                if shared > length:
                    best, length = kv, shared
        return best, length
