"""The stages' sampler (`sampling.sample_many`) on a random tiny Qwen2: what it returns for a
prompt does not depend on what is sampled beside it, bit for bit, greedy and seeded."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from reprorl.core.errors import ReproError
from reprorl.serve.sampling import sample, sample_many

# prompts of 3 to 150 tokens in slots of 256: one decode group mixes attention windows of 64
# to 192 positions, which must not change any row's bits either
EOS, MAX_LEN = 3, 256


def tiny_qwen(seed: int, heads: int = 2, kv_heads: int = 1, family: str = "qwen2"):
    """A random tiny Qwen2, or a Llama of the same size (SmolLM2's family: no q/k/v bias)."""
    torch.manual_seed(seed)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    config = config_class(vocab_size=64, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, max_position_embeddings=MAX_LEN)
    return model_class(config).eval()


def random_adapter(name: str, rank: int, switches: dict, generator: torch.Generator):
    """An adapter of `rank` on every switch, random A and B (x 0.3), alpha / r 2."""
    from reprorl.serve.adapters import Adapter

    return Adapter(name, "", {key: (0.3 * torch.randn(rank, s.base.in_features,
                                                      generator=generator),
                                    0.3 * torch.randn(s.base.out_features, rank,
                                                      generator=generator), 2.0)
                              for key, s in switches.items()})


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(0)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 64) for _ in range(rng.randrange(3, 150))] for _ in range(count)]


def generators(seeds):
    return [torch.Generator().manual_seed(seed) for seed in seeds]


@pytest.mark.parametrize("greedy", [True, False])
def test_a_prompt_samples_the_same_bits_alone_and_among_any_others(model, greedy):
    pool = prompts(40, 1)
    alone = [sample_many(model, [p], 24, EOS, MAX_LEN, None if greedy else generators([i]),
                         rows=4)[0] for i, p in enumerate(pool)]
    rng = random.Random(2)
    mixes = 0
    for _ in range(6):  # random subsets, orders and batch sizes (fewer and more than the slots)
        chosen = rng.sample(range(len(pool)), rng.randrange(2, len(pool)))
        got = sample_many(model, [pool[i] for i in chosen], 24, EOS, MAX_LEN,
                          None if greedy else generators(chosen), rows=4,
                          slots=rng.choice([4, 8, 16]))
        for i, result in zip(chosen, got):
            assert result == alone[i], f"prompt {i} differs among {len(chosen)} others"
        mixes += 1
    assert mixes == 6
    assert {r.finish_reason for r in alone} <= {"eos", "cut"}
    assert all(len(r.response_ids) == len(r.logprobs) <= 24 for r in alone)


