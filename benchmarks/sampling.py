"""KV-cached sampling against the seed's no-cache sampling, side by side in one run.

Same model, same prompts, same seeds: both samplers must draw the same tokens; the ratio of
their wall times is printed. Run after the base model exists:

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
    report = {"default_model": default_model(args.model, args.prompts, args.seed,
                                             args.max_new_tokens)}
    if not args.skip_real_dims:
        report["qwen2.5_0.5b_dimensions"] = real_dimensions(args.real_dims_prompts, args.seed,
                                                            args.max_new_tokens)
    for name, row in report.items():
        print(f"{name}: {row['prompts']} prompts, {row['sampled_tokens']} tokens, same tokens: "
              f"{row['same_tokens']}, no-cache {row['seconds']['no_cache']:.2f}s / cache "
              f"{row['seconds']['cache']:.2f}s = {row['speedup']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["same_tokens"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
