"""The four roles: isolation, frozen parts, scalar heads, pooling under padding."""

import pytest
import torch
from conftest import tiny_config

from reprorl.core.manifest import ReproError
from reprorl.model import roles
from reprorl.model.encoding import Batch, Example, collate, collate_pairs, example, load_tokenizer


@pytest.fixture(scope="module")
def four(tiny_model):
    config = tiny_config(tiny_model)
    actor = roles.build("actor", config["model"])
    learned = {n: t.detach().clone() for n, t in roles.learned_state(actor).items()}
    return {
        "actor": actor,
        "reference": roles.build("reference", config["model"], learned=learned),
        "reward": roles.build("reward", config["model"]).requires_grad_(False),
        "critic": roles.build("critic", config["model"], learned=learned, adapters_only=True),
    }


@pytest.fixture(scope="module")
def encode(tiny_model):
    """encode(prompt, response) -> Example, with the tiny model's tokenizer and the limits."""
    tokenizer = load_tokenizer(tiny_model)
    limits = tiny_config(tiny_model)["limits"]
    return lambda prompt, answer: example(tokenizer, prompt, answer, limits, prompt[:8])


def test_heads_have_hidden_plus_one_parameters(four):
    hidden = four["actor"].backbone.config.hidden_size
    assert four["actor"].head is None and four["reference"].head is None
    for kind in ("reward", "critic"):
        assert sum(p.numel() for p in four[kind].head.parameters()) == hidden + 1
    assert torch.count_nonzero(four["critic"].head.weight) == 0
    assert four["reward"].head.bias.item() == 0.0
    std = four["reward"].head.weight.std().item()
    assert 0.01 < std < 0.03  # normal(0, 0.02)


def test_isolation_report_and_no_gradient_to_frozen_roles(four, encode):
    batch = collate([encode("Printer silent.", "Next step: re-enable Wi-Fi.")], 0)
    logprobs, mask = four["actor"].token_logprobs(batch)
    values, _ = four["critic"].values(batch)
    with torch.no_grad():
        four["reference"].token_logprobs(batch)
        four["reward"].score(batch)
    ((logprobs * mask).sum() + (values * mask).sum()).backward()
    report = roles.isolation_report(four)
    assert report["reference"]["trainable"] == report["reward"]["trainable"] == 0
    assert report["actor"]["trainable"] == four["actor"].adapter_parameters
    assert report["critic"]["trainable"] == four["critic"].adapter_parameters + 65
    assert report["actor"]["learned_identity"] == report["reference"]["learned_identity"]
    assert report["actor"]["learned_identity"] != report["reward"]["learned_identity"]
    assert len({r["frozen_identity"] for r in report.values()}) >= 1
    for role in four.values():
        role.zero_grad(set_to_none=True)


def test_shared_backbone_is_refused(four):
    shared = dict(four, critic=four["actor"])
    with pytest.raises(ReproError, match="share parameter storage"):
        roles.isolation_report(shared)


def test_reward_pooling_never_reads_padding(four, encode, tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    short = encode("Case A.", "Next step: re-enable Wi-Fi.")
    long = encode("Case B, a much longer description of the trouble.",
                  "Thank you for your patience. It may help to save the open document. "
                  "I hope this helps.")
    reward = four["reward"]
    with torch.no_grad():
        alone = torch.cat([reward.score(collate([e], tokenizer.pad_token_id))
                           for e in (short, long)])
        left = reward.score(collate([short, long], tokenizer.pad_token_id))
        right = reward.score(right_padded([short, long], tokenizer.pad_token_id))
        naive_right = reward._head_on_last_hidden(
            right_padded([short, long], tokenizer.pad_token_id))[:, -1]
    torch.testing.assert_close(left, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(right, alone, rtol=0, atol=1e-5)
    # reading "the last column" of a right-padded batch would have read PAD for the short row
    assert abs(naive_right[0] - alone[0]) > 1e-4


def right_padded(examples: list[Example], pad_id: int) -> Batch:
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id)
    attention = torch.zeros_like(ids)
    response = torch.zeros_like(ids, dtype=torch.bool)
    for row, e in enumerate(examples):
        ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attention[row, : len(e.input_ids)] = 1
        response[row, len(e.prompt_ids) : len(e.input_ids)] = True
    return Batch(ids, attention, (attention.cumsum(1) - 1).clamp(min=0), response)


def test_values_are_read_on_the_prefix_before_each_token(four, encode):
    e = encode("Case C.", "Next step: save the open document.")
    critic = four["critic"]
    with torch.no_grad():
        critic.head.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0))
        batch = collate([e], 0)
        values, mask = critic.values(batch)
        full = critic._head_on_last_hidden(batch)
        critic.head.weight.zero_()
    n = len(e.response_ids)
    assert mask.sum() == n
    # V for response token k comes from position (start of response + k - 1)
    assert torch.equal(values[0, -n:], full[0, -n - 1 : -1])


