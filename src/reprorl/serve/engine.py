"""The batch-invariant generation engine behind `reprorl serve` and the stages' sampling.

Continuous batching over preallocated KV slots (one per running sequence, from offset 0, in
whole groups of `rows` slots): each step admits waiting sequences FIFO into the lowest free
slots, prefills each alone, and decodes the running sequences whatever adapters they use: in
one forward over the slots up to the highest in use (on the CPU with one thread and groups of
16 rows or more, where the row count changes no row's bits: `invariance.py` probes it), or in
one forward of a fixed shape per group of slots in use (a Qwen2's written out, `decode_step.py`:
the model call's bits with less Python). So a sequence's tokens, log-probs and top log-probs are
bitwise the same whatever else runs beside it. Log-probs are vLLM's
`processed_logprobs` (`logprobs.py`: after the repetition penalty, temperature, min-p, top-k,
top-p; greedy: the penalised log-softmax); each sequence samples with its own generator.
`grpo/server.py` runs the engine in a background thread behind vLLM's HTTP API;
`sampling.sample_many` drives it in the caller's thread (`Engine.generate`). Departures from
vLLM: a slot of `max_len` tokens per sequence, not paged blocks; no preemption (a sequence
waits for a free slot); other kernels, so other log-prob bits and seeded tokens that may
differ (the draw itself, `race`, is vLLM's); prefix caching keeps whole prompts (the last 16
prefills, or all of a store the caller keeps), and a new prompt reuses the longest head it
shares with one of them only in blocks of 32 tokens and where that keeps the bits
(`Engine.shared_head`), not in any blocks vLLM's cache holds. Work that must not overlap a
forward (a weight reload) runs in the engine thread between two steps (`between_steps`);
sequences already running go on under the new weights with the KV they have, as in vLLM.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reprorl.core import devices
from reprorl.model.encoding import mask_for

from . import decode_step
from .invariance import (
    HEAD_BLOCK,
    HEAD_LIMIT,
    SPAN_ROWS,
    cache_argument,
    forward_prompt,
    heads_invariant,
    rows_invariant,
)
from .logprobs import GREEDY_EPS, Params, processed_logprobs, race

log = logging.getLogger("reprorl.serve")
PREFIX_CACHE_PROMPTS = 16  # recent prefills kept for reuse (a few groups' prompts)
STACKED_COMBINATIONS = 4  # combinations of adapters whose stacked weights are kept
# decode row counts `Engine.warm_up` probes at most, each three products per weight shape: in
# float32 at Qwen2.5-0.5B's dimensions on the Intel Xeon, the warm-up took 10-11 s with 64 or 256
# slots (mostly the head probe, which the first request paid before), 26 s probing all 256
# counts; a larger count is probed at its first forward
WARM_ROWS = 64
FINISH_REASONS = ("stop", "length", "abort")
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


class ApiError(Exception):
    """A failure with its HTTP status (the server answers it in vLLM's JSON error shape)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param  # param: vLLM's field


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


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: Params
    adapter: Adapter | None  # a reference: an unloaded adapter stays usable until this ends
    generator: torch.Generator
    future: asyncio.Future | None = None  # None: driven by `Engine.generate`, nobody awaits
    loop: asyncio.AbstractEventLoop | None = None
    generated: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (sampled lp, top ids, top lps) per token
    masks: list = field(default_factory=list)  # per token, the ids it could have been
    ranks: list = field(default_factory=list)  # per token, its rank among the log-probs
    slot: int | None = None  # its row of the KV slots while it runs
    finish_reason: str | None = None
    stop_reason: int | None = None
    aborted: bool = False
    error: ApiError | None = None  # this request failed; the others go on

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def resolve(self, error: Exception | None = None) -> None:
        if self.loop is None:  # `Engine.generate` reads the outcome from the sequence itself
            return

        def settle():
            if not self.future.done():
                self.future.set_exception(error) if error else self.future.set_result(self)
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody waits
            self.loop.call_soon_threadsafe(settle)


def shared_blocks(a: tuple[int, ...], b: tuple[int, ...], most: int) -> int:
    """How many first tokens `a` and `b` share, in whole HEAD_BLOCKs, `most` at most."""
    length = 0
    while length + HEAD_BLOCK <= most and (
            a[length:length + HEAD_BLOCK] == b[length:length + HEAD_BLOCK]):
        length += HEAD_BLOCK
    return length


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


class Engine(threading.Thread):
    """Continuous batching in a background thread; the event loop only submits and awaits.

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
        """`switches`: the model's adapter layers (`server_weights.Switch`) by name; {} for none.
        `prefixes`: a prefill store to share with other engines on the same weights and
        thread count, which keeps every prompt (the caller drops it when the weights change,
        and a reused head must have the bits this engine would compute); without one, the
        engine keeps its last PREFIX_CACHE_PROMPTS prefills."""
        super().__init__(name="engine", daemon=True)
        self.model, self.switches, self.max_len = model, switches, max_len
        self.device = devices.of(model)  # of inputs, masks, KV slots
        slots = min(max_num_seqs, capacity // max_len)  # --kv-cache-tokens bounds them
        self.rows = min(rows, slots)
        self.slots = slots // self.rows * self.rows  # whole groups only: one shape each
        self.capacity = self.slots * max_len
        self.free = list(range(self.slots))
        # per slot: its first `written` positions may hold an earlier occupant's KV, the rest
        # are still the allocation's zeros (`fill_slot` zeroes only what it must)
        self.written = [0] * self.slots
        self.cache = None  # the KV slots, allocated at the first prefill (its shapes, dtype)
        self.cache_arg = cache_argument(model)
        # decode forwards through `decode_step.logits` (the model call's bits, less Python)
        self.written_out = decode_step.supported(model)
        self.cond = threading.Condition()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stopping = False
        self.counters = {"preemptions": 0, "prompt_tokens": 0, "generation_tokens": 0,
                         "prefix_cache_queries": 0, "prefix_cache_hits": 0}  # in tokens
        # (adapter id, prompt) -> (adapter, per-layer KV, last logits) of recent prefills: a
        # group's samples share one prompt, and the same forward would give the same bits
        self.prefixes: OrderedDict[tuple, tuple] = OrderedDict() if prefixes is None else prefixes
        self.prefix_limit = PREFIX_CACHE_PROMPTS if prefixes is None else None
        self.successes = dict.fromkeys(FINISH_REASONS, 0)
        self.calls: list[tuple] = []  # (work, future) to run between two steps
        self.moves = 0  # sequences moved to a lower slot by `compact`
        # sorted adapter ids -> `stack_adapters` of them, the latest combinations
        self.stacks: OrderedDict[tuple, tuple] = OrderedDict()
        self.ranks: dict[int, bool] = {}  # `rows_invariant` by LoRA rank (`stacks_rank`)
        self.reusable: bool | None = None  # `heads_invariant`, probed once on one CPU thread
        self.work = {key: 0.0 if key.endswith("_seconds") else 0 for key in WORK}

    @property
    def stacked(self) -> bool:
        """Whether a decode forward applies its rows' adapters of one rank in one batched
        product (else each adapter on its own): on the CPU with one torch thread, where
        `rows_invariant` holds (probed at the first call there, and logged)."""
        if self.device.type != "cpu" or torch.get_num_threads() != 1:
            return False
        first = 16 not in self.ranks
        invariant = self.stacks_rank()
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
            counts = range(self.rows, min(self.slots, WARM_ROWS) + 1) if self.span else [
                self.rows]
            shapes = {}  # one switch per weight shape and bias: the probes' key
            for switch in self.switches.values():
                base = switch.base
                shapes.setdefault((tuple(base.weight.shape), base.bias is not None), switch)
            for switch in shapes.values():
                for count in counts:  # a decode forward's input: [rows, 1, hidden]
                    switch.product(switch.base.weight.new_zeros(
                        count, 1, switch.base.in_features))
        return time.perf_counter() - started

    def generate(self, seqs: list[Sequence]) -> None:
        """Run `seqs` to their ends in the caller's thread, the same steps the background
        thread takes (so the same bits): in-process generation, no HTTP, the thread unused.
        A sequence that failed keeps its `error`."""
        self.waiting.extend(seqs)
        with torch.inference_mode():
            while self.waiting or self.running:
                self.step(self.schedule())

    def submit(self, seq: Sequence) -> None:
        with self.cond:
            self.waiting.append(seq)
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def between_steps(self, work) -> concurrent.futures.Future:
        """Run `work()` in the engine thread while no forward runs (a weight reload, a cache
        reset); the future gets its result or its exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            if self.stopping or not self.is_alive():
                future.set_exception(ApiError(503, "The engine has stopped."))
            else:
                self.calls.append((work, future))
                self.cond.notify()
        return future

    @staticmethod
    def run_calls(calls: list[tuple]) -> None:
        """`between_steps` work, each call once; a call its caller gave up on (a cancelled
        future: the client went away) is skipped, so it never half-applies unseen."""
        for work, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = work()
            except Exception as error:  # noqa: BLE001 (the caller reports it)
                future.set_exception(error)
            else:
                future.set_result(result)

    def reset_prefix_cache(self) -> None:
        """Forget the recent prefills (their KV and logits belong to the old weights)."""
        self.prefixes.clear()

    def kv_in_use(self) -> int:
        return sum(s.length for s in list(self.running))

    def run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self.cond:
                        while not (self.stopping or self.waiting or self.running
                                   or self.calls):
                            self.cond.wait()
                        if self.stopping:
                            return
                        calls, self.calls = self.calls, []
                        if not calls:
                            newcomers = self.schedule()
                    if calls:  # then round again: the next step sees their effect
                        started = time.perf_counter()
                        self.run_calls(calls)
                        self.work["busy_seconds"] += time.perf_counter() - started
                        continue
                    try:
                        self.step(newcomers)
                    except Exception as error:  # a bug outside one sequence's work
                        log.exception("engine step failed")
                        for seq in list(self.running):
                            self.release(seq)
                            seq.resolve(ApiError(500, f"generation failed: {error}"))
        finally:  # stopped or broken: /health turns 503 and nobody is left waiting
            with self.cond:
                self.stopping = True  # a call made from now on is refused, never left waiting
                left, self.running, self.waiting = [*self.running, *self.waiting], [], deque()
                calls, self.calls = self.calls, []
            for seq in left:
                seq.resolve(ApiError(503, "The engine has stopped."))
            for _, future in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(ApiError(503, "The engine has stopped."))

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
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.slot = self.free.pop(0)
            self.counters["prompt_tokens"] += len(seq.prompt)
            self.running.append(seq)
            newcomers.append(seq)
        return newcomers

    def release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.vacate(seq)

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
                holes = [slot for slot in self.free if slot < last.slot]
                if last.slot < self.rows or not holes:
                    return
                hole = holes[0]
            else:
                used = {seq.slot // self.rows for seq in self.running}
                if len(used) <= -(-len(self.running) // self.rows):
                    return
                hole = min((slot for slot in self.free
                            if slot // self.rows < last.slot // self.rows),
                           key=lambda slot: (slot // self.rows not in used, slot))
            self.fill_slot(hole, [(layer.keys[last.slot, :, :last.length],
                                   layer.values[last.slot, :, :last.length])
                                  for layer in self.cache.layers])
            self.free.remove(hole)
            self.vacate(last)
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
        best, length = None, 0
        for (_, prompt), (adapter, kv, _) in self.prefixes.items():
            if adapter is seq.adapter and len(prompt) < HEAD_LIMIT:
                shared = shared_blocks(prompt, tokens, most)
                if shared > length:
                    best, length = kv, shared
        return best, length

    def prefill(self, seq: Sequence) -> None:
        """The prompt alone (its own shape, whatever else runs), its KV copied into its slot;
        a prompt prefilled lately with the same adapter reuses that forward's KV and logits,
        and a prompt that shares only a head with one forwards just its rest."""
        tokens = tuple(seq.tokens)  # the prompt: nothing generated yet
        key = (id(seq.adapter), tokens)
        self.counters["prefix_cache_queries"] += seq.length
        hit = self.prefixes.get(key)
        if hit is not None and hit[0] is seq.adapter:  # the same object: the same weights
            self.prefixes.move_to_end(key)
            self.counters["prefix_cache_hits"] += seq.length
            _, kv, logits = hit
        else:
            head, reused = self.shared_head(seq, tokens)
            self.activate(seq.adapter)
            try:
                logits, kv = forward_prompt(self.model, seq.tokens, self.device, head, reused)
            finally:
                self.activate(None)
            self.counters["prefix_cache_hits"] += reused
            self.work["prefill_shared_tokens"] += reused
            self.prefixes[key] = (seq.adapter, kv, logits)
            if self.prefix_limit is not None and len(self.prefixes) > self.prefix_limit:
                self.prefixes.popitem(last=False)
        if self.cache is None:  # at the first prefill: its shapes and dtype
            self.cache = self.allocate(kv)
        self.fill_slot(seq.slot, kv)
        self.sample([seq], logits[None])

    def vacate(self, seq: Sequence) -> None:
        """`seq`'s slot back among the free ones, noting how far `seq` wrote its KV there: up
        to its length at most (the decode writes a row's last token at `seq.length - 1`)."""
        self.written[seq.slot] = max(self.written[seq.slot], seq.length)
        bisect.insort(self.free, seq.slot)  # kept sorted: `schedule` takes the lowest

    def fill_slot(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one sequence's per-layer (keys, values), [kv heads, its length, head dim],
        at the start of `slot`, and zero what an earlier occupant left beyond it: a masked
        position still meets its weight 0 in the attention sum, and 0 x Inf would be NaN.
        Past `written` the slot holds zeros already, so only that stretch is zeroed (zeroing
        the whole slot took about 7 % of the prefills' time on the default model)."""
        length = kv[0][0].shape[1]
        # raised first: a fill that fails half-way leaves at most `length` positions written
        written = self.written[slot] = max(self.written[slot], length)
        for slot_layer, pair in zip(self.cache.layers, kv):
            for store, tensor in zip((slot_layer.keys, slot_layer.values), pair):
                store[slot, :, length:written].zero_()
                store[slot, :, :length] = tensor
        self.written[slot] = length

    def allocate(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
        """The KV slots, shaped after one prompt's per-layer (keys, values): [kv heads, its
        length, head dim]."""
        log.info("KV slots: %d x %d tokens x %d layers", self.slots, self.max_len, len(kv))
        return Cache(layers=[
            SlotLayer(keys.new_zeros(shape), values.new_zeros(shape))
            for keys, values in kv
            for shape in [(self.slots, keys.shape[0], self.max_len, keys.shape[2])]])

    def activate(self, adapter: Adapter | None) -> None:
        weights = adapter.weights if adapter else {}
        for name, switch in self.switches.items():
            switch.active = weights.get(name)

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
        for layer in self.cache.layers:
            layer.window = (first, end, length)
            layer.rows, layer.positions = decoding, positions[decoding]
        # 4-D: transformers uses it as given (`mask_for`: boolean for SDPA, additive for
        # eager); a 2-D mask that happens to be all true (a full group at one position) would
        # be dropped, and SDPA would then run another kernel with other bits
        mask = (torch.arange(length, device=self.device)[None]
                <= positions[:, None])[:, None, None, :]
        try:
            self.adapt_rows(count, len(members), list(by_adapter.values()))
            mask = mask_for(self.model, mask)
            if self.written_out:
                logits = decode_step.logits(self.model, ids, positions[:, None], mask,
                                            self.cache.layers)
            else:
                logits = self.model(
                    input_ids=ids, position_ids=positions[:, None],
                    attention_mask=mask, use_cache=True,
                    cache_position=torch.tensor([length - 1], device=self.device),  # older 5.x
                    **{self.cache_arg: self.cache}).logits
        finally:  # in place: a module's attribute assignment costs ~4 us (twice 42 a forward)
            for switch in self.switches.values():
                switch.by_row.clear()
        logits = logits[:, -1]
        return {seq.slot: logits[seq.slot - first] for seq in members}

    def adapt_rows(self, count: int, decoding: int,
                   by_adapter: list[tuple[Adapter, list[int]]]) -> None:
        """Set every switch's per-row adapters for one decode forward of `count` rows, of
        which `decoding` hold a sequence: each entry a single adapter's (A, B, scale), or
        with `stacked` and `stacks_rank` a stack of one rank's adapters (`stack_adapters`,
        kept for the last few combinations: one changes only when sequences come and go)
        with the row of the stacked results each row keeps and its scale; and the rows that
        keep the entry's result (None: all, when it serves every decoding row; the others
        are dummies)."""
        for switch in self.switches.values():
            switch.by_row.clear()
        if not by_adapter:
            return

        def keep(rows: list[int]) -> torch.Tensor | None:
            if len(rows) == decoding:
                return None
            mask = torch.zeros(count, 1, 1, dtype=torch.bool)
            mask[rows] = True
            return mask.to(self.device)

        # a rank whose batched products change with the stack runs each adapter on its own
        stacking, stacked = [], self.stacked  # asked once a forward, not once an adapter
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

    def unsettled(self, rank: int) -> bool:
        """Whether a decode forward would still probe adapters of `rank` (`stacks_rank`)."""
        return self.stacked and rank not in self.ranks

    def settle_rank(self, rank: int) -> None:
        """Ask `stacks_rank(rank)` ahead (the server: as an adapter loads, between two steps,
        where no weight reload can run beside the probe), where `stacked` would ask it at the
        first decode forward of an adapter of that rank."""
        if self.unsettled(rank):
            with torch.inference_mode():
                log.info("LoRA rank %d: %s", rank, "adapters stacked" if self.stacks_rank(rank)
                         else "each adapter on its own (this rank's batched products move bits)")

    def stacks_rank(self, rank: int = 16) -> bool:
        """`rows_invariant` at `rank`, asked once per engine (the probe's key walks the
        model's modules): at 16 what `stacked` rests on; at an adapter's rank whether
        adapters of that rank may run stacked (on this project's CPUs every rank but 1)."""
        if rank not in self.ranks:
            self.ranks[rank] = rows_invariant(self.model, rank)
        return self.ranks[rank]

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """The next token of each of `seqs` from its row of `logits` [len(seqs), vocab]. The
        rows that share their sampling settings go through `processed_logprobs` and `race`
        together (row by row operations: each row's bits are those it gets alone; one call
        instead of one per row), each row drawing with its own generator; a row with a
        repetition penalty, which reads its own tokens, goes alone. An error fails the
        sequences of the rows drawn with it, nobody else; a row whose log-probs hold NaN
        (broken weights; filtered tokens are -inf) fails its own sequence."""
        # off the CPU, a softmax row's sum may follow its memory alignment: a block's rows
        # start 16-byte aligned only when the vocabulary is a multiple of 4 (Qwen's are)
        alone = logits.device.type != "cpu" and logits.shape[-1] % 4 != 0
        together: dict[tuple, list[int]] = {}
        for i, seq in enumerate(seqs):
            p = seq.params
            key = (p.temperature, p.top_p, p.top_k, p.min_p, p.logprobs, p.sampling_mask,
                   i if alone or p.repetition_penalty != 1 else -1)  # -1: rows may share
            together.setdefault(key, []).append(i)
        for rows in together.values():
            members = [seqs[i] for i in rows]
            try:
                draws = self.draw(members, logits[rows])
            except Exception as error:
                for seq in members:
                    self.fail(seq, error)
                continue
            for seq, draw in zip(members, draws):
                if draw is None:
                    self.fail(seq, FloatingPointError("the model's log-probs hold NaN"))
                else:
                    self.guarded(seq, self.append, seq, *draw)

    @staticmethod
    def draw(seqs: list[Sequence], logits: torch.Tensor) -> list[tuple | None]:
        """`sample`'s work for rows that share their settings (`seqs[0].params`): for each row
        (token, its log-prob, top log-probs, rank, candidate ids), or None where its log-probs
        hold NaN."""
        p = seqs[0].params
        scores = processed_logprobs(logits, p,
                                    seqs[0].tokens if p.repetition_penalty != 1 else None)
        broken = torch.isnan(scores).any(-1).tolist()
        if p.temperature < GREEDY_EPS:
            tokens = scores.argmax(-1)
        else:
            tokens = race(scores.exp(), [seq.generator for seq in seqs])
        chosen = scores.gather(-1, tokens[:, None])
        top = [None] * len(seqs)
        ranks = [None] * len(seqs)
        if p.logprobs is not None:
            best = scores.topk(p.logprobs)
            top = list(zip(best.indices.tolist(), best.values.tolist()))
            ranks = (1 + (scores > chosen).sum(-1)).tolist()
        # what survived temperature, min-p, top-k and top-p
        masks = ([torch.isfinite(row).nonzero().flatten().tolist() for row in scores]
                 if p.sampling_mask else [None] * len(seqs))
        return [None if nan else (token, logprob, pair, rank, mask) for
                nan, token, logprob, pair, rank, mask in
                zip(broken, tokens.tolist(), chosen[:, 0].tolist(), top, ranks, masks)]

    def append(self, seq: Sequence, token: int, logprob: float, top: tuple | None,
               rank: int | None, mask: list[int] | None) -> None:
        """A drawn token onto its sequence, which may end with it."""
        p = seq.params
        if p.logprobs is not None:
            seq.logprobs.append((logprob, *top))
            seq.ranks.append(rank)
        if p.sampling_mask:
            seq.masks.append(mask)
        seq.generated.append(token)
        self.counters["generation_tokens"] += 1
        if token == p.eos_id:
            seq.finish_reason = "stop"
        elif token in p.stop_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif len(seq.generated) >= p.max_tokens:
            seq.finish_reason = "length"

    def finish(self, seq: Sequence, reason: str) -> None:
        self.successes[reason] += 1
        seq.resolve()
