"""Top-k / top-p / min-p and the repetition penalty (issue 13, item 5): the server's candidate
sets and the trainer's renormalisation over them, the penalty applied alike on both sides,
with the real embedded server and worker."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import requests
import torch
from test_grpo import BASE, make_rows, read_metrics, start_server, token_sum_reward

from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from reprorl.grpo.batching import TokenBudgetBatcher, pad_collate
from reprorl.grpo.microbatch_loss import microbatch_loss
from reprorl.grpo.samples import Sample, TrainingSequence
from reprorl.serve.logprobs import Params, processed_logprobs

TRUNCATION = {"top_k": 8, "top_p": 0.8, "min_p": 0.02}


def test_renormalising_over_the_candidate_set_makes_the_ratio_one(tiny_model):
    """The loss's own code on tokens drawn as the server draws them: without the sets every
    ratio is the kept mass (< 1); with them, 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    prompt, generator = [5, 17, 42, 9], torch.Generator().manual_seed(0)
    params = Params(max_tokens=12, temperature=0.9, **TRUNCATION)
    ids, logps, sets = list(prompt), [], []
    with torch.no_grad():
        for _ in range(12):
            scores = processed_logprobs(model(torch.tensor([ids])).logits[0, -1], params)
            token = int(torch.multinomial(scores.exp(), 1, generator=generator))
            ids.append(token)
            logps.append(float(scores[token]))
            sets.append(torch.isfinite(scores).nonzero().flatten().tolist())
    assert all(len(s) <= 8 for s in sets) and any(len(s) > 1 for s in sets)
    flags = [0] * len(prompt) + [1] * 12
    args = AsyncGRPOConfig(temperature=0.9, score_centering=False, **TRUNCATION)

    def ratios(with_sets: bool) -> torch.Tensor:
        sequence = TrainingSequence(ids, flags, [0.0] * len(prompt) + logps,
                                    [None] * len(ids),
                                    [None] * len(prompt) + (sets if with_sets else [None] * 12))
        sample = Sample(sequence, 1.0, 1.0, {}, 1.0, {}, 0, 0, 0, 1, len(ids), 0.0, "r", "")
        batch = pad_collate([sample], top_k=1, pad_id=0)
        with torch.no_grad():
            _, stats = microbatch_loss(model, args, batch)
        return torch.tensor(stats["sampling/importance_sampling_ratio/mean"])

    assert (ratios(True) - 1).abs().max() < 1e-5
    biased = ratios(False)
    assert (biased < 1 - 1e-3).any() and (biased <= 1 + 1e-5).all()  # never above: mass <= 1


