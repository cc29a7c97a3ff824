"""Tree packing and the token-budget batcher: the layout, the budget, the metrics, and the
forward and backward of the real GRPO loss, packed against padded and against each sample
forwarded alone, on random groups with shared prefixes, forks, later turns and any lengths.

Tolerance: packed and padded agree to float32 reduction order, not bitwise. A packed token's
attention sums over its row's keys behind the tree mask where a padded one sums over its
sample's padded length, and a linear layer's result for one token changes with the shape of
the matrix it is part of (a row of the trie against a block of padded rows), so each value
may differ by a few float32 ulps
(2^-23 relative, about 1e-7) per reduction. Over the few layers here that stays below 1e-6 on
log-probs of magnitude ~5 (measured over 8 seeds: 4.8e-7 at most), so the bound is 1e-5
absolute, ten times that. A gradient sums such terms over every trained token, so it is
compared relative to its own size: 1e-5 of its largest entry (measured: 8.1e-7 at most). The
same samples in the same order, on the other hand, give bitwise the same rows, loss and
gradients.
"""

from __future__ import annotations

import random

import pytest
import torch

from reprorl.grpo import AsyncGRPOConfig
from reprorl.grpo.batching import TokenBudgetBatcher, pad_collate, record_rows
from reprorl.grpo.metrics import MetricsWindow
from reprorl.grpo.microbatch_loss import kept_logits, microbatch_loss
from reprorl.grpo.samples import Sample, TrainingSequence
from reprorl.model import lora

VOCAB = 97
LOGP_ATOL = 1e-5  # absolute, on per-token log-probs (see the module's docstring)
GRAD_RTOL = 1e-5  # relative to the largest gradient entry

# ---------------------------------------------------------------- random groups


def make_sample(ids: list[int], trained: list[int], position: int, rng,
                group_samples: int = 1) -> Sample:
    top = [{rng.randrange(VOCAB): -0.5, rng.randrange(VOCAB): -1.5} if t else None
           for t in trained]
    sequence = TrainingSequence(ids, trained, [-rng.uniform(3, 6) * t for t in trained], top)
    return Sample(sequence, rng.uniform(-1, 1), 0.0, {}, 0.0, {}, 0, position, position,
                  group_samples, len(ids), 0.0, "rollout", "")


def random_groups(seed: int, groups: int = 3, size: int = 4) -> list[Sample]:
    """Groups of `size` completions of one prompt (every prompt opens with the same template),
    forking from a shared stem at random depths (0: nothing shared), of random lengths; and per
    group one later turn that repeats its first rollout and adds a prompt and a completion."""
    rng = random.Random(seed)
    template = [rng.randrange(VOCAB) for _ in range(5)]
    samples = []
    for position in range(groups):
        prompt = template + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))]
        stem = [rng.randrange(VOCAB) for _ in range(4)]
        for _ in range(size):
            completion = stem[: rng.randint(0, 4)] + [rng.randrange(VOCAB)
                                                      for _ in range(rng.randint(1, 9))]
            samples.append(make_sample(prompt + completion,
                                       [0] * len(prompt) + [1] * len(completion), position, rng))
        first = samples[-size].sequence
        turn = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
        answer = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
        samples.append(make_sample(first.input_ids + turn + answer,
                                   first.trained + [0] * len(turn) + [1] * len(answer),
                                   position, rng))
    return samples


def pack(samples: list[Sample], budget: int, rows: int) -> tuple[list, TokenBudgetBatcher]:
    """The leading samples that fit one micro-batch, as the queue would take them."""
    batcher, taken = TokenBudgetBatcher(budget, rows, 2, 0), []
    for sample in samples:
        if not batcher.fits(taken, sample):
            break
        taken.append(sample)
    return taken, batcher


def distinct_prefixes(samples: list[Sample]) -> int:
    """Tokens of a trie of these samples: one per distinct prefix."""
    return len({tuple(s.sequence.input_ids[: k + 1]) for s in samples
                for k in range(s.tokens)})


# ---------------------------------------------------------------- the layout