def test_a_group_sharing_a_prompt_reuses_one_prefill_with_the_same_bits(model):
    """Samples of one prompt (a GRPO group) prefill it once and draw the bits each draws
    alone, where nothing is reused; more prompts than the prefix cache holds still replay."""
    from reprorl.serve.engine import Engine
    from reprorl.serve.kv_slots import PREFIX_CACHE_PROMPTS
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence

    pool = prompts(PREFIX_CACHE_PROMPTS + 4, 7)
    seeds = [[10 * i + k for k in range(4)] for i in range(len(pool))]
    alone = [[sample_many(model, [p], 24, EOS, MAX_LEN, generators([seed]), rows=4)[0]
              for seed in group] for p, group in zip(pool, seeds)]
    params = Params(max_tokens=24, temperature=1.0, logprobs=0, eos_id=EOS)
    seqs = [Sequence(list(p), params, None, generator)
            for p, group in zip(pool, seeds) for generator in generators(group)]
    engine = Engine(model, {}, 8, 8 * MAX_LEN, MAX_LEN, rows=4)
    engine.generate(seqs)
    for index, seq in enumerate(seqs):
        expected = alone[index // 4][index % 4]
        assert seq.generated == expected.response_ids
        assert [lp for lp, _, _ in seq.logprobs] == expected.logprobs
    prompt_tokens = sum(len(p) for p in pool)
    assert engine.counters["prefix_cache_queries"] == 4 * prompt_tokens
    assert engine.counters["prefix_cache_hits"] == 3 * prompt_tokens  # each prompt's 3 repeats


def test_sequences_left_in_sparse_groups_move_down_and_keep_their_bits(model):
    """Eight sequences on 8 slots in groups of 4; every other one ends after 2 tokens, so two
    half-empty groups remain and nobody waits: the engine moves the two highest into the
    first group's holes (KV and all), then decodes one group a step, not two, and every
    sequence still draws the bits it draws alone."""
    from reprorl.serve.engine import Engine
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence

    pool = prompts(8, 13)
    limits = [2, 24] * 4
    alone = [sample_many(model, [p], limit, -1, MAX_LEN, generators([i]), rows=4)[0]
             for i, (p, limit) in enumerate(zip(pool, limits))]
    seqs = [Sequence(list(p), Params(max_tokens=limit, temperature=1.0, logprobs=0),
                     None, generator)
            for p, limit, generator in zip(pool, limits, generators(range(8)))]
    engine = Engine(model, {}, 8, 8 * MAX_LEN, MAX_LEN, rows=4)
    forwards = []
    decode_slots = engine.decode_slots
    engine.decode_slots = lambda first, end, members: forwards.append(first) or decode_slots(
        first, end, members)
    engine.generate(seqs)
    for seq, expected in zip(seqs, alone):
        assert seq.generated == expected.response_ids
        assert [lp for lp, _, _ in seq.logprobs] == expected.logprobs
    assert engine.moves == 2
    # prefill draws token 1; one step of both groups draws token 2 and ends the short ones;
    # the long ones' 22 remaining tokens then take one forward each
    assert forwards == [0, 4] + [0] * 22
    work = engine.work  # what /metrics reports as reprorl:engine_*
    assert work["decode_forwards"] == 24 and work["decode_rows"] == 8 + 4 * 22
    assert work["decode_adapters"] == 0  # the base model
    assert 0 < work["decode_seconds"] + work["prefill_seconds"] <= work["busy_seconds"]


def test_spanning_forwards_cover_the_slots_in_use_and_keep_the_bits(model, one_thread):
    """Groups of 16 rows on the CPU with one thread: where a row's bits are the same at every
    row count from 16 up (`rows_invariant`, true on this project's machines), a decode
    forward spans the slots up to the highest in use. 40 prompts on 32 slots, ending after
    1 to 24 tokens, draw the bits each draws alone (one 16-row forward a step); the forwards
    hold 16 to 32 rows, and sequences left above holes move down. Where the probe fails,
    or with two threads, the engine decodes by groups of 16."""
    from reprorl.serve.engine import Engine
    from reprorl.serve.invariance import rows_invariant
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence

    pool = prompts(40, 17)
    limits = [1 + (7 * i) % 24 for i in range(len(pool))]
    alone = [sample_many(model, [p], limit, -1, MAX_LEN, generators([i]), rows=16)[0]
             for i, (p, limit) in enumerate(zip(pool, limits))]
    seqs = [Sequence(list(p), Params(max_tokens=limit, temperature=1.0, logprobs=0),
                     None, generator)
            for p, limit, generator in zip(pool, limits, generators(range(len(pool))))]
    engine = Engine(model, {}, 32, 32 * MAX_LEN, MAX_LEN, rows=16)
    assert engine.span == rows_invariant(model)
    sizes = []
    decode_slots = engine.decode_slots
    engine.decode_slots = lambda first, end, members: sizes.append(end - first) or decode_slots(
        first, end, members)
    engine.generate(seqs)
    for seq, expected in zip(seqs, alone):
        assert seq.generated == expected.response_ids
        assert [lp for lp, _, _ in seq.logprobs] == expected.logprobs
    assert engine.work["decode_forwards"] == len(sizes)
    assert engine.work["decode_slots"] == sum(sizes)
    if engine.span:
        assert min(sizes) == 16 and max(sizes) == 32
        assert any(16 < size < 32 for size in sizes) and engine.moves > 0
    else:
        print("this CPU's products change bits with the row count: decoded by groups")
        assert set(sizes) == {16}
    torch.set_num_threads(2)
    assert not engine.span and not engine.stacked


@pytest.mark.parametrize("family, heads, kv_heads", [
    ("qwen2", 2, 1), ("qwen2", 4, 2), ("qwen2", 2, 2), ("llama", 4, 2), ("llama", 2, 2)])
def test_a_written_out_decode_step_gives_the_model_calls_logits(one_thread, family, heads,
                                                                 kv_heads):
    """`decode_step.logits` stands in for the model call in the engine's decode forwards of a
    Qwen2 or a Llama under SDPA (query heads grouped on one or two key/value heads, or not):
    every forward's logits are the model call's, bit for bit, at every row count and
    attended length a run reaches, with adapters of rank 8 (stacked where `stacks_rank`
    finds it keeps the bits), rank 1 (alone on this project's CPUs) and none beside each
    other. A model with a hook where the written-out step would skip it is not supported."""
    from reprorl.serve import decode_step
    from reprorl.serve.engine import Engine
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence
    from reprorl.serve.weights import install_switches

    model = tiny_qwen(3, heads, kv_heads, family)
    config, family_class = model.config, type(model)
    switches = install_switches(model)
    generator = torch.Generator().manual_seed(8)
    loras = [None] + [random_adapter(name, rank, switches, generator)
                      for name, rank in (("a", 8), ("b", 8), ("c", 1))]
    pool = prompts(40, 23)

    def run(written_out: bool) -> tuple[list, list]:
        engine = Engine(model, switches, 32, 32 * MAX_LEN, MAX_LEN, rows=16)
        assert engine.written_out
        engine.written_out = written_out
        forwards, decode_slots = [], engine.decode_slots

        def recorded(first, end, members):
            logits = decode_slots(first, end, members)
            forwards.append((end - first, logits))
            return logits
        engine.decode_slots = recorded
        seqs = [Sequence(list(p), Params(max_tokens=1 + 5 * i % 30, temperature=1.0,
                                         logprobs=2), loras[i % 4],
                         torch.Generator().manual_seed(i)) for i, p in enumerate(pool)]
        engine.generate(seqs)
        return forwards, [(seq.generated, seq.logprobs) for seq in seqs]

    written, outputs = run(True)
    called, expected = run(False)
    assert outputs == expected
    assert [rows for rows, _ in written] == [rows for rows, _ in called]
    assert len({rows for rows, _ in written}) > 3  # the forwards spanned many row counts
    for (_, ours), (_, theirs) in zip(written, called):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[slot], theirs[slot]) for slot in ours)
    hook = model.model.layers[1].self_attn.register_forward_hook(lambda *_: None)
    assert not decode_step.supported(model)
    hook.remove()
    assert decode_step.supported(model)
    assert not decode_step.supported(type("Wrapped", (family_class,), {})(config))
    eager = family_class._from_config(config, attn_implementation="eager")  # sets config's
    assert not decode_step.supported(eager)


