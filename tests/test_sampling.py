"""The stages' sampler (`sampling.sample_many`) on a random tiny Qwen2: what it returns for a
prompt does not depend on what is sampled beside it, bit for bit, greedy and seeded."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from reprorl.errors import ReproError
from reprorl.sampling import sample, sample_many

# prompts of 3 to 150 tokens in slots of 256: one decode group mixes attention windows of 64
# to 192 positions, which must not change any row's bits either
EOS, MAX_LEN = 3, 256


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=MAX_LEN)
    return Qwen2ForCausalLM(config).eval()


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
    from reprorl.engine import PREFIX_CACHE_PROMPTS, Engine, Params, Sequence

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
    from reprorl.engine import Engine, Params, Sequence

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
    from reprorl.engine import Engine, Params, Sequence, rows_invariant

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


def test_an_adapter_that_overflows_leaves_the_other_rows_alone(model, one_thread):
    """A client's adapter whose branch overflows to Inf poisons only its own rows: a base row
    and a row of another adapter in the same decode forward keep their exact results,
    whether the adapters run stacked (one thread) or each on its own (two threads)."""
    from torch import nn

    from reprorl.engine import Adapter, Engine
    from reprorl.grpo.server import Switch
    from reprorl.lora import with_adapter

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
        assert engine.stacked == (threads == 1 and engine.invariant)
        engine.adapt_rows(16, 3, [(good, [0]), (huge, [1])])  # row 2: the base model
        with torch.no_grad():
            out = switches["proj"](x)
            expected = with_adapter(base(x), x, *good.weights["proj"])
            assert torch.equal(out[0], expected[0]) and torch.isinf(out[1]).any()
            assert torch.equal(out[2], base(x)[2])


def test_a_prefill_store_shared_between_calls_keeps_every_prompt_and_the_bits(model):
    """The curves' greedy and sampled passes over one set of prompts: the second call, given
    the first's store, prefills nothing and draws the bits it draws without the store."""
    from collections import OrderedDict

    from reprorl.engine import PREFIX_CACHE_PROMPTS

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
