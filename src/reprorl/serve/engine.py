"""The batch-invariant generation engine behind `reprorl serve` and the stages' sampling.

Continuous batching: each step admits waiting sequences FIFO into free KV slots
(`kv_slots.py`), prefills each alone, decodes the running ones in one forward whatever
adapters they use (`adapters.py`), and draws each row with its own generator
(`logprobs.draw`). A sequence's tokens and log-probs are bitwise the same whatever runs beside
it (`Engine` says how). `sampling.sample_many` steps it in the caller's thread; the server in
a background thread (`engine_thread.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

import torch

from reprorl.core import devices
from reprorl.model.encoding import mask_for

from . import decode_step
from .adapters import Adapter, RowAdapters
from .invariance import (
    HEAD_BLOCK,
    HEAD_LIMIT,
    SPAN_ROWS,
    cache_argument,
    forward_prompt,
    heads_invariant,
)
from .kv_slots import KVSlots, PrefixCache
from .logprobs import draw
from .sequence import FINISH_REASONS, ApiError, Sequence

log = logging.getLogger("reprorl.serve")
# decode row counts `Engine.warm_up` probes at most, each three products per weight shape: in
# float32 at Qwen2.5-0.5B's dimensions on the Intel Xeon, the warm-up took 10-11 s with 64 or 256
# slots (mostly the head probe, which the first request paid before), 26 s probing all 256
# counts; a larger count is probed at its first forward
WARM_ROWS = 64
# `Engine.work`, where the engine thread's time goes (the server's `reprorl:engine_*` on
# /metrics): whether the server is the bound, and what its decode forwards carry (adapters:
# each one in a group is applied to all its rows, so mixed weight versions cost a LoRA branch
# each); the key and its help text
WORK = {
    "busy_seconds": "Seconds the engine thread spent stepping (and loading weights between "
                    "steps).",
    "decode_seconds": "Seconds in decode forwards and the sampling of their rows.",
    "prefill_seconds": "Seconds admitting new requests (prompt prefill or its reuse, first "
                       "token).",
    "decode_forwards": "Decode forwards (one spanning the slots in use, or one per group of "
                       "--decode-rows slots in use).",
    "decode_rows": "Decoding sequences, summed over decode forwards.",
    "decode_slots": "Rows computed by decode forwards (the decoding sequences and the idle "
                    "slots beside them), summed.",
    "decode_adapters": "LoRA adapters applied, summed over decode forwards (each to all the "
                       "rows).",
    "prefill_shared_tokens": "Prompt tokens whose KV a prefill took from the head its prompt "
                             "shares with a recent one (within vllm:prefix_cache_hits).",
}


class Engine:
    """Continuous batching over preallocated KV slots, stepped by `generate` or a thread.

    Batch invariance: a request's tokens and log-probs are bitwise the same whatever runs
    beside it. A CPU GEMM's row result depends on how many rows there are (measured here:
    below 11 to 16 rows the bits differ from above), never on the row's place or the other
    rows' values. So the slots are decoded in groups of `rows` consecutive slots, one forward
    of exactly `rows` rows per group that holds a decoding sequence, whichever adapters they
    use; or, where a row's bits are the same at every count from 16 up (`span`: probed on
    the CPU with one thread, `rows_invariant`), in one forward over the slots up to the
    highest in use, which computes each weight matrix once a step however many groups run.
    The attended length is the forward's longest row rounded up to 64 (with the positions
    beyond each row masked, the result does not depend on that length, measured); a prompt is
    prefilled alone (the samples of a group, which share it, reuse one prefill: the same
    forward, same bits; a prompt sharing a head with a recent one may forward only its rest,
    on terms that keep the whole forward's bits: `shared_head`);
    nothing is ever recomputed (no preemption: a request waits for a free slot). When
    sequences end and nobody waits, the sequences of the highest slots move, KV and all, into
    lower holes (`compact`): since a row's bits depend neither on its place nor on the window
    length, a move changes no bit, and the running sequences decode in as few rows as they
    can. `tests/test_server.py` checks the invariance end to end.
    """

    def __init__(self, model, switches: dict[str, torch.nn.Module], max_num_seqs: int,
                 capacity: int, max_len: int, rows: int = SPAN_ROWS,
                 prefixes: OrderedDict | None = None):
        """`switches`: the model's adapter layers (`weights.Switch`) by name; {} for none.
        `prefixes`: a prefill store to share with other engines on the same weights and
        thread count, which keeps every prompt (the caller drops it when the weights change,
        and a reused head must have the bits this engine would compute); without one, the
        engine keeps its last PREFIX_CACHE_PROMPTS prefills (`kv_slots.PrefixCache`)."""
        self.model, self.max_len = model, max_len
        self.device = devices.of(model)  # of inputs, masks, KV slots
        slots = min(max_num_seqs, capacity // max_len)  # --kv-cache-tokens bounds them
        self.rows = min(rows, slots)
        # whole groups only: one shape each
        self.kv = KVSlots(slots // self.rows * self.rows, max_len)
        self.capacity = self.kv.slots * max_len
        self.prefixes = PrefixCache(prefixes)
        self.adapters = RowAdapters(model, switches, self.device)
        self.cache_arg = cache_argument(model)
        # decode forwards through `decode_step.logits` (the model call's bits, less Python)
        self.written_out = decode_step.supported(model)
        self.cond = threading.Condition()  # guards `waiting` and `running` (a thread submits)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = {"preemptions": 0, "prompt_tokens": 0, "generation_tokens": 0,
                         "prefix_cache_queries": 0, "prefix_cache_hits": 0}  # in tokens
        self.successes = dict.fromkeys(FINISH_REASONS, 0)
        self.moves = 0  # sequences moved to a lower slot by `compact`
        self.reusable: bool | None = None  # `heads_invariant`, probed once on one CPU thread
        self.work = {key: 0.0 if key.endswith("_seconds") else 0 for key in WORK}

    @property
    def stacked(self) -> bool:
        """Whether a decode forward applies its rows' adapters of one rank in one batched
        product (else each adapter on its own): on the CPU with one torch thread, where
        `rows_invariant` holds (probed at the first call there, and logged)."""
        if self.device.type != "cpu" or torch.get_num_threads() != 1:
            return False
        first = 16 not in self.adapters.ranks
        invariant = self.adapters.stacks_rank()
        if first:
            mode = "spanning forwards" if self.rows >= SPAN_ROWS else f"by groups of {self.rows}"
            log.info("decode: %s", f"{mode}, adapters stacked" if invariant else
                     f"by groups of {self.rows}: this CPU's products change bits with the rows")
        return invariant

    @property
    def span(self) -> bool:
        """Whether a decode forward spans the slots up to the highest in use (else one forward
        per group of `rows` slots in use): `stacked` (so `rows_invariant` holds here), and
        groups of SPAN_ROWS rows or more."""
        return self.stacked and self.rows >= SPAN_ROWS

    def warm_up(self) -> float:
        """Settle before the first request what this process probes once and a request would
        otherwise wait on (as vLLM profiles its model before it serves): `stacked` and
        `reuses_heads` (0.2 s on the default model, nearly all `heads_invariant`), and at each
        row count a decode forward may have (up to WARM_ROWS), whether each projection shape
        may read its column-major copy (`invariance.linear`; a prompt's count is probed at its
        first prefill, there are too many). Nothing is kept but the answers and those copies;
        the probes' bits are what they would be later (same shapes, same thread count). The
        time moves, it is not saved: a run pays it at start-up. Returns the seconds spent."""
        started = time.perf_counter()
        with torch.inference_mode():
            self.reuses_heads  # noqa: B018 (asks `stacked` first; both log what they found)
            counts = range(self.rows, min(self.kv.slots, WARM_ROWS) + 1) if self.span else [
                self.rows]
            self.adapters.warm_up(counts)
        return time.perf_counter() - started

    def generate(self, seqs: list[Sequence]) -> None:
        """Run `seqs` to their ends in the caller's thread, the same steps the background
        thread takes (so the same bits): in-process generation, no HTTP, the thread unused.
        A sequence that failed keeps its `error`."""
        self.waiting.extend(seqs)
        with torch.inference_mode():
            while self.waiting or self.running:
                self.step(self.schedule())

    def reset_prefix_cache(self) -> None:
        """Forget the recent prefills (their KV and logits belong to the old weights)."""
        self.prefixes.clear()

    def kv_in_use(self) -> int:
        return sum(s.length for s in list(self.running))

    def schedule(self) -> list[Sequence]:
        """Drop aborted requests (their slots free up), then admit waiting ones FIFO into free
        slots. A request always fits its slot: prompt + max_tokens <= max_model_len."""
        for seq in [s for s in self.running if s.aborted]:
            self.release(seq)
            self.finish(seq, "abort")
        for seq in [s for s in self.waiting if s.aborted]:
            self.waiting.remove(seq)
            self.finish(seq, "abort")
        newcomers = []
        while self.waiting and self.kv.free:
            seq = self.waiting.popleft()
            seq.slot = self.kv.take()
            self.counters["prompt_tokens"] += len(seq.prompt)
            self.running.append(seq)
            newcomers.append(seq)
        return newcomers

    def release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.vacate(seq.slot, seq.length)

    def step(self, newcomers: list[Sequence]) -> None:
        started = time.perf_counter()
        decoding = [s for s in self.running if s not in newcomers]
        if decoding:
            try:
                rows = self.decode(decoding)
            except Exception:  # a fault outside one sequence: replay each alone to find it
                log.exception("a decode step failed; decoding its %d rows alone", len(decoding))
                rows = {seq.slot: self.guarded(seq, lambda s=seq: self.decode([s])[s.slot])
                        for seq in decoding}
            drawing = [seq for seq in decoding if rows.get(seq.slot) is not None]
            if drawing:
                self.sample(drawing, torch.stack([rows[seq.slot] for seq in drawing]))
        decoded = time.perf_counter()
        for seq in newcomers:
            self.guarded(seq, self.prefill, seq)
        ended = time.perf_counter()
        with self.cond:
            for seq in [s for s in self.running if s.finish_reason or s.error]:
                self.release(seq)
                if seq.error is None:
                    self.finish(seq, seq.finish_reason)
                else:
                    seq.resolve(seq.error)
            if not self.waiting:  # a waiting request fills a hole at no cost: no move then
                self.compact()
        self.work["decode_seconds"] += decoded - started  # and the sampling of those rows
        self.work["prefill_seconds"] += ended - decoded
        self.work["busy_seconds"] += time.perf_counter() - started

    def compact(self) -> None:
        """Move the sequence of the highest slot into a lower hole while that makes the decode
        forwards smaller: spanning, while the highest is beyond the first `rows` slots and a
        hole lies below it (into the lowest); by groups, while the running sequences use more
        groups than they would fill (into a group in use if there is one)."""
        while self.running:
            last = max(self.running, key=lambda seq: seq.slot)
            if self.span:
                holes = [slot for slot in self.kv.free if slot < last.slot]
                if last.slot < self.rows or not holes:
                    return
                hole = holes[0]
            else:
                used = {seq.slot // self.rows for seq in self.running}
                if len(used) <= -(-len(self.running) // self.rows):
                    return
                hole = min((slot for slot in self.kv.free
                            if slot // self.rows < last.slot // self.rows),
                           key=lambda slot: (slot // self.rows not in used, slot))
            self.kv.fill(hole, self.kv.read(last.slot, last.length))
            self.kv.free.remove(hole)
            self.kv.vacate(last.slot, last.length)
            last.slot = hole
            self.moves += 1

    def guarded(self, seq: Sequence, work, *args):
        """`work(*args)`; an exception fails `seq` (its request gets a 500), nothing else."""
        try:
            return work(*args)
        except Exception as error:
            self.fail(seq, error)
            return None

    @staticmethod
    def fail(seq: Sequence, error: Exception) -> None:
        log.error("a request failed while generating", exc_info=error)
        seq.error = ApiError(500, f"generation failed: {type(error).__name__}: {error}")

    @property
    def reuses_heads(self) -> bool:
        """Whether a prompt may start from the KV of the head it shares with a recent one
        (`shared_head`): in float32 (what was measured) where `stacked` holds and
        `heads_invariant` finds the same bits (asked once per engine)."""
        if not self.stacked or next(self.model.parameters()).dtype != torch.float32:
            return False
        if self.reusable is None:
            self.reusable = heads_invariant(self.model)
            log.info("prefill: %s", "a prompt reuses the head it shares with a recent one"
                     if self.reusable else "whole prompts only: a reused head moves bits here")
        return self.reusable

    def shared_head(self, seq: Sequence, tokens: tuple[int, ...]) -> tuple[list | None, int]:
        """The per-layer KV of the prompt, prefilled lately with `seq`'s adapter, with which
        `seq`'s prompt (`tokens`) shares the longest head (a chat template's system turn, an
        agent's earlier turns), and how much of it to reuse; (None, 0) where none. Only on terms
        that keep the bits of the whole forward (`reuses_heads`): whole HEAD_BLOCKs of it,
        both prompts under HEAD_LIMIT tokens, SPAN_ROWS tokens left to forward at least."""
        most = (seq.length - SPAN_ROWS) // HEAD_BLOCK * HEAD_BLOCK
        if most < HEAD_BLOCK or seq.length >= HEAD_LIMIT or not self.reuses_heads:
            return None, 0
        return self.prefixes.longest_head(seq.adapter, tokens, most, HEAD_LIMIT)

    def prefill(self, seq: Sequence) -> None:
        """The prompt alone (its own shape, whatever else runs), its KV copied into its slot;
        a prompt prefilled lately with the same adapter reuses that forward's KV and logits,
        and a prompt that shares only a head with one forwards just its rest."""
        tokens = tuple(seq.tokens)  # the prompt: nothing generated yet
        self.counters["prefix_cache_queries"] += seq.length
        hit = self.prefixes.get(seq.adapter, tokens)
        if hit is not None:
            self.counters["prefix_cache_hits"] += seq.length
            kv, logits = hit
        else:
            head, reused = self.shared_head(seq, tokens)
            self.adapters.activate(seq.adapter)
            try:
                logits, kv = forward_prompt(self.model, seq.tokens, self.device, head, reused)
            finally:
                self.adapters.activate(None)
            self.counters["prefix_cache_hits"] += reused
            self.work["prefill_shared_tokens"] += reused
            self.prefixes.put(seq.adapter, tokens, kv, logits)
        self.kv.fill(seq.slot, kv)
        self.sample([seq], logits[None])

    def decode(self, decoding: list[Sequence]) -> dict[int, torch.Tensor]:
        """One token for each of `decoding`: one forward over the slots up to the highest
        that holds one of them, `rows` at least (`span`), or one forward per group of `rows`
        slots that holds one. Returns the logits by slot."""
        if self.span:
            end = max(self.rows, 1 + max(seq.slot for seq in decoding))
            return self.decode_slots(0, end, decoding)
        groups: dict[int, list[Sequence]] = {}
        for seq in decoding:
            groups.setdefault(seq.slot // self.rows, []).append(seq)
        logits = {}
        for group, members in sorted(groups.items()):
            logits.update(self.decode_slots(group * self.rows, (group + 1) * self.rows,
                                            members))
        return logits

    def decode_slots(self, first: int, end: int, members: list[Sequence]
                     ) -> dict[int, torch.Tensor]:
        """Slots [first, end) in one forward; the slots without a decoding sequence decode
        a dummy token at position 0 and keep their caches."""
        count = end - first
        ids = torch.zeros(count, 1, dtype=torch.long)
        positions = torch.zeros(count, dtype=torch.long)
        by_adapter: dict[int, tuple[Adapter, list[int]]] = {}
        for seq in members:
            row = seq.slot - first
            ids[row, 0], positions[row] = seq.generated[-1], seq.length - 1
            if seq.adapter is not None:
                by_adapter.setdefault(id(seq.adapter), (seq.adapter, []))[1].append(row)
        self.work["decode_forwards"] += 1
        self.work["decode_rows"] += len(members)
        self.work["decode_slots"] += count
        self.work["decode_adapters"] += len(by_adapter)
        # the longest row rounded up to 64 (its bits measured independent of that length on
        # the CPU; on a GPU, where that is unmeasured, the whole slot: one shape always)
        length = min(self.max_len, -(-(int(positions.max()) + 1) // 64) * 64) if (
            self.device.type == "cpu") else self.max_len
        ids, positions = ids.to(self.device), positions.to(self.device)  # filled on the CPU
        decoding = torch.tensor([seq.slot - first for seq in members], device=self.device)
        for layer in self.kv.cache.layers:
            layer.window = (first, end, length)
            layer.rows, layer.positions = decoding, positions[decoding]
        # 4-D: transformers uses it as given (`mask_for`: boolean for SDPA, additive for
        # eager); a 2-D mask that happens to be all true (a full group at one position) would
        # be dropped, and SDPA would then run another kernel with other bits
        mask = (torch.arange(length, device=self.device)[None]
                <= positions[:, None])[:, None, None, :]
        try:
            # `stacked` asked once a forward, and only for a forward with adapters
            self.adapters.adapt_rows(count, len(members), list(by_adapter.values()),
                                     bool(by_adapter) and self.stacked)
            mask = mask_for(self.model, mask)
            if self.written_out:
                logits = decode_step.logits(self.model, ids, positions[:, None], mask,
                                            self.kv.cache.layers)
            else:
                logits = self.model(
                    input_ids=ids, position_ids=positions[:, None],
                    attention_mask=mask, use_cache=True,
                    cache_position=torch.tensor([length - 1], device=self.device),  # older 5.x
                    **{self.cache_arg: self.kv.cache}).logits
        finally:
            self.adapters.clear()
        logits = logits[:, -1]
        return {seq.slot: logits[seq.slot - first] for seq in members}

    def unsettled(self, rank: int) -> bool:
        """Whether a decode forward would still probe adapters of `rank` (`stacks_rank`)."""
        return self.stacked and rank not in self.adapters.ranks

    def settle_rank(self, rank: int) -> None:
        """Ask `stacks_rank(rank)` ahead (the server: as an adapter loads, between two steps,
        where no weight reload can run beside the probe), where `stacked` would ask it at the
        first decode forward of an adapter of that rank."""
        if self.unsettled(rank):
            with torch.inference_mode():
                log.info("LoRA rank %d: %s", rank, "adapters stacked"
                         if self.adapters.stacks_rank(rank)
                         else "each adapter on its own (this rank's batched products move bits)")

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """The next token of each of `seqs` from its row of `logits` [len(seqs), vocab]. The
        rows that share their sampling settings go through `processed_logprobs` and `race`
        together (row by row operations: each row's bits are those it gets alone; one call
        instead of one per row), each row drawing with its own generator; a row whose
        distribution reads its own tokens or settings (`Params.own_row`: a repetition penalty,
        logit bias, bad words, ...) goes alone. An error fails the
        sequences of the rows drawn with it, nobody else; a row whose log-probs hold NaN
        (broken weights; filtered tokens are -inf) fails its own sequence."""
        # off the CPU, a softmax row's sum may follow its memory alignment: a block's rows
        # start 16-byte aligned only when the vocabulary is a multiple of 4 (Qwen's are)
        alone = logits.device.type != "cpu" and logits.shape[-1] % 4 != 0
        together: dict[tuple, list[int]] = {}
        for i, seq in enumerate(seqs):
            p = seq.params
            key = (p.temperature, p.top_p, p.top_k, p.min_p, p.logprobs, p.sampling_mask,
                   i if alone or p.own_row else -1)  # -1: rows may share
            together.setdefault(key, []).append(i)
        for rows in together.values():
            members = [seqs[i] for i in rows]
            p = members[0].params
            # the tokens a row drawn alone reads
            seen, output = (members[0].tokens, members[0].generated) if p.own_row else (
                None, None)
            try:
                draws = draw(logits[rows], p, [seq.generator for seq in members], seen, output)
            except Exception as error:
                for seq in members:
                    self.fail(seq, error)
                continue
            for seq, drawn in zip(members, draws):
                if drawn is None:
                    self.fail(seq, FloatingPointError("the model's log-probs hold NaN"))
                else:
                    self.guarded(seq, self.append, seq, *drawn)

    def append(self, seq: Sequence, *drawn) -> None:
        """A drawn token onto its sequence (`Sequence.take`), which may end with it."""
        seq.take(*drawn)
        self.counters["generation_tokens"] += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        self.successes[reason] += 1
        seq.resolve()