def test_an_adapter_that_overflows_leaves_the_other_rows_alone(model, one_thread):
    """A client's adapter whose branch overflows to Inf poisons only its own rows: a base row
    and a row of another adapter in the same decode forward keep their exact results,
    whether the adapters run stacked (one thread) or each on its own (two threads)."""
    from torch import nn

    from reprorl.model.lora import with_adapter
    from reprorl.serve.adapters import Adapter
    from reprorl.serve.engine import Engine
    from reprorl.serve.weights import Switch

    base = nn.Linear(64, 32)
    switches = {"proj": Switch(base)}
    engine = Engine(model, switches, 16, 16 * MAX_LEN, MAX_LEN, rows=16)
    generator = torch.Generator().manual_seed(3)

    def adapter(name, size):
        return Adapter(name, "", {"proj": (torch.randn(8, 64, generator=generator) * size,
                                           torch.randn(32, 8, generator=generator) * size,
                                           0.5)})

    good, huge = adapter("good", 0.1), adapter("huge", 1e30)
    x = torch.randn(16, 1, 64, generator=generator)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert engine.stacked == (threads == 1 and engine.adapters.ranks[16])
        # row 2: the base model
        engine.adapters.adapt_rows(16, 3, [(good, [0]), (huge, [1])], engine.stacked)
        with torch.no_grad():
            out = switches["proj"](x)
            expected = with_adapter(base(x), x, *good.weights["proj"])
            assert torch.equal(out[0], expected[0]) and torch.isinf(out[1]).any()
            assert torch.equal(out[2], base(x)[2])