def test_the_source_documents_example_with_the_fork_token_shared():
    """p1 p2 p3 a1 a2 and p1 p2 p3 b1 b2: one trie; p3 predicts a1 and b1 from one position
    (the document keeps p3 once per branch, see packing.py), positions restart per branch and
    each token sees exactly its own rollout's prefix."""
    rng = random.Random(0)
    p, a, b = [11, 12, 13], [21, 22], [31, 32]
    samples = [make_sample(p + a, [0, 0, 0, 1, 1], 0, rng),
               make_sample(p + b, [0, 0, 0, 1, 1], 0, rng)]
    batch = TokenBudgetBatcher(16, 1, 2, 0).collate(samples)
    (row,) = batch.forwards
    assert row.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4]]
    sees = [[k for k in range(7) if row.attention_mask[0, 0, q, k]] for q in range(7)]
    assert sees == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 5],
                    [0, 1, 2, 5, 6]]
    assert row.keep.tolist() == [2, 3, 5]  # a1 and b1 both predicted at p3 (index 2)
    assert row.keep[batch.index].tolist() == [[2, 3], [2, 5]]
    assert batch.targets.tolist() == [a, b]
    assert (batch.sample_tokens, batch.forwarded_tokens, batch.padding) == (10, 7, 0)
    assert batch.trained_positions == 4 and batch.row_costs == [1 + 2 + 3 + 4 + 5 + 4 + 5]


@pytest.mark.parametrize("seed", range(6))
def test_rows_respect_the_budget_and_count_shared_tokens_once(seed):
    rng = random.Random(seed)
    samples = random_groups(seed, groups=rng.randint(2, 5))
    budget, rows = rng.randint(40, 120), rng.randint(1, 4)
    taken, batcher = pack(samples, budget, rows)
    assert taken and taken == samples[: len(taken)]
    batch = batcher.collate(taken)
    assert len(batch.row_tokens) <= rows and max(batch.row_tokens) <= budget
    assert sum(batch.row_samples) == len(taken)
    assert sum(batch.row_tokens) == batch.forwarded_tokens >= distinct_prefixes(taken)
    if len(batch.row_tokens) == 1:  # one trie: every shared prefix forwarded once
        assert batch.forwarded_tokens == distinct_prefixes(taken)
    if len(taken) < len(samples):  # the next sample fits no row: the micro-batch closes
        assert not TokenBudgetBatcher(budget, rows, 2, 0).fits(taken, samples[len(taken)])
    # the same samples in the same order: the same micro-batch, whether built sample by
    # sample through fits() or at once
    again = TokenBudgetBatcher(budget, rows, 2, 0).collate(list(taken))
    tensors = ("index", "targets", "trained", "sampler_logp", "top_ids", "top_sampler_logp",
               "advantages")
    pairs = [(getattr(batch, n), getattr(again, n)) for n in tensors] + [
        (getattr(f, n), getattr(g, n)) for f, g in zip(batch.forwards, again.forwards, strict=True)
        for n in ("input_ids", "attention_mask", "position_ids", "keep")]
    assert all(torch.equal(a, b) for a, b in pairs)
    assert (batch.row_tokens, batch.row_costs) == (again.row_tokens, again.row_costs)


def test_placement_keeps_a_group_together_and_balances_the_rows():
    rng = random.Random(1)

    def group(position, prompt, completions):
        return [make_sample(prompt + c, [0] * len(prompt) + [1] * len(c), position, rng)
                for c in completions]

    a = group(0, [1, 2, 3, 4], [[5], [6], [7]])  # its own row: 7 tokens, 25 pairs
    b = group(1, [8, 9], [[10, 11, 12, 13]])  # shares nothing: a new row, 6 tokens, 21 pairs
    c = group(2, [14, 15, 16], [[17]])  # shares nothing, fits both: the cheaper row
    batch = TokenBudgetBatcher(12, 2, 2, 0).collate(a + b + c)
    assert batch.row_samples == [3, 2] and batch.row_tokens == [7, 10]
    assert batch.row_costs == [25, 21 + 10]
    d = group(3, [1, 2], [[18]])  # shares [1, 2] with row 0: goes there, costlier as it is
    assert TokenBudgetBatcher(12, 2, 2, 0).collate(a + b + c + d).row_samples == [4, 2]
    # a sample whose group's row is full may go to another row only if that row does not
    # become the costliest; a new group's sample of the same length may
    wide = group(0, [1, 2], [[x] for x in range(3, 11)])  # row 0: 10 tokens, 27 pairs
    other = group(1, [20], [[21]])  # row 1: 2 tokens, 3 pairs
    spill = group(0, [1, 2], [[11, 12, 13, 14, 15]])[0]  # row 0 is full; row 1 -> 31 pairs
    fresh = group(2, [40, 41], [[42, 43, 44, 45, 46]])[0]
    batcher = TokenBudgetBatcher(10, 2, 2, 0)
    assert batcher.collate(wide + other).row_costs == [27, 3]
    assert not batcher.fits(wide + other, spill) and batcher.fits(wide + other, fresh)
    # a new group goes where it shares most only if the rest of the group has room there
    first = group(0, [1, 2, 3], [[4, 5, 6]])  # row 0: 6 tokens
    for samples, row in ((5, 0), (6, 1)):  # [1, 2] shared: 6 + 2 + (samples - 1) <= 12?
        newcomer = make_sample([1, 2, 7, 8], [0, 0, 0, 1], 1, rng, group_samples=samples)
        assert TokenBudgetBatcher(12, 2, 2, 0).collate(
            first + [newcomer]).row_samples == ([2] if row == 0 else [1, 1])