def test_the_loss_penalises_repeats_over_each_columns_own_prefix(tiny_model):
    """Tokens drawn under vLLM's repetition penalty, two samples of different lengths, one
    with context in its middle (a tool result that repeats earlier tokens): scored with the
    penalty over each column's prefix every ratio is 1, in the padded and the tree layouts;
    scored without it, they are not."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    params, generator = Params(max_tokens=8, temperature=0.9, repetition_penalty=1.8), (
        torch.Generator().manual_seed(1))

    def draw(ids: list[int], flags: list[int], logps: list[float], n: int) -> None:
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1]
                scores = processed_logprobs(logits, params, ids)
                token = int(torch.multinomial(scores.exp(), 1, generator=generator))
                ids.append(token)
                flags.append(1)
                logps.append(float(scores[token]))

    samples = []
    for prompt, turns in (([5, 17, 42, 9, 17], [8, 8]), ([3, 3, 60], [5])):
        ids, flags, logps = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
        for t, n in enumerate(turns):
            if t:  # context between turns: a tool result quoting the first turn
                context = ids[len(prompt): len(prompt) + 3]
                ids += context
                flags += [0] * 3
                logps += [0.0] * 3
            draw(ids, flags, logps, n)
        sequence = TrainingSequence(ids, flags, logps, [None] * len(ids), [None] * len(ids))
        samples.append(Sample(sequence, 1.0, 1.0, {}, 1.0, {}, 0, 0, 0, 1, len(ids), 0.0,
                              "r", ""))
    assert samples[0].tokens != samples[1].tokens
    tree = TokenBudgetBatcher(token_budget=64, rows=1, top_k=1, pad_id=0)

    def ratios(penalty: float, layout) -> torch.Tensor:
        args = AsyncGRPOConfig(temperature=0.9, score_centering=False,
                               repetition_penalty=penalty)
        with torch.no_grad():
            _, stats = microbatch_loss(model, args, layout(samples))
        return torch.tensor(stats["sampling/importance_sampling_ratio/mean"])

    padded = lambda batch: pad_collate(batch, top_k=1, pad_id=0)  # noqa: E731
    for layout in (padded, tree.collate):
        exact = ratios(1.8, layout)
        assert len(exact) == 21 and (exact - 1).abs().max() < 1e-5
        assert (ratios(1.0, layout) - 1).abs().max() > 1e-2


def test_the_generate_endpoint_returns_each_tokens_candidate_set(tiny_model, tmp_path):
    process, log, url = start_server(tiny_model, tmp_path / "s", "--enable-scale-out",
                                     "--return-sampling-mask", "--max-logprobs", "8")
    try:
        body = {"token_ids": [5, 17, 42, 9], "sampling_params": {
            "max_tokens": 10, "temperature": 0.9, "seed": 3, "logprobs": 2, **TRUNCATION}}
        reply = requests.post(f"{url}/inference/v1/generate", json=body, timeout=60).json()
        choice = reply["choices"][0]
        assert len(choice["sampling_mask"]) == len(choice["token_ids"]) == 10
        for token, allowed, item in zip(choice["token_ids"], choice["sampling_mask"],
                                        choice["logprobs"]["content"]):
            assert token in allowed and len(allowed) <= 8 and item["token_id"] == token
            assert item["rank"] >= 1 and len(item["top_logprobs"]) == 2
        # the same seed through /v1/completions samples the same tokens
        same = requests.post(f"{url}/v1/completions", json={
            "prompt": [5, 17, 42, 9], "max_tokens": 10, "temperature": 0.9, "seed": 3,
            "logprobs": 0, "return_token_ids": True, **TRUNCATION}, timeout=60).json()
        assert same["choices"][0]["token_ids"] == choice["token_ids"]
        refused = requests.post(f"{url}/inference/v1/generate", json={
            "token_ids": [5], "sampling_params": {"top_k": 0}}, timeout=60)
        assert refused.status_code == 400 and "top_k > 0" in refused.text
        settings = {**body["sampling_params"], "repetition_penalty": 1.5}
        penalised = requests.post(f"{url}/inference/v1/generate",
                                  json={**body, "sampling_params": settings}, timeout=60).json()
        assert penalised["choices"][0]["logprobs"] != choice["logprobs"]
        refused = requests.post(f"{url}/v1/completions", json={
            "prompt": [5], "max_tokens": 2, "repetition_penalty": 0}, timeout=60)
        assert refused.status_code == 400 and "repetition_penalty" in refused.text
    finally:
        process.terminate()
        process.wait(30)
        log.close()
    process, log, url = start_server(tiny_model, tmp_path / "plain")
    try:
        off = requests.post(f"{url}/inference/v1/generate", json=body, timeout=60)
        assert off.status_code == 403 and "--enable-scale-out" in off.text
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def one_step(tiny_model, tmp_path, name, messages, **overrides) -> dict:
    args = AsyncGRPOConfig(output_dir=str(tmp_path / name), **{
        **BASE, "max_steps": 1, "synchronous": True, "temperature": 0.9,
        "max_completion_length": 12, **TRUNCATION, **overrides})
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward, args=args,
                               train_dataset=make_rows(4), log=messages.append)
    trainer.train()
    (window,) = [w for w in read_metrics(Path(args.output_dir)) if "loss" in w]
    return window


@pytest.mark.timeout(300)
def test_without_the_sets_ratios_are_biased_and_with_them_one_at_zero_staleness(tiny_model,
                                                                               tmp_path):
    """Two synchronous steps (zero staleness), both under a repetition penalty, which the
    server and the loss apply alike: the embedded server started by the trainer returns the
    sets; a server without --return-sampling-mask (an older vLLM) cannot, and the trainer says
    so and normalises over the vocabulary."""
    messages: list[str] = []
    exact = one_step(tiny_model, tmp_path, "sets", messages, repetition_penalty=1.5)
    assert not any("WARNING" in m for m in messages)
    assert abs(exact["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    assert 1 - 1e-4 < exact["sampling/importance_sampling_ratio/min"]
    assert exact["sampling/importance_sampling_ratio/max"] < 1 + 1e-4
    process, log, url = start_server(tiny_model, tmp_path / "old", "--max-logprobs", "8")
    try:
        messages.clear()
        biased = one_step(tiny_model, tmp_path, "vocabulary", messages, embedded_server=False,
                          vllm_server_base_url=url, repetition_penalty=1.5)
    finally:
        process.terminate()
        process.wait(30)
        log.close()
    assert any("cannot say which tokens" in m and "--enable-scale-out" in m for m in messages)
    assert biased["sampling/importance_sampling_ratio/mean"] < 1 - 1e-3
    assert biased["sampling/importance_sampling_ratio/max"] < 1 + 1e-4
    print({"ratio_with_sets": exact["sampling/importance_sampling_ratio/mean"],
           "ratio_without": biased["sampling/importance_sampling_ratio/mean"],
           "min_without": biased["sampling/importance_sampling_ratio/min"]})
    assert math.isfinite(biased["loss"]) and math.isfinite(exact["loss"])
