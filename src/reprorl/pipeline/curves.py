"""Over-optimisation curves: the gold and the proxy score against the distance from the start.

After Gao, Schulman and Hilton (2022), "Scaling laws for reward model over-optimization". The
straight (`continuous`) run of PPO and of each GRPO run keeps its actor's adapters, in PEFT
format, at points fixed before it starts: every quarter of its iterations or optimizer steps
(`snapshots.py`). `curve_<branch>` then has each snapshot answer the 180 validation prompts
- greedily: the rubric's success rate is the gold, the frozen reward model's mean score
  ("predicted simulated preference") the proxy;
- once more sampled at temperature 1 (generator i seeded with SAMPLE_SEED + i, the same for
  every snapshot): the mean over prompts of sum_t log pi(y_t) - log pi_ref(y_t) (log pi the
  sampler's own, log pi_ref a teacher-forced pass of the SFT actor every run starts from) is
  the distance, an estimate of KL(pi || pi_ref) in nats per response.
`sft_validation` measures the start, the SFT actor (distance 0: it is the reference). The
validation prompts are never used to select, stop or tune anything. docs/pipeline.md lists
where it departs from the paper.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from reprorl.core import devices, layout
from reprorl.core.errors import ReproError
from reprorl.core.manifest import read_json, record_read, write_json
from reprorl.model import lora
from reprorl.model.encoding import Example, collate, load_tokenizer, prompt_ids

from . import corpus, snapshots
from .exports import load_final
from .rubric import evaluate_response

SAMPLE_SEED = 7001
BATCH = 16  # rows per scoring batch, fixed so that every score is reproducible bit for bit


def _batched(prompts: list[list[int]], results, pad: int):
    """(prompt, response) rows in left-padded batches of BATCH, in order."""
    pairs = list(zip(prompts, (r.response_ids for r in results)))
    for start in range(0, len(pairs), BATCH):
        chunk = pairs[start:start + BATCH]
        yield collate([Example(str(i), tuple(p), tuple(r)) for i, (p, r) in enumerate(chunk)],
                      pad)


def validation_prompts(tokenizer, limits: dict) -> tuple[list[dict], list[list[int]]]:
    pages = corpus.read(corpus.VALIDATION_PAIRS, "learning")  # its held-out check applies
    return pages, [prompt_ids(tokenizer, r["prompt"], limits, r["document_id"]) for r in pages]


@torch.no_grad()
def measure(actor, reward, tokenizer, limits: dict, validation, reference=None) -> dict:
    """One point on the `validation` (pages, prompt ids): the actor's greedy answers judged by
    the rubric and the reward model, and with `reference` the sampled log-ratio to it (else
    the actor is the reference: 0)."""
    from reprorl.serve.sampling import (  # transformers: seconds to import
        response_text,
        sample_many,
    )

    pages, prompts = validation
    eos, pad, room = tokenizer.eos_token_id, tokenizer.pad_token_id, limits["response_tokens"]
    prefills = OrderedDict()  # the sampled pass reuses the greedy pass's prompt prefills
    greedy = sample_many(actor.backbone, prompts, room, eos, limits["context_tokens"],
                         prefills=prefills)
    scores = [float(s) for batch in _batched(prompts, greedy, pad) for s in reward.score(batch)]
    logratios = [0.0] * len(prompts)
    if reference is not None:
        generators = [devices.generator(SAMPLE_SEED + i, actor.device)
                      for i in range(len(pages))]
        sampled = sample_many(actor.backbone, prompts, room, eos, limits["context_tokens"],
                              generators=generators, prefills=prefills)
        logprobs = []  # each sampled response's summed log-prob under the reference
        for batch in _batched(prompts, sampled, pad):
            rows, mask = reference.token_logprobs(batch)
            logprobs.extend(float(rows[i][mask[i]].sum()) for i in range(len(rows)))
        logratios = [sum(s.logprobs) - ref for s, ref in zip(sampled, logprobs)]
    rows = []
    for page, result, score, logratio in zip(pages, greedy, scores, logratios):
        text = response_text(tokenizer, result)
        verdict = evaluate_response(text, result.finish_reason, page["expected_action"])
        rows.append({"document_id": page["document_id"], "text": text,
                     "finish_reason": result.finish_reason, "rubric": verdict,
                     "learned_score": score, "sampled_logratio": logratio})
    count = len(rows)
    return {
        "prompts": count,
        "rubric_success_rate": sum(r["rubric"]["rubric_success"] for r in rows) / count,
        "relevant_rate_over_all_prompts": sum(r["rubric"]["relevant"] for r in rows) / count,
        "recognized_rate": sum(r["rubric"]["recognized"] for r in rows) / count,
        "cut": sum(r["finish_reason"] != "eos" for r in rows),
        "mean_learned_score": sum(scores) / count,
        "sampled_logratio": sum(logratios) / count,
        "rows": rows,
    }


def start(config: dict, log=print) -> dict:
    """sft_validation: the SFT actor's point (every curve's start)."""
    actor, meta = load_final("sft", "actor", config)
    reward, reward_meta = load_final("reward", "reward", config)
    tokenizer = load_tokenizer(config["model"]["path"])
    validation = validation_prompts(tokenizer, config["limits"])
    point = measure(actor, reward, tokenizer, config["limits"], validation)
    point |= {"actor_sha256": meta["sha256"], "reward_sha256": reward_meta["sha256"],
              "used_for_selection": False}
    write_json(layout.SFT_VALIDATION, point)
    summary = {k: v for k, v in point.items() if k != "rows"}
    log(f"SFT greedy validation: {summary}")
    return summary


def curve(config: dict, branch: str, log=print) -> dict:
    """curve_<branch>: every snapshot of the branch's straight run, in step order."""
    folder = layout.snapshots(branch)
    record_read(folder)
    kept = snapshots.found(folder)
    if not kept:
        raise ReproError(f"{folder} holds no snapshot: rerun {branch}_continuous")
    reference, reference_meta = load_final("sft", "reference", config)
    reward, reward_meta = load_final("reward", "reward", config)
    tokenizer = load_tokenizer(config["model"]["path"])
    actor, _ = load_final("sft", "actor", config)  # each snapshot replaces all its adapters
    validation = validation_prompts(tokenizer, config["limits"])  # read once, for every point
    measured = []
    for path in kept:
        lora.load_peft_into(actor.backbone, path)
        point = measure(actor, reward, tokenizer, config["limits"], validation, reference)
        point["step"] = snapshots.step_of(path)
        measured.append(point)
        log(f"{branch} step {point['step']}: gold {point['rubric_success_rate']:.3f}, proxy "
            f"{point['mean_learned_score']:.3f}, distance {point['sampled_logratio']:.3f}")
    planned = read_json(folder / snapshots.PLAN)["planned"]  # recorded with the folder
    for point in measured:
        point["fraction"] = point["step"] / planned
    content = {"branch": branch, "points": measured, "used_for_selection": False,
               "reference_sha256": reference_meta["sha256"],
               "reward_sha256": reward_meta["sha256"]}
    write_json(layout.curve(branch), content)
    return {"branch": branch, "points": [{k: v for k, v in p.items() if k != "rows"}
                                         for p in measured]}


def stage(name: str, config: dict, run, log=print) -> dict:
    summary = (start(config, log) if name == "sft_validation"
               else curve(config, name.removeprefix("curve_"), log))
    run.finish(summary=summary)
    return summary