def test_a_switch_reads_a_column_major_copy_only_where_it_gives_the_layers_bits(
        one_thread, monkeypatch):
    """`Switch.product` gives the base layer's bits at every row count: a count's first
    product probes the two reads (on this project's CPUs they agree from 16 rows up); a count
    where they differ never reads the copy; at one where they agree the copy is read, made
    again when the weight changes in place (a full-weight reload)."""
    from torch import nn

    from reprorl.serve import invariance
    from reprorl.serve.weights import Switch

    monkeypatch.setattr(invariance, "AGREEMENT", {})  # this test's probes only
    generator = torch.Generator().manual_seed(5)
    base = nn.Linear(64, 96)
    switch = Switch(base)
    counts = range(1, 41)

    def inputs(rows):
        return [torch.randn(*shape, generator=generator) for shape in ((1, rows, 64),
                                                                       (rows, 1, 64))]

    with torch.inference_mode():
        for _ in range(2):  # probed first, then read the way the probe chose
            for rows in counts:
                for x in inputs(rows):
                    assert torch.equal(switch(x), base(x)), f"{tuple(x.shape)} changed bits"
        agreement = invariance.AGREEMENT[((64, 96), True, 1)]
        assert set(agreement) == set(counts)
        # a read that differs: the probe says so, and the copy is never read at that count
        right = invariance.column_product
        monkeypatch.setattr(invariance, "column_product",
                            lambda x, columns, bias: right(x, columns, bias) + 1)
        for x in inputs(41) * 2:
            assert torch.equal(switch(x), base(x))
        assert agreement[41] is False
        monkeypatch.setattr(invariance, "column_product", right)
        monkeypatch.setitem(agreement, 40, True)  # as on this project's CPUs: the copy is read
        base.weight.copy_(torch.randn(96, 64, generator=generator))
        x = torch.randn(1, 40, 64, generator=generator)
        assert torch.equal(switch(x), right(x, base.weight.t().contiguous(), base.bias))


def test_a_warmed_up_engine_probes_only_its_prompts_lengths_and_keeps_the_bits(
        one_thread, monkeypatch):
    """`Engine.warm_up` settles before the first request what the engine probes once per
    process: `invariance.linear`'s agreement at every row count a decode forward can have, for
    every projection shape, and the engine's own probes; afterwards, sampling 40 sequences of
    an adapter over 32 slots adds no probe but `linear`'s at each new prompt length, and draws
    the bits a cold engine draws."""
    from reprorl.serve import invariance
    from reprorl.serve.engine import Engine
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence
    from reprorl.serve.weights import install_switches

    model = tiny_qwen(2)
    switches = install_switches(model)
    lora = random_adapter("a", 8, switches, torch.Generator().manual_seed(6))
    rng = random.Random(31)  # prompts of 40 tokens or more: above any decode row count here
    pool = [[rng.randrange(4, 64) for _ in range(rng.randrange(40, 150))] for _ in range(40)]

    def run(warm: bool) -> tuple[list, dict, dict]:
        monkeypatch.setattr(invariance, "AGREEMENT", {})  # this engine's probes only
        monkeypatch.setattr(invariance, "PROBED", {})
        engine = Engine(model, switches, 32, 32 * MAX_LEN, MAX_LEN, rows=16)
        if warm:
            engine.warm_up()
            engine.settle_rank(lora.rank)  # the server asks it as it loads an adapter
            decode_counts = set(range(16, 33)) if engine.span else {16}
            shapes = {(tuple(s.base.weight.shape[::-1]), s.base.bias is not None, 1)
                      for s in switches.values()}  # (the copy's shape, bias, threads)
            assert set(invariance.AGREEMENT) == shapes
            assert all(decode_counts <= set(counts)  # and the head probe's prompt lengths
                       for counts in invariance.AGREEMENT.values())
        settled = {key: set(counts) for key, counts in invariance.AGREEMENT.items()}
        probed = dict(invariance.PROBED)
        seqs = [Sequence(list(p), Params(max_tokens=1 + (5 * i) % 20, temperature=1.0,
                                         logprobs=0), lora, torch.Generator().manual_seed(i))
                for i, p in enumerate(pool)]
        engine.generate(seqs)
        assert engine.work["decode_forwards"] > 0
        after = {key: set(counts) - settled.get(key, set())
                 for key, counts in invariance.AGREEMENT.items()}
        return [(s.generated, s.logprobs) for s in seqs], after, probed

    cold, _, _ = run(False)
    warm, added, probed = run(True)
    assert warm == cold
    assert probed == invariance.PROBED  # rows, heads and the adapter's rank: all at warm-up
    lengths = {len(p) for p in pool}
    for key, counts in added.items():
        assert counts <= lengths, f"{key}: probed at {sorted(counts - lengths)} rows"


