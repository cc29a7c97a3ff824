"""The stages' sampler against the seed's no-cache sampling, side by side in one run.

Same model, same prompts, same seeds; three samplers, which must draw the same tokens:
- `no_cache`: the seed's, the whole prefix recomputed for every token, one prompt at a time;
- `cache`: one prompt at a time against transformers' growing KV cache (`sampling.sample`);
- `engine`: what PPO runs, `sampling.sample_many` on PPO's 4 prompts of an iteration: KV slots
  allocated once, each prompt prefilled alone, one fixed-shape decode step of 4 rows per token
  (a prompt's bits do not depend on the other three, `tests/test_sampling.py`).
Two comparisons on the default model: sampling alone, and a whole PPO rollout as the seed
computes it (at each visited prefix, no-cache forwards of the actor to sample, the reference
for its log-prob and the critic for V) against PPO's (the engine, then one teacher-forced
left-padded pass of the reference and one of the critic over the 4 finished sequences; same
log-probs and values, checked to 1e-4). The model is the profile's `assets/model`, built first
by `snakemake base_model` when missing; the corpus likewise (`snakemake prepare`).

    python benchmarks/sampling.py                  # default model + Qwen2.5-0.5B dimensions
    python benchmarks/sampling.py --skip-real-dims # default model only

The 0.5B case is a randomly initialised Qwen2 of Qwen2.5-0.5B's dimensions (no hub access
here), float32 on CPU, with random prompt ids; it measures the cost of the algorithms at the
real size, not answer quality. Printed last, one JSON line: `sampling_speedup` and
`rollout_speedup` (the engine's against no-cache), and the single-sequence cache's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _build import ensure_built  # benchmarks/: the script's own folder

from reprorl.serve.sampling import sample, sample_many, sample_without_cache

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                tie_word_embeddings=True, max_position_embeddings=32768)
BATCH = 4  # PPO's prompts per iteration, decoded together
MAX_LEN = 512  # a KV slot: prompt + response at most


def generators(seed: int, count: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


def compare(model, prompts: list[list[int]], eos_id: int, max_new_tokens: int, seed: int):
    """The three samplers on the same prompts, alternating batch by batch."""
    timings = {"no_cache": 0.0, "cache": 0.0, "engine": 0.0}
    same, tokens = True, 0
    for first in range(0, len(prompts), BATCH):
        batch = prompts[first:first + BATCH]
        results = {}
        for name in timings:
            draws = generators(seed + first, len(batch))
            start = time.perf_counter()
            if name == "engine":
                results[name] = sample_many(model, batch, max_new_tokens, eos_id, MAX_LEN,
                                            draws, rows=BATCH)
            else:
                one = sample if name == "cache" else sample_without_cache
                results[name] = [one(model, p, max_new_tokens, eos_id, g)
                                 for p, g in zip(batch, draws)]
            timings[name] += time.perf_counter() - start
        ids = {name: [r.response_ids for r in rows] for name, rows in results.items()}
        same &= ids["engine"] == ids["cache"] == ids["no_cache"]
        tokens += sum(len(r) for r in ids["engine"])
    return {"prompts": len(prompts), "sampled_tokens": tokens, "same_tokens": same,
            "seconds": timings, "speedup": timings["no_cache"] / timings["engine"],
            "cache_speedup": timings["no_cache"] / timings["cache"]}


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
def ppo_rollouts(roles: dict, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                 pad_id: int, draws) -> list[tuple]:
    """PPO's: the engine samples the batch, then one teacher-forced pass each for reference
    and critic over the left-padded batch."""
    from reprorl.model.encoding import Example, collate

    results = sample_many(roles["actor"].backbone, prompts, max_new_tokens, eos_id, MAX_LEN,
                          draws, rows=BATCH)
    batch = collate([Example("x", tuple(p), tuple(r.response_ids))
                     for p, r in zip(prompts, results)], pad_id)
    reference, _ = roles["reference"].token_logprobs(batch)
    values, _ = roles["critic"].values(batch)
    mask = batch.response_mask[:, -reference.shape[1]:]
    return [(r.response_ids, reference[i][mask[i]].tolist(), values[i][mask[i]].tolist())
            for i, r in enumerate(results)]


def rollouts(path: str, count: int, seed: int, max_new_tokens: int) -> dict:
    from reprorl.core import config
    from reprorl.model import roles
    from reprorl.model.encoding import load_tokenizer, prompt_ids
    from reprorl.pipeline import corpus

    model = {**config.validate({})["model"], "path": path}  # the schema's defaults, on the CPU
    built = {kind: roles.build(kind, model) for kind in ("actor", "reference", "critic")}
    with torch.no_grad():  # a non-zero value head, so the values are worth comparing
        built["critic"].head.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    tokenizer = load_tokenizer(path)
    pages = corpus.read(corpus.ROLLOUT_PROMPTS, "learning")[:count]
    prompts = [prompt_ids(tokenizer, p["prompt"], {"prompt_tokens": 256}) for p in pages]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    timings, same, close, tokens = {"no_cache": 0.0, "engine": 0.0}, True, True, 0
    for first in range(0, len(prompts), BATCH):
        batch = prompts[first:first + BATCH]
        start = time.perf_counter()
        theirs = [seed_rollout(built, p, max_new_tokens, eos, g)
                  for p, g in zip(batch, generators(seed + first, len(batch)))]
        timings["no_cache"] += time.perf_counter() - start
        start = time.perf_counter()
        ours = ppo_rollouts(built, batch, max_new_tokens, eos, pad,
                            generators(seed + first, len(batch)))
        timings["engine"] += time.perf_counter() - start
        for mine, seeds in zip(ours, theirs):
            same &= mine[0] == seeds[0]
            for a, b in zip(mine[1:], seeds[1:]):
                close &= len(a) == len(b) and bool(
                    torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4))
            tokens += len(mine[0])
    return {"prompts": len(prompts), "sampled_tokens": tokens, "same_tokens": same,
            "same_reference_logprobs_and_values": close, "seconds": timings,
            "speedup": timings["no_cache"] / timings["engine"]}


def default_model(path: str, count: int, seed: int, max_new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from reprorl.model.encoding import load_tokenizer, prompt_ids
    from reprorl.pipeline import corpus

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    pages = corpus.read(corpus.ROLLOUT_PROMPTS, "learning")[:count]
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
    parser.add_argument("--real-dims-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=249)
    parser.add_argument("--skip-real-dims", action="store_true")
    parser.add_argument("--out", default="outputs/benchmarks/sampling.json")
    args = parser.parse_args()
    ensure_built(args.model)
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
        times = " / ".join(f"{arm} {seconds:.2f}s" for arm, seconds in row["seconds"].items())
        print(f"{name}: {row['prompts']} prompts, {row['sampled_tokens']} tokens, same tokens: "
              f"{row['same_tokens']}, {times}: engine {row['speedup']:.2f}x no-cache")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    same = all(r["same_tokens"] and r.get("same_reference_logprobs_and_values", True)
               for r in report.values())
    sampling = report["default_model_sampling"]
    figures = {"sampling_speedup": round(sampling["speedup"], 3),
               "rollout_speedup": round(report["default_model_rollout"]["speedup"], 3),
               "single_sequence_cache_speedup": round(sampling["cache_speedup"], 3),
               "same_tokens": same}
    if "qwen2.5_0.5b_dimensions" in report:
        figures["sampling_speedup_0.5b_dims"] = round(
            report["qwen2.5_0.5b_dimensions"]["speedup"], 3)
    print(json.dumps(figures))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
