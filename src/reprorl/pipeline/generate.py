"""Held-out generation: each policy answers the 180 test and 80 probe rows greedily.

`generation_inputs` cuts those 260 rows (200 distinct prompts) out of the corpus inputs into
`outputs/inference/pages.json`: prompts only, no label. `generate_<policy>` then runs inside a
Snakemake shadow directory that holds nothing but its declared inputs, and refuses to start if
it can see labels or learning outputs. Per row it records the response ids and text, the finish
reason (eos or cut), whether the ids decode, the frozen reward model's score ("predicted
simulated preference"), and the actor's and the reference's log-probs of each response token.
The four probe rows of a context share one prompt; their greedy answers must be identical.
Each distinct (prompt, response) is scored once, in left-padded batches of 8 in a fixed order.
"""

from __future__ import annotations

import time

import torch

from reprorl.core import layout
from reprorl.core.errors import HeldOutError, ReproError
from reprorl.core.manifest import peak_rss_mb, read_input, write_json
from reprorl.core.progress import progress
from reprorl.model.encoding import Example, collate, load_tokenizer, prompt_ids

from . import corpus
from .exports import load_final

ROWS, DISTINCT_PROMPTS = 260, 200
SCORING_ROWS = 8  # responses per scoring batch (reference log-probs and reward-model score)


def generation_inputs() -> dict:
    pages = [r for r in corpus.read(corpus.PAGES, "generation")
             if r["split"] in ("test", "probe")]
    if len(pages) != ROWS or len({r["prompt"] for r in pages}) != DISTINCT_PROMPTS:
        raise ReproError(f"expected {ROWS} test+probe rows with {DISTINCT_PROMPTS} distinct "
                         f"prompts, found {len(pages)}")
    write_json(layout.GENERATION_PAGES, pages)
    return {"rows": len(pages), "distinct_prompts": DISTINCT_PROMPTS}


def assert_isolated() -> None:
    visible = [str(path) for path in layout.HIDDEN_FROM_GENERATION if path.exists()]
    if visible:
        raise HeldOutError(
            f"generation can see {visible}; it must run where only its inputs exist: use "
            "the Snakemake rule (shadow: minimal), or a folder holding only "
            f"{layout.GENERATION_PAGES}, the model and the checkpoints"
        )


@torch.no_grad()
def score_distinct(reference, reward, pairs: list[tuple[tuple[int, ...], tuple[int, ...]]],
                   pad: int) -> dict:
    """(prompt ids, response ids) -> (the reference's log-prob of each response token, the
    reward model's score), each distinct pair once (the four rows of a probe context share one
    prompt), in left-padded batches of SCORING_ROWS in first-seen order."""
    distinct = list(dict.fromkeys(pairs))
    scored = {}
    bar = progress(len(distinct), "score")
    for start in range(0, len(distinct), SCORING_ROWS):
        chunk = distinct[start:start + SCORING_ROWS]
        batch = collate([Example(str(i), p, r) for i, (p, r) in enumerate(chunk)], pad)
        logprobs, mask = reference.token_logprobs(batch)
        scores = reward.score(batch)
        for row, pair in enumerate(chunk):
            scored[pair] = (logprobs[row][mask[row]].tolist(), float(scores[row]))
        bar.update(len(chunk))
    bar.close()
    return scored


@torch.no_grad()
def generate(config: dict, policy: str, log=print) -> dict:
    # imported here: sampling brings in transformers (seconds), which generation_inputs never needs
    from reprorl.serve.sampling import response_text, sample_many

    assert_isolated()
    pages = read_input(layout.GENERATION_PAGES)
    tokenizer = load_tokenizer(config["model"]["path"])
    actor, actor_meta = load_final(policy, "actor", config)
    reference, reference_meta = load_final("sft", "reference", config)
    reward, reward_meta = load_final("reward", "reward", config)
    limits, eos, pad = config["limits"], tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, by_prompt = [], {}
    started = time.perf_counter()
    prompts = [prompt_ids(tokenizer, page["prompt"], limits, page["document_id"])
               for page in pages]
    # every row is sampled, repeats too: their equality below checks the decode rows' batch
    # invariance (a probe context's four rows share one cached prefill and one scored entry)
    results = sample_many(actor.backbone, prompts, limits["response_tokens"], eos,
                          limits["context_tokens"])
    pairs = [(tuple(ids), tuple(result.response_ids)) for ids, result in zip(prompts, results)]
    scored = score_distinct(reference, reward, pairs, pad)
    for page, pair, result in zip(pages, pairs, results):
        text = response_text(tokenizer, result)
        reference_logprobs, score = scored[pair]
        generation = {
            "response_ids": result.response_ids,
            "text": text,
            "finish_reason": result.finish_reason,
            "decodable": "\ufffd" not in text,
            "response_tokens": len(result.response_ids),
            "learned_reward_score": score,
            "actor_logprobs": result.logprobs,
            "reference_logprobs": reference_logprobs,
        }
        if page["prompt"] in by_prompt and by_prompt[page["prompt"]] != generation:
            raise ReproError(f"{page['document_id']}: repeated greedy generations of one "
                             "prompt differ")
        by_prompt[page["prompt"]] = generation
        rows.append({"page": page, "generation": generation})
    seconds = time.perf_counter() - started
    result = {
        "policy": policy,
        "rows": rows,
        "row_count": len(rows),
        "distinct_prompts": len(by_prompt),
        "repeated_probe_generations_identical": True,
        "labels_visible": False,
        "checkpoints": {"actor": actor_meta["sha256"], "reference": reference_meta["sha256"],
                        "reward": reward_meta["sha256"]},
    }
    write_json(layout.generations(policy), result)
    return {"policy": policy, "rows": len(rows), "seconds": seconds,
            "peak_rss_mb": peak_rss_mb()}


def stage(name: str, config: dict, run, log=print) -> dict:
    if name == "generation_inputs":
        summary = generation_inputs()
        run.finish(summary=summary)
        return summary
    policy = name.removeprefix("generate_")
    summary = generate(config, policy, log)
    run.finish(summary={"policy": policy, "rows": summary["rows"]},
               run_info={"seconds": summary["seconds"], "peak_rss_mb": summary["peak_rss_mb"]})
    return summary