def test_oversize_samples_are_dropped_and_counted_by_the_queue():
    from tests.test_grpo_units import Pipeline

    rng = random.Random(2)
    long, short = (make_sample(list(range(1, n + 1)), [0] * (n - 1) + [1], 0, rng)
                   for n in (17, 5))
    p = Pipeline(budget=16, rows=2, end=1)
    p.put(0, long, short)
    assert p.queue.next_microbatch(p.batcher) == [short]
    assert p.metrics()["batch/dropped_oversize_count"] == 1


def test_a_full_micro_batch_does_not_wait_for_another_group():
    from tests.test_grpo_units import Pipeline, sample

    p = Pipeline(budget=8, rows=1, patience=0)  # a check on the worker would fail the test
    p.put(0, sample(0), sample(0))
    assert len(p.queue.next_microbatch(p.batcher)) == 2 and p.checks == 0


def metrics(batch, budget: int) -> dict:
    window = MetricsWindow()
    record_rows(window, batch, budget)
    return window.reduce()


def test_row_metrics_are_measured_on_the_rows():
    taken, batcher = pack(random_groups(3, groups=3), 60, 3)
    batch = batcher.collate(taken)
    m, rows = metrics(batch, 60), len(batch.row_tokens)
    assert rows == 3 and m["batch/samples_per_row"] == pytest.approx(len(taken) / rows)
    assert m["batch/row_tokens_mean"] == pytest.approx(batch.forwarded_tokens / rows)
    assert m["batch/row_tokens_max"] == max(batch.row_tokens)
    assert m["batch/row_fill_frac"] == pytest.approx(batch.forwarded_tokens / rows / 60)
    ratio = sum(s.tokens for s in taken) / batch.forwarded_tokens
    assert m["batch/packing_ratio"] == pytest.approx(ratio) and ratio > 2
    assert m["batch/pad_frac"] == 0.0  # rows are concatenated, never padded
    costs = batch.row_costs
    assert m["batch/row_imbalance"] == pytest.approx(max(costs) * rows / sum(costs))
    # one row, one trie: forwarded tokens and trained positions are the distinct prefixes
    one = TokenBudgetBatcher(10_000, 1, 2, 0).collate(taken)
    trained = {tuple(s.sequence.input_ids[: k + 1]) for s in taken
               for k, t in enumerate(s.sequence.trained) if t}
    assert one.forwarded_tokens == distinct_prefixes(taken)
    assert metrics(one, 10_000)["batch/masked_token_frac"] == pytest.approx(
        1 - len(trained) / one.forwarded_tokens)
    padded = pad_collate(taken, 2, 0)
    padded_m = metrics(padded, 60)
    assert padded_m["batch/pad_frac"] == pytest.approx(padded.padding / padded.forwarded_tokens)
    assert padded_m["batch/packing_ratio"] < 1  # padded rows forward more than the samples


def test_config_fields_mean_rows_and_a_fixed_step():
    config = AsyncGRPOConfig(per_device_train_batch_size=3, gradient_accumulation_steps=2)
    assert config.groups_per_step == 6 and config.token_budget is None  # a group per row
    assert AsyncGRPOConfig(groups_per_step=4).groups_per_step == 4
    with pytest.raises(ValueError, match="groups_per_step must be >= 1"):
        AsyncGRPOConfig(groups_per_step=0)