def test_a_sequence_keeps_its_bits_whatever_adapters_of_its_rank_run_beside_it(one_thread):
    """Stacked adapters (one thread): a sequence of a rank-1 adapter, and one of a rank-8
    adapter, draw the same bits alone and beside other adapters of their rank. On this
    project's CPUs a `bmm` of rank 1 gives other bits with one item than with two, so a rank
    whose batched products change with the stack (`rows_invariant` at that rank) runs each
    adapter on its own."""
    from reprorl.serve.engine import Engine
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence
    from reprorl.serve.weights import install_switches

    model = tiny_qwen(1)
    switches = install_switches(model)
    generator = torch.Generator().manual_seed(4)
    a, b, c, d = (random_adapter(name, rank, switches, generator)
                  for name, rank in (("a", 1), ("b", 1), ("c", 8), ("d", 8)))
    params = Params(max_tokens=16, temperature=1.0, logprobs=0)
    pool = prompts(4, 29)

    def run(pairs) -> list[Sequence]:
        seqs = [Sequence(list(pool[i]), params, lora, torch.Generator().manual_seed(i))
                for i, lora in pairs]
        Engine(model, switches, 16, 16 * MAX_LEN, MAX_LEN, rows=16).generate(seqs)
        return seqs

    alone = [run([(0, a)])[0], run([(2, c)])[0]]
    together = run([(0, a), (1, b), (2, c), (3, d)])
    for seq, expected in zip((together[0], together[2]), alone):
        assert (seq.generated, seq.logprobs) == (expected.generated, expected.logprobs)


SETTINGS = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7, "top_k": 5},
            {"temperature": 1.3, "top_p": 0.8}, {"temperature": 0.9, "min_p": 0.05},
            {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.01}]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_rows_drawn_together_get_the_bits_each_gets_alone(settings, threads):
    """The engine draws a decode step's rows that share their settings in one block
    (`logprobs.draw`): each row's log-probs, token, top log-probs and rank are bitwise what the
    row alone gives, and `race` draws the token `torch.multinomial` draws with the same
    generator state. Rows with ties, -inf and a wide range of scales."""
    from reprorl.serve.logprobs import Params, draw, processed_logprobs, race

    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(24, 1024, generator=generator) * torch.logspace(-1, 1.5, 24)[:, None]
    logits[3, :40] = logits[3].max()  # a tie across the top tokens
    logits[5, 100:] = -math.inf
    params = Params(max_tokens=8, logprobs=8, sampling_mask=True, **settings)
    generators = [torch.Generator().manual_seed(row) for row in range(24)]
    seen = [1, 2] if params.repetition_penalty != 1 else None
    together = draw(logits, params, generators, seen)
    for row in range(24):
        scores = processed_logprobs(logits[row], params)
        alone = draw(logits[row:row + 1], params, [torch.Generator().manual_seed(row)], seen)
        assert together[row] == alone[0]
        token, logprob, (ids, values), rank, mask = together[row]
        if params.temperature > 0:
            g = torch.Generator().manual_seed(row)
            assert token == int(torch.multinomial(scores.exp(), 1, generator=g))
            assert token == int(race(scores.exp()[None],
                                     [torch.Generator().manual_seed(row)])[0])
        else:
            assert token == int(scores.argmax())
        assert logprob == float(scores[token]) and rank == 1 + int((scores > logprob).sum())
        top = scores.topk(8)
        assert (ids, values) == (top.indices.tolist(), top.values.tolist())
        assert mask == torch.isfinite(scores).nonzero().flatten().tolist()