def test_token_logprobs_match_a_full_forward(four, encode):
    e = encode("Case D.", "It may help to re-enable Wi-Fi.")
    actor = four["actor"]
    with torch.no_grad():
        logprobs, mask = actor.token_logprobs(collate([e], 0))
        logits = actor.backbone(input_ids=torch.tensor([e.input_ids])).logits[0].float()
    n = len(e.response_ids)
    full = logits.log_softmax(-1)[-n - 1 : -1].gather(
        -1, torch.tensor(e.response_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs[0], full, rtol=0, atol=1e-5)
    assert mask.all() and mask.shape[1] == n


def test_unknown_role_and_scoreless_roles(four):
    with pytest.raises(ReproError, match="unknown role"):
        roles.Role("judge", four["actor"].backbone)
    with pytest.raises(ReproError, match="only the reward role"):
        four["critic"].score(None)


def test_packed_pairs_score_as_the_two_sequences_alone(four, encode):
    """`collate_pairs` (the reward update's rows) gives the scores and gradients of scoring
    each response alone, up to float rounding (other reduction lengths); a response never
    sees its pair's other answer: changing the chosen one leaves the rejected score's bits."""
    reward = four["reward"]
    prompts = ["Printer silent.", "Wi-Fi drops at noon every day.", "Mail stuck."]
    pairs = [(encode(p, "Next step: re-enable Wi-Fi."), encode(p, "Please restart it now."))
             for p in prompts]
    reward.requires_grad_(True)
    try:
        chosen, rejected = reward.score_pairs(collate_pairs(pairs, 0))
        chosen.sum().sub(rejected.sum()).backward()
        packed = {n: p.grad.clone() for n, p in reward.named_parameters() if p.grad is not None}
        reward.zero_grad(set_to_none=True)
        alone = reward.score(collate([c for c, _ in pairs] + [r for _, r in pairs], 0))
        alone[:3].sum().sub(alone[3:].sum()).backward()
        for name, grad in packed.items():
            torch.testing.assert_close(grad, dict(reward.named_parameters())[name].grad,
                                       rtol=1e-4, atol=1e-6)
    finally:
        reward.zero_grad(set_to_none=True)
        reward.requires_grad_(False)
    torch.testing.assert_close(chosen.detach(), alone[:3].detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(rejected.detach(), alone[3:].detach(), rtol=0, atol=1e-5)
    other = [(Example(c.name, c.prompt_ids, c.response_ids[::-1]), r) for c, r in pairs]
    with torch.no_grad():
        _, again = reward.score_pairs(collate_pairs(other, 0))
    assert torch.equal(again, rejected.detach())
    with pytest.raises(ReproError, match="different prompts"):
        collate_pairs([(pairs[0][0], pairs[1][1])], 0)


def test_generation_scores_each_distinct_answer_once_as_if_alone(four, encode):
    """`generate.score_distinct` (the held-out rows' reference log-probs and learned scores):
    batched by 8 with left padding, each equals scoring the response alone up to float
    rounding (other reduction lengths); a repeated (prompt, response) is one entry."""
    from reprorl.pipeline.generate import score_distinct

    prompts = [f"Situation {i}: " + "the screen flickers. " * (i % 4) for i in range(11)]
    examples = [encode(p, "Next step: " + "check the cable. " * (1 + i % 3))
                for i, p in enumerate(prompts)]
    pairs = [(e.prompt_ids, e.response_ids) for e in examples]
    scored = score_distinct(four["reference"], four["reward"], pairs + pairs[:3], 0)
    assert list(scored) == pairs  # first-seen order, the repeats folded in
    with torch.no_grad():
        for e in examples:
            logprobs, score = scored[e.prompt_ids, e.response_ids]
            alone = collate([e], 0)
            reference, _ = four["reference"].token_logprobs(alone)
            assert len(logprobs) == len(e.response_ids)
            torch.testing.assert_close(torch.tensor(logprobs), reference[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(score, float(four["reward"].score(alone)[0]),
                                       rtol=0, atol=1e-5)
