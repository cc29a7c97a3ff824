"""Tree packing against padding on the pipeline's own GRPO data, side by side in one run.

Builds everything it needs, in memory (no pipeline stage has to have run):
- prompts: the corpus's 672 rollout prompts (`prepare.generate()`, the generator the `prepare`
  stage writes to disk), rendered with the default profile's chat template and tokenized by a
  tokenizer trained here as `base_model` trains the profile's (byte-level BPE over its
  pretraining texts, vocab 1024): 87 to 92 tokens each;
- completions: responses of the corpus's own grammar (the SFT demonstrations' responses, what
  the SFT actor learns to write, drawn with a seeded generator) plus EOS, about 15 tokens, so
  completions of a group often share their first words, as real ones do;
- a step: the default profile's fixed-schedule step, `groups_per_step` (4) groups of
  `num_generations` (4) samples, each group a different prompt;
- the policy: a Qwen2 of the default profile's shape (vocab 1024, hidden 256, intermediate 768,
  6 layers, 4 heads, 2 KV heads; `model.embedded` of configs/default.yaml) with random
  weights, float32, LoRA rank 8 / alpha 16 injected as the trainer does; the sampler's
  log-probs and top-8 are the policy's own (importance ratios 1, as right after a sync).
Compared, on the same samples: packed, `TokenBudgetBatcher` with the pipeline's settings
(8 rows of token_budget = the embedded server's max_model_len, limits.context_tokens = 320);
padded, `pad_collate`, one left-padded row per sample in one micro-batch (the layout before
packing). Each side runs collate + forward + backward of the real GRPO loss
(`objective.microbatch_loss`, score centering), alternating packed and padded, `--repeats` times
over `--steps` steps after a warm-up, on `--threads` torch threads (default 1: the pipeline's
GRPO stage gives its trainer the cores the embedded server leaves, one of two). The trained
tokens are the same on both sides, so the speedup is padded seconds over packed seconds;
packing_ratio is `batch/packing_ratio` over the run: the samples' tokens before packing per
forwarded token. Where this departs from a pipeline run: random weights and the grammar's
responses stand in for the SFT actor and its samples (the speed of a forward does not depend
on the weights; the sharing between completions does depend on what the actor writes).

    python benchmarks/packing.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from reprorl.core import config as configuration
from reprorl.grpo import AsyncGRPOConfig
from reprorl.grpo.batching import TokenBudgetBatcher, pad_collate
from reprorl.grpo.microbatch_loss import microbatch_loss
from reprorl.grpo.policy import disable_dropout
from reprorl.grpo.samples import Sample, TrainingSequence
from reprorl.model import lora
from reprorl.model.encoding import chat_prompt
from reprorl.model.grpo_losses import group_advantages
from reprorl.pipeline import base_model, prepare

ROOT = Path(__file__).resolve().parent.parent
SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings")


def policy(config: dict, tokenizer, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    size = config["model"]["embedded"]
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), tie_word_embeddings=True, attention_dropout=0.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **{name: size[name] for name in SHAPE})).float()
    defaults = AsyncGRPOConfig()
    lora.inject(model, defaults.lora_rank, defaults.lora_alpha, seed)
    disable_dropout(model)
    return model.train()


@torch.no_grad()
def sampled(model, prompt: list[int], completion: list[int], top_k: int):
    """The sequence with the policy's own log-probs and top-k as the sampler's."""
    ids = prompt + completion
    scores = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    start = len(prompt)
    logp = [0.0] * start + [float(scores[j - 1, ids[j]]) for j in range(start, len(ids))]
    tops = [None] * start
    for j in range(start, len(ids)):
        values, indices = scores[j - 1].topk(top_k)
        tops.append(dict(zip(indices.tolist(), values.tolist())))
    return TrainingSequence(ids, [0] * start + [1] * len(completion), logp, tops)


def steps_of_samples(model, tokenizer, settings: dict, steps: int, seed: int) -> list[list]:
    """`steps` fixed-schedule steps of the pipeline's groups (see the module's docstring)."""
    pages = prepare.generate()
    prompts = [p["prompt"] for p in pages["rollouts"]]
    responses = [d["response"] for d in pages["demo_labels"]]  # what SFT taught the actor
    rng = random.Random(seed)
    eos, size = tokenizer.eos_token_id, settings["num_generations"]
    result, position = [], 0
    for _ in range(steps):
        step = []
        for _ in range(settings["groups_per_step"]):
            prompt = tokenizer(chat_prompt(tokenizer, rng.choice(prompts)),
                               add_special_tokens=False)["input_ids"]
            rewards = np.array([rng.random() for _ in range(size)])
            for advantage in group_advantages(rewards):
                completion = tokenizer(rng.choice(responses),
                                       add_special_tokens=False)["input_ids"] + [eos]
                sequence = sampled(model, prompt, completion, settings["num_sampler_logprobs"])
                step.append(Sample(sequence, float(advantage), 0.0, {}, 0.0, {}, 0, position,
                                   position, size, len(sequence.input_ids), 0.0, "", ""))
            position += 1
        result.append(step)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="distinct steps of samples")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over the steps")
    parser.add_argument("--seed", type=int, default=49)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads: 1, the pipeline trainer's beside its server")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    config = configuration.load(ROOT / "configs/default.yaml")
    settings = config["grpo"]  # the pipeline's, with the schema's defaults filled in
    texts = base_model.pretraining_texts(config["model"]["pretrain"]["families"],
                                         config["model"]["pretrain"]["data_seed"])
    tokenizer = base_model.train_tokenizer([f"{p}\n{r}" for p, r in texts],
                                           config["model"]["embedded"]["vocab_size"])
    model = policy(config, tokenizer, options.seed)
    steps = steps_of_samples(model, tokenizer, settings, options.steps, options.seed)
    args = AsyncGRPOConfig(score_centering=settings["score_centering"],
                           temperature=settings["temperature"])
    budget = settings["token_budget"] or config["limits"]["context_tokens"]
    top, pad = settings["num_sampler_logprobs"], tokenizer.pad_token_id

    def packed(samples):
        return TokenBudgetBatcher(budget, settings["per_device_train_batch_size"], top,
                                  pad).collate(samples)

    def padded(samples):
        return pad_collate(samples, top, pad)

    layouts = {"packed": packed, "padded": padded}
    seconds = dict.fromkeys(layouts, 0.0)
    forwarded = {name: sum(collate(s).forwarded_tokens for s in steps)
                 for name, collate in layouts.items()}
    rows = [packed(s).row_tokens for s in steps]
    trained = sum(sum(sum(x.sequence.trained) for x in s) for s in steps)
    raw = sum(sum(x.tokens for x in s) for s in steps)
    for repeat in range(options.repeats + 1):  # the first pass warms up, untimed
        for samples in steps:
            for name, collate in layouts.items():
                model.zero_grad(set_to_none=True)
                started = time.perf_counter()
                loss, _ = microbatch_loss(model, args, collate(samples))
                loss.backward()
                if repeat:
                    seconds[name] += time.perf_counter() - started
    passes = options.repeats * len(steps)
    for name in layouts:
        print(f"{name}: {forwarded[name] / len(steps):.0f} tokens forwarded per step, "
              f"{seconds[name] / passes:.3f} s per step (collate, forward, backward), "
              f"{trained * options.repeats / seconds[name]:.0f} trained tokens/s")
    print(f"{len(steps)} steps of {len(steps[0])} samples, {raw / len(steps):.0f} tokens and "
          f"{trained / len(steps):.0f} trained per step; packed rows (tokens): {rows}")
    ratio, speedup = raw / forwarded["packed"], seconds["padded"] / seconds["packed"]
    print(f"padded forwards {forwarded['padded'] / forwarded['packed']:.2f}x the packed tokens; "
          f"speedup {speedup:.2f}x against the target 0.8 x packing ratio = {0.8 * ratio:.2f}x")
    print(json.dumps({"packing_ratio": round(ratio, 3), "speedup": round(speedup, 3)}))


if __name__ == "__main__":
    main()