def test_a_step_of_rows_with_mixed_settings_draws_each_as_alone(model):
    """`Engine.sample` over rows that each differ from temperature 1 with 3 log-probs in one
    setting (so only the grouping keeps them apart), the row without log-probs first: each
    sequence gets what it gets alone, and each row reads its own settings."""
    from reprorl.serve.engine import Engine
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence

    engine = Engine(model, {}, 16, 16 * MAX_LEN, MAX_LEN, rows=16)
    base = {"max_tokens": 8, "temperature": 1.0, "logprobs": 3}
    variants = [{"logprobs": None}, {}, {"temperature": 0.0}, {"temperature": 0.6},
                {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.2}, {"sampling_mask": True},
                {"repetition_penalty": 1.3}]
    mixed = [Params(**{**base, **variant}) for variant in variants]
    logits = torch.randn(4 * len(mixed), 64, generator=torch.Generator().manual_seed(5))

    def seq(i: int) -> Sequence:
        return Sequence(list(range(4, 12 + i)), mixed[i % len(mixed)], None,
                        torch.Generator().manual_seed(i))

    together = [seq(i) for i in range(len(logits))]
    engine.sample(together, logits)
    for i, one in enumerate(together):
        alone = seq(i)
        engine.sample([alone], logits[i:i + 1])
        assert (one.generated, one.logprobs, one.ranks, one.masks) == (
            alone.generated, alone.logprobs, alone.ranks, alone.masks), i
        assert one.error is None and bool(one.masks) == one.params.sampling_mask
        assert bool(one.logprobs) == (one.params.logprobs is not None)


def test_a_row_whose_log_probs_hold_nan_fails_its_own_sequence_only(model):
    from reprorl.serve.engine import Engine
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence

    engine = Engine(model, {}, 16, 16 * MAX_LEN, MAX_LEN, rows=16)
    params = Params(max_tokens=8, temperature=1.0, logprobs=0)
    seqs = [Sequence([1, 2], params, None, torch.Generator().manual_seed(i)) for i in range(3)]
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = math.nan
    engine.sample(seqs, logits)
    assert [len(seq.generated) for seq in seqs] == [1, 0, 1]
    assert seqs[1].error.status == 500 and "NaN" in seqs[1].error.message
    assert seqs[0].error is None and seqs[2].error is None