# ---------------------------------------------------------------- forward and backward


def policy(attention: str = "sdpa"):
    """A random Qwen2 with LoRA adapters whose B is non-zero, so every adapter has a
    gradient."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         attention_dropout=0.0, attn_implementation=attention)
    model = Qwen2ForCausalLM(config).float()
    lora.inject(model, 4, 8.0, 0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.normal_(0, 0.05)
    return model.train()


def loss_and_gradient(model, batch, score_centering=True):
    args = AsyncGRPOConfig(score_centering=score_centering)
    model.zero_grad(set_to_none=True)
    loss, stats = microbatch_loss(model, args, batch)
    loss.backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), gradient, stats


def token_logp(model, batch) -> torch.Tensor:
    """Per-token log-probs of the trained tokens, in (sample, column) order."""
    with torch.no_grad():
        scores = kept_logits(model, batch).float().log_softmax(-1)[batch.index]
        logp = scores.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    return logp[batch.trained]


@pytest.mark.parametrize("seed", range(4))
def test_packed_padded_and_alone_give_the_same_log_probs(seed):
    model = policy()
    samples, _ = pack(random_groups(seed, groups=3), 70, 3)
    packed = token_logp(model, TokenBudgetBatcher(70, 3, 2, 0).collate(samples))
    padded = token_logp(model, pad_collate(samples, 2, 0))
    alone = torch.cat([token_logp(model, pad_collate([s], 2, 0)) for s in samples])
    assert packed.shape == padded.shape == alone.shape and len(packed) > 20
    torch.testing.assert_close(packed, padded, rtol=0, atol=LOGP_ATOL)
    torch.testing.assert_close(packed, alone, rtol=0, atol=LOGP_ATOL)


def test_eager_attention_reads_the_same_tree_mask():
    samples, _ = pack(random_groups(7), 70, 2)
    batch = TokenBudgetBatcher(70, 2, 2, 0).collate(samples)
    torch.testing.assert_close(token_logp(policy("eager"), batch),
                               token_logp(policy("sdpa"), batch), rtol=0, atol=LOGP_ATOL)


@pytest.mark.parametrize("seed,score_centering", [(0, True), (1, True), (2, False)])
def test_packed_and_padded_give_the_same_loss_and_gradients(seed, score_centering):
    model = policy()
    samples, _ = pack(random_groups(seed, groups=3), 80, 2)
    packed_batch = TokenBudgetBatcher(80, 2, 2, 0).collate(samples)
    packed, packed_gradient, packed_stats = loss_and_gradient(model, packed_batch,
                                                              score_centering)
    padded, padded_gradient, padded_stats = loss_and_gradient(model, pad_collate(samples, 2, 0),
                                                              score_centering)
    assert packed_batch.forwarded_tokens < pad_collate(samples, 2, 0).real_tokens
    torch.testing.assert_close(packed, padded, rtol=0, atol=LOGP_ATOL)
    scale = padded_gradient.abs().max()
    assert scale > 0
    assert (packed_gradient - padded_gradient).abs().max() <= GRAD_RTOL * scale
    for name in ("entropy", "sampling/importance_sampling_ratio/mean"):
        torch.testing.assert_close(torch.tensor(packed_stats[name]),
                                   torch.tensor(padded_stats[name]), rtol=1e-4, atol=LOGP_ATOL)
    # bitwise: the same samples in the same order, packed again, give the same bits
    again, again_gradient, _ = loss_and_gradient(
        model, TokenBudgetBatcher(80, 2, 2, 0).collate(list(samples)), score_centering)
    assert torch.equal(packed, again) and torch.equal(packed_gradient, again_gradient)


def test_micro_batches_move_whole_and_stay_themselves_on_the_cpu():
    """What the trainer does to a micro-batch before its forward (`model.device`)."""
    batch = TokenBudgetBatcher(70, 3, 2, 0).collate(random_groups(0))
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(torch.device("meta"))
    tensors = [v for v in vars(moved).values() if isinstance(v, torch.Tensor)]
    tensors += [t for f in moved.forwards for t in vars(f).values()]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert (moved.row_tokens, moved.padding, moved.sample_tokens) == (
        batch.row_tokens, batch.padding, batch.sample_tokens)
    assert all(t.device.type == "cpu" for f in batch.forwards for t in vars(f).values())
