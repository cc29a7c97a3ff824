"""KV-cached sampling against the seed's no-cache sampling, side by side in one run.

Same model, same prompts, same seeds: both samplers must draw the same tokens; the ratio of
their wall times is printed. Two comparisons on the default model:
- sampling alone (`sample` vs `sample_without_cache`);
- a whole PPO rollout as the seed computes it: at each visited prefix, no-cache forwards of the
  actor (to sample), the reference (its log-prob of the token) and the critic (V on the
  prefix), against ours: cached sampling, then one teacher-forced pass of the reference and one
  of the critic over the finished sequence (same log-probs and values, checked).
Run after the base model exists:

    python benchmarks/sampling.py                  # default model (assets/model) + 0.5B dims
    python benchmarks/sampling.py --skip-real-dims # default model only

The 0.5B case is a randomly initialised Qwen2 of Qwen2.5-0.5B's dimensions (no hub access
here), float32 on CPU, with random prompt ids; it measures the cost of the two algorithms at
the real size, not answer quality.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from reprorl.sampling import sample, sample_without_cache

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                tie_word_embeddings=True, max_position_embeddings=32768)


def compare(model, prompts: list[list[int]], eos_id: int, max_new_tokens: int, seed: int):
    timings, same = {"cache": 0.0, "no_cache": 0.0}, True
    tokens = 0
    for index, prompt in enumerate(prompts):
        results = {}
        for name, sampler in (("no_cache", sample_without_cache), ("cache", sample)):
            generator = torch.Generator().manual_seed(seed + index)
            start = time.perf_counter()
            results[name] = sampler(model, prompt, max_new_tokens, eos_id, generator)
            timings[name] += time.perf_counter() - start
        same &= results["cache"].response_ids == results["no_cache"].response_ids
        tokens += len(results["cache"].response_ids)
    return {"prompts": len(prompts), "sampled_tokens": tokens, "same_tokens": same,
            "seconds": timings, "speedup": timings["no_cache"] / timings["cache"]}


@torch.inference_mode()
def seed_rollout(roles: dict, prompt: list[int], max_new_tokens: int, eos_id: int, generator):
    """The seed's rollout: three full-prefix forwards per sampled token."""
    tokens, reference, values = [], [], []
    for _ in range(max_new_tokens):
        sequence = torch.tensor([prompt + tokens])
        logits = roles["actor"].backbone(input_ids=sequence, use_cache=False).logits[0, -1]
        scores = logits.float().log_softmax(-1)
        token = int(torch.multinomial(scores.exp(), 1, generator=generator))
        ref = roles["reference"].backbone(input_ids=sequence, use_cache=False).logits[0, -1]
        reference.append(float(ref.float().log_softmax(-1)[token]))
        hidden = roles["critic"].backbone.model(input_ids=sequence).last_hidden_state[0, -1]
        values.append(float(roles["critic"].head(hidden.float())))
        tokens.append(token)
        if token == eos_id:
            break
    return tokens, reference, values


@torch.inference_mode()
def our_rollout(roles: dict, prompt: list[int], max_new_tokens: int, eos_id: int, pad_id: int,
                generator):
    """Ours: cached sampling, then one teacher-forced pass each for reference and critic."""
    from reprorl.encoding import Example, collate

    result = sample(roles["actor"].backbone, prompt, max_new_tokens, eos_id, generator)
    batch = collate([Example("x", tuple(prompt), tuple(result.response_ids))], pad_id)
    reference, _ = roles["reference"].token_logprobs(batch)
    values, _ = roles["critic"].values(batch)
    return result.response_ids, reference[0].tolist(), values[0].tolist()


def rollouts(path: str, count: int, seed: int, max_new_tokens: int) -> dict:
    from reprorl import corpus, roles
    from reprorl.encoding import load_tokenizer, prompt_ids

    model = {"path": path, "dtype": "float32"}
    built = {kind: roles.build(kind, model) for kind in ("actor", "reference", "critic")}
    with torch.no_grad():  # a non-zero value head, so the values are worth comparing
        built["critic"].head.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    tokenizer = load_tokenizer(path)
    pages = corpus.read("train/pages.json", "learning")[:count]
    prompts = [prompt_ids(tokenizer, p["prompt"], {"prompt_tokens": 256}) for p in pages]
    timings, same, close, tokens = {"cache": 0.0, "no_cache": 0.0}, True, True, 0
    for index, prompt in enumerate(prompts):
        start = time.perf_counter()
        theirs = seed_rollout(built, prompt, max_new_tokens, tokenizer.eos_token_id,
                              torch.Generator().manual_seed(seed + index))
        timings["no_cache"] += time.perf_counter() - start
        start = time.perf_counter()
        ours = our_rollout(built, prompt, max_new_tokens, tokenizer.eos_token_id,
                           tokenizer.pad_token_id, torch.Generator().manual_seed(seed + index))
        timings["cache"] += time.perf_counter() - start
        same &= ours[0] == theirs[0]
        for a, b in zip(ours[1:], theirs[1:]):
            close &= bool(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4))
        tokens += len(ours[0])
    return {"prompts": len(prompts), "sampled_tokens": tokens, "same_tokens": same,
            "same_reference_logprobs_and_values": close, "seconds": timings,
            "speedup": timings["no_cache"] / timings["cache"]}


def default_model(path: str, count: int, seed: int, max_new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from reprorl import corpus
    from reprorl.encoding import load_tokenizer, prompt_ids

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    pages = corpus.read("train/pages.json", "learning")[:count]
    limits = {"prompt_tokens": 256}
    prompts = [prompt_ids(tokenizer, p["prompt"], limits) for p in pages]
    return compare(model, prompts, tokenizer.eos_token_id, max_new_tokens, seed)


def real_dimensions(count: int, seed: int, max_new_tokens: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).eval()
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 151643, (64,), generator=generator).tolist()
               for _ in range(count)]
    return compare(model, prompts, eos_id=151645, max_new_tokens=max_new_tokens, seed=seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="assets/model")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--real-dims-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=249)
    parser.add_argument("--skip-real-dims", action="store_true")
    parser.add_argument("--out", default="outputs/benchmarks/sampling.json")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    report = {
        "default_model_sampling": default_model(args.model, args.prompts, args.seed,
                                                args.max_new_tokens),
        "default_model_rollout": rollouts(args.model, args.prompts, args.seed,
                                          args.max_new_tokens),
    }
    if not args.skip_real_dims:
        report["qwen2.5_0.5b_dimensions"] = real_dimensions(args.real_dims_prompts, args.seed,
                                                            args.max_new_tokens)
    for name, row in report.items():
        print(f"{name}: {row['prompts']} prompts, {row['sampled_tokens']} tokens, same tokens: "
              f"{row['same_tokens']}, no-cache {row['seconds']['no_cache']:.2f}s / cache "
              f"{row['seconds']['cache']:.2f}s = {row['speedup']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    same = all(r["same_tokens"] and r.get("same_reference_logprobs_and_values", True)
               for r in report.values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