def test_a_slot_taken_again_holds_zeros_past_its_new_occupant(model):
    """`KVSlots.fill` zeroes only what earlier occupants wrote (`KVSlots.written`), not the whole
    slot: long sequences, ending at different steps (so `compact` moves some down), then short
    ones into the same slots. After every fill, each layer's keys and values past the new
    occupant are zeros, as a whole-slot zeroing leaves them (a stale Inf there would meet a
    masked weight 0: NaN), and so is every slot past its `written` mark after each run."""
    from reprorl.serve.engine import Engine
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence

    engine = Engine(model, {}, 8, 8 * MAX_LEN, MAX_LEN, rows=4)
    fill, fills = engine.kv.fill, []

    def checked(slot, kv):
        fill(slot, kv)
        for layer in engine.kv.cache.layers:
            for store in (layer.keys, layer.values):
                assert not store[slot, :, kv[0][0].shape[1]:].any(), slot
        fills.append(slot)

    def zeros_past_written():
        for layer in engine.kv.cache.layers:
            for store in (layer.keys, layer.values):
                for slot, written in enumerate(engine.kv.written):
                    assert not store[slot, :, written:].any(), slot

    engine.kv.fill = checked
    pool = prompts(24, 5)
    long = [Sequence(pool[i][:60] + [4] * (60 - len(pool[i][:60])),
                     Params(max_tokens=(20, 60)[i % 2], temperature=1.0), None,
                     torch.Generator().manual_seed(i)) for i in range(8)]
    engine.generate(long)
    zeros_past_written()
    assert engine.moves > 0 and max(engine.kv.written) > 60  # moved, and decoded past prompts
    short = [Sequence(pool[8 + i][:4 + i], Params(max_tokens=3, temperature=1.0), None,
                      torch.Generator().manual_seed(i)) for i in range(16)]
    engine.generate(short)
    zeros_past_written()
    assert len(fills) == 24 + engine.moves and all(seq.error is None for seq in long + short)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_a_prompt_sharing_a_head_forwards_only_its_rest_with_the_same_bits(model, threads):
    """Prompts that share a head with one prefilled before them (a system turn, an agent's
    earlier turns): on one thread, where the bits allow it (`reuses_heads`), each forwards
    only what follows the whole 32-token blocks of the longest head it shares, so long as
    16 tokens or more remain and both prompts hold under 192; and draws the bits it draws
    alone, where nothing is reused. With two threads each forwards whole."""
    from reprorl.serve.engine import Engine
    from reprorl.serve.invariance import heads_invariant, rows_invariant
    from reprorl.serve.logprobs import Params
    from reprorl.serve.sequence import Sequence

    rng = random.Random(23)
    system = [rng.randrange(20, 64) for _ in range(40)]  # tails start below 20: a clean fork

    def tail(first: int, length: int) -> list[int]:
        return [first] + [rng.randrange(4, 64) for _ in range(length - 1)]

    first = system + tail(4, 40)
    turn = first + tail(8, 30)
    long, longest = first + tail(10, 130), first + tail(16, 112)
    cases = [(first, 0),
             (system + tail(5, 30), 32),  # shares 40 tokens: one block
             (system + tail(6, 10), 32),  # 50 tokens: one block, 18 left
             (system + tail(12, 8), 32),  # 48 tokens: one block, 16 left
             (system + tail(13, 7), 0),  # 47 tokens: a block would leave 15
             (system[:30] + tail(7, 40), 0),  # under one block
             (turn, 64),  # a later turn: 80 shared with `first`, two blocks
             (turn[:100] + tail(14, 20), 96),  # 100 with `turn`, which reused a head itself
             (long, 0),  # 210 tokens: whole
             (long[:100] + tail(11, 30), 64),  # 100 with `long`, too long: 80 with `first`
             (first + tail(15, 111), 64),  # 191 tokens: still reuses
             (longest, 0),  # 192 tokens: whole
             (longest[:150] + tail(17, 20), 64)]  # 150 with `longest`, too long
    pool, reused = [p for p, _ in cases], [r for _, r in cases]
    alone = [sample_many(model, [p], 12, -1, MAX_LEN, generators([i]), rows=4)[0]
             for i, p in enumerate(pool)]
    params = Params(max_tokens=12, temperature=1.0, logprobs=0)
    seqs = [Sequence(list(p), params, None, generator)
            for p, generator in zip(pool, generators(range(len(pool))))]
    engine = Engine(model, {}, 16, 16 * MAX_LEN, MAX_LEN, rows=4)  # all prefilled at once
    forwarded = []
    forward = model.forward
    heads_invariant(model)  # probed before counting the forwards
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "forward", lambda input_ids, **kw: forwarded.append(
            input_ids.shape[1]) or forward(input_ids=input_ids, **kw))
        engine.generate(seqs)
    for seq, expected in zip(seqs, alone):
        assert seq.generated == expected.response_ids
        assert [lp for lp, _, _ in seq.logprobs] == expected.logprobs
    if not engine.reuses_heads:
        reused = [0] * len(pool)
    assert engine.counters["prefix_cache_hits"] == engine.work["prefill_shared_tokens"] == sum(
        reused)
    assert forwarded[:len(pool)] == [len(p) - r for p, r in zip(pool, reused)]  # prefills
    # required where the products' rows keep their bits, as on this project's machines: else
    # a broken reuse would only switch itself off unseen
    assert engine.reuses_heads == (threads == 1 and rows_invariant(model))
    assert heads_invariant(model) or not rows_invariant(model), "a reused head moved bits"


def test_a_prefill_store_shared_between_calls_keeps_every_prompt_and_the_bits(model):
    """The curves' greedy and sampled passes over one set of prompts: the second call, given
    the first's store, prefills nothing and draws the bits it draws without the store."""
    from collections import OrderedDict

    from reprorl.serve.kv_slots import PREFIX_CACHE_PROMPTS

    pool = prompts(PREFIX_CACHE_PROMPTS + 4, 11)
    seeds = list(range(len(pool)))
    plain = (sample_many(model, pool, 24, EOS, MAX_LEN, rows=4),
             sample_many(model, pool, 24, EOS, MAX_LEN, generators(seeds), rows=4))
    store = OrderedDict()
    greedy = sample_many(model, pool, 24, EOS, MAX_LEN, rows=4, prefills=store)
    first = {key: id(entry) for key, entry in store.items()}
    shared = (greedy, sample_many(model, pool, 24, EOS, MAX_LEN, generators(seeds), rows=4,
                                  prefills=store))
    assert len(first) == len(set(map(tuple, pool))) > PREFIX_CACHE_PROMPTS
    assert {key: id(entry) for key, entry in store.items()} == first  # nothing prefilled again
    for before, after in zip(plain, shared):
        assert [r.response_ids for r in before] == [r.response_ids for r in after]
        assert [r.logprobs for r in before] == [r.logprobs for r in after]


def test_greedy_answers_match_one_sequence_decoding(model):
    """The engine and transformers' own cache pick the same tokens (log-probs may differ in
    the last bits: other kernels)."""
    pool = prompts(12, 3)
    batched = sample_many(model, pool, 24, EOS, MAX_LEN, rows=4)
    for prompt, result in zip(pool, batched):
        single = sample(model, prompt, 24, EOS)
        assert result.response_ids == single.response_ids
        assert result.finish_reason == single.finish_reason
        assert max(abs(a - b) for a, b in zip(result.logprobs, single.logprobs)) < 1e-4


def test_a_response_cut_at_the_token_limit_says_so(model):
    result = sample_many(model, prompts(1, 4), 2, eos_id=-1, max_len=MAX_LEN)[0]
    assert result.finish_reason == "cut" and len(result.response_ids) == 2


def test_a_prompt_with_no_room_left_is_refused_by_name(model):
    with pytest.raises(ReproError, match=r"prompts \[1\].*limits.context_tokens"):
        sample_many(model, [[5] * 10, [5] * 240], 24, EOS, MAX_LEN)


def test_eager_attention_samples_as_sdpa_does(model):
    """The engine's 4-D decode mask reaches eager attention in its additive form
    (`encoding.mask_for`): the same greedy tokens as SDPA, log-probs equal to float rounding."""
    eager = Qwen2ForCausalLM(Qwen2Config(**{**model.config.to_dict(),
                                            "attn_implementation": "eager"})).eval()
    eager.load_state_dict(model.state_dict())
    assert eager.config._attn_implementation == "eager"
    pool = prompts(12, 5)
    expected = sample_many(model, pool, 24, EOS, MAX_LEN)
    found = sample_many(eager, pool, 24, EOS, MAX_LEN)
    assert [s.response_ids for s in found] == [s.response_ids for s in expected]
    for a, b in zip(found, expected):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
