"""SFT and the Bradley-Terry reward model: one loop, two losses, bitwise-exact resume.

SFT (actor role): 168 demonstrations x 3 epochs, 8 examples per update -> 63 updates.
Cross-entropy on response tokens (EOS included); prompt and padding masked by position; each
update divides the summed token losses of its 8 examples by their total response tokens (not a
mean of per-example means).
Reward model (reward role): 840 train pairs x 2 epochs, 8 pairs per update -> 210 updates.
Bradley-Terry loss -mean(logsigmoid(r_chosen - r_rejected)), the score read at the last
response token.
Both: AdamW, linear warm-up over 10 % of updates then linear decay to 10 %, gradient norm
clipped at 1. Validation (180 pairs) is measured after each epoch and never used to select.

Modes (one Snakemake rule each): `interrupt` stops after epoch 1 and saves a complete state;
`resume` loads it in a fresh process, checks its identity and finishes; `continuous` runs
straight through. `resume_check` passes only if the two final states are bitwise equal.
Departure from the seed: the 8 examples of an update go through one left-padded batch instead of
8 single-example passes (same loss; position ids keep each sequence's positions unchanged).
"""

from __future__ import annotations

import math
import time

import torch

from . import corpus, roles
from .codehash import code_hash
from .encoding import Example, collate, example, load_tokenizer, prompt_ids
from .manifest import (
    ReproError,
    hash_paths,
    peak_rss_mb,
    refuse_to_overwrite,
    write_json,
)
from .progress import progress
from .rubric import evaluate_response
from .sampling import response_text, sample
from .schedule import linear_warmup_decay
from .state import (
    check_resume,
    first_difference,
    load_state,
    restore_rng,
    rng_state,
    save_state,
    seed_everything,
)

EPOCHS = {"sft": 3, "reward": 2}
POPULATION = {"sft": 168, "reward": 840}
EXAMPLES_PER_UPDATE = 8
INTERRUPT_AFTER_EPOCHS = 1
VALIDATION_PAIRS = 180
VALIDATION_BATCH = 16
CHECKPOINTS = roles.CHECKPOINTS
ROLE = {"sft": "actor", "reward": "reward"}


# ---------------------------------------------------------------- losses (pure functions)


def sft_loss(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the masked tokens over their total count."""
    return -(token_logprobs * mask).sum() / mask.sum()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


# ---------------------------------------------------------------- data


def load_data(branch: str, tokenizer, limits: dict) -> tuple[list, list]:
    """Training items and validation pairs, read through the corpus's learning scope."""
    def pair(row):
        return (example(tokenizer, row["prompt"], row["chosen"], limits, row["document_id"]),
                example(tokenizer, row["prompt"], row["rejected"], limits, row["document_id"]))

    if branch == "sft":
        answers = {r["document_id"]: r["response"]
                   for r in corpus.read("labels/warmstart.json", "learning")}
        items = [example(tokenizer, r["prompt"], answers[r["document_id"]], limits,
                         r["document_id"])
                 for r in corpus.read("warmstart/pages.json", "learning")]
    else:
        items = [pair(r) for r in corpus.read("labels/train-pairs.json", "learning")]
    validation = [pair(r) for r in corpus.read("labels/validation-pairs.json", "learning")]
    if len(items) != POPULATION[branch] or len(validation) != VALIDATION_PAIRS:
        raise ReproError(f"{branch}: expected {POPULATION[branch]} items and "
                         f"{VALIDATION_PAIRS} validation pairs, found {len(items)}, "
                         f"{len(validation)}")
    return items, validation


def examples_of(item: Example | tuple[Example, Example]) -> tuple[Example, ...]:
    """An SFT item is one example, a reward item a (chosen, rejected) pair."""
    return item if isinstance(item, tuple) else (item,)


def data_files(branch: str) -> list[str]:
    names = (["warmstart/pages.json", "labels/warmstart.json"] if branch == "sft"
             else ["labels/train-pairs.json"]) + ["labels/validation-pairs.json"]
    return [str(corpus.CORPUS_DIR / n) for n in names]


# ---------------------------------------------------------------- one update, one validation


def update_loss(role, branch: str, items: list, pad_id: int) -> tuple[torch.Tensor, dict]:
    if branch == "sft":
        logprobs, mask = role.token_logprobs(collate(items, pad_id))
        loss = sft_loss(logprobs, mask)
        return loss, {"response_tokens": int(mask.sum())}
    scores = role.score(collate([c for c, _ in items] + [r for _, r in items], pad_id))
    chosen, rejected = scores[: len(items)], scores[len(items):]
    loss = bradley_terry_loss(chosen, rejected)
    return loss, {"accuracy": float((chosen > rejected).float().mean())}


@torch.no_grad()
def validate(role, branch: str, pairs: list[tuple[Example, Example]], pad_id: int) -> dict:
    """SFT: token-level loss of the chosen answers. RM: pair accuracy and loss."""
    if branch == "sft":
        total, tokens = 0.0, 0
        for start in range(0, len(pairs), VALIDATION_BATCH):
            chunk = [c for c, _ in pairs[start : start + VALIDATION_BATCH]]
            logprobs, mask = role.token_logprobs(collate(chunk, pad_id))
            total -= float((logprobs * mask).sum())
            tokens += int(mask.sum())
        return {"pairs": len(pairs), "loss": total / tokens, "used_for_selection": False}
    chosen, rejected = [], []
    for start in range(0, len(pairs), VALIDATION_BATCH):
        chunk = pairs[start : start + VALIDATION_BATCH]
        scores = role.score(collate([c for c, _ in chunk] + [r for _, r in chunk], pad_id))
        chosen.append(scores[: len(chunk)])
        rejected.append(scores[len(chunk):])
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    return {
        "pairs": len(pairs),
        "accuracy": float((chosen > rejected).float().mean()),
        "ties": int((chosen == rejected).sum()),
        "loss": float(bradley_terry_loss(chosen, rejected)),
        "used_for_selection": False,
    }


# ---------------------------------------------------------------- the run


def identity(config: dict, branch: str, role) -> dict:
    """What a resume must share with the run it continues."""
    return {
        "branch": branch,
        "config": {k: config[k] for k in ("model", "limits", branch)},
        "base_model_sha256": hash_paths([config["model"]["path"]]),
        "data_sha256": hash_paths(data_files(branch)),
        "code_sha256": code_hash(f"{branch}_continuous"),
        "initial_learned": roles.learned_identity(role),
        "frozen_base": roles.frozen_identity(role),
    }


def train(config: dict, branch: str, mode: str, log=print) -> dict:
    settings = config[branch]
    seed_everything(settings["seed"])
    tokenizer = load_tokenizer(config["model"]["path"])
    items, validation = load_data(branch, tokenizer, config["limits"])
    role = roles.build(ROLE[branch], config["model"])
    parameters = [p for p in role.parameters() if p.requires_grad]
    expected = role.adapter_parameters + (role.head.weight.numel() + 1 if role.head else 0)
    if sum(p.numel() for p in parameters) != expected:
        raise ReproError(f"{branch}: trainable parameters are not exactly adapters (+ head)")
    optimizer = torch.optim.AdamW(parameters, lr=settings["learning_rate"],
                                  weight_decay=settings["weight_decay"])
    sampler = torch.Generator().manual_seed(settings["sampler_seed"])
    total = math.ceil(len(items) / EXAMPLES_PER_UPDATE) * EPOCHS[branch]
    schedule = lambda step: linear_warmup_decay(  # noqa: E731
        step, total, settings["learning_rate"], settings["warmup_ratio"],
        settings["final_lr_ratio"])
    run_identity = identity(config, branch, role)
    epoch, updates, history, validation_history = 0, 0, [], []
    if mode == "resume":
        state = load_state(CHECKPOINTS / f"{branch}-interrupt.pt.gz")
        difference = first_difference(state["identity"], run_identity, "identity")
        if difference:
            raise ReproError(f"the interrupt state cannot be resumed by this run ({difference}); "
                             "rerun the interrupt branch with the same config, data and code")
        roles.load_learned(role, state["learned"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.set_state(state["sampler"])
        restore_rng(state["rng"])
        epoch, updates = state["epoch"], state["updates"]
        history, validation_history = state["history"], state["validation_history"]
        if state["scheduler"] != {"next_update": updates, "next_lr": schedule(updates)}:
            raise ReproError("the saved schedule position does not match this run's schedule")
    stop = INTERRUPT_AFTER_EPOCHS if mode == "interrupt" else EPOCHS[branch]
    pad_id, tokens_seen = tokenizer.pad_token_id, 0
    started = time.perf_counter()
    bar = progress(total, f"{branch} {mode}", initial=updates)
    for epoch in range(epoch, stop):
        order = torch.randperm(len(items), generator=sampler).tolist()
        for offset in range(0, len(items), EXAMPLES_PER_UPDATE):
            batch = [items[i] for i in order[offset : offset + EXAMPLES_PER_UPDATE]]
            lr = schedule(updates)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss, stats = update_loss(role, branch, batch, pad_id)
            loss.backward()
            if any(p.grad is None or not torch.isfinite(p.grad).all() for p in parameters):
                raise ReproError(f"{branch}: missing or non-finite gradients at update {updates}")
            norm = float(torch.nn.utils.clip_grad_norm_(parameters, settings["max_grad_norm"]))
            optimizer.step()
            updates += 1
            bar.update(1)
            tokens_seen += sum(len(e.input_ids) for item in batch for e in examples_of(item))
            history.append({"epoch": epoch + 1, "update": updates, "lr": lr,
                            "loss": float(loss.detach()), "grad_norm": norm,
                            "items": [examples_of(item)[0].name for item in batch], **stats})
        validation_history.append({"epoch": epoch + 1,
                                   **validate(role, branch, validation, pad_id)})
        log(f"{branch} {mode}: epoch {epoch + 1}/{EPOCHS[branch]}, {updates}/{total} updates, "
            f"loss {history[-1]['loss']:.4f}, validation {validation_history[-1]}")
    bar.close()
    seconds = time.perf_counter() - started
    if roles.frozen_identity(role) != run_identity["frozen_base"]:
        raise ReproError(f"{branch}: the frozen base changed during training")
    if roles.learned_identity(role) == run_identity["initial_learned"]:
        raise ReproError(f"{branch}: training did not change the learned parameters")
    state = {
        "identity": run_identity,
        "learned": {n: t.detach().clone() for n, t in roles.learned_state(role).items()},
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.get_state(),
        "rng": rng_state(),
        "epoch": stop,
        "updates": updates,
        "scheduler": {"next_update": updates, "next_lr": schedule(updates)},
        "history": history,
        "validation_history": validation_history,
    }
    storage = save_state(CHECKPOINTS / f"{branch}-{mode}.pt.gz", state)
    report = {
        "branch": branch, "mode": mode, "epochs_completed": stop, "updates": updates,
        "total_updates": total, "history": history, "validation_history": validation_history,
        "trainable_parameters": sum(p.numel() for p in parameters),
        "learned_identity": roles.learned_identity(role),
        "frozen_identity": run_identity["frozen_base"], "checkpoint": storage,
    }
    costs = {"seconds": seconds, "peak_rss_mb": peak_rss_mb(),
             "tokens_per_second": tokens_seen / seconds if seconds else None}
    # costs vary run to run: they go to the manifest's run section, not into this file
    write_json(f"outputs/learning/{branch}/{mode}.json", report)
    if mode == "resume":
        roles.save_final(role, branch, run_identity, config)
    return {k: v for k, v in report.items() if k not in ("history",)} | {"costs": costs}


def resume_check(branch: str) -> dict:
    resumed = CHECKPOINTS / f"{branch}-resume.pt.gz"
    return check_resume(
        branch, CHECKPOINTS / f"{branch}-continuous.pt.gz", resumed,
        f"outputs/learning/{branch}/resume-check.json",
        {"branch": branch, "updates": load_state(resumed)["updates"],
         "compared": "every learned tensor, optimizer state, sampler and RNG states, schedule, "
                     "history and validation history (timings are kept outside the state)"})


@torch.no_grad()
def greedy_validation(config: dict, log=print) -> dict:
    """Greedy answers of the final SFT actor to the 180 validation prompts, judged by the
    rubric. A measurement only: nothing is selected with it."""
    actor, meta = roles.load_final("sft", "actor", config)
    tokenizer = load_tokenizer(config["model"]["path"])
    limits = config["limits"]
    rows = []
    for row in corpus.read("labels/validation-pairs.json", "learning"):
        ids = prompt_ids(tokenizer, row["prompt"], limits, row["document_id"])
        result = sample(actor.backbone, ids, limits["response_tokens"], tokenizer.eos_token_id)
        text = response_text(tokenizer, result)
        verdict = evaluate_response(text, result.finish_reason, row["expected_action"])
        rows.append({"document_id": row["document_id"], "text": text,
                     "finish_reason": result.finish_reason, "rubric": verdict})
    count = len(rows)
    summary = {
        "prompts": count,
        "rubric_success_rate": sum(r["rubric"]["rubric_success"] for r in rows) / count,
        "relevant_rate_over_all_prompts": sum(r["rubric"]["relevant"] for r in rows) / count,
        "recognized_rate": sum(r["rubric"]["recognized"] for r in rows) / count,
        "cut": sum(r["finish_reason"] != "eos" for r in rows),
        "actor_sha256": meta["sha256"],
        "used_for_selection": False,
    }
    write_json("outputs/learning/sft/validation-greedy.json", {**summary, "rows": rows})
    log(f"SFT greedy validation: {summary}")
    return summary


def stage(name: str, config: dict, run, log=print) -> dict:
    if name == "sft_validation":
        summary = greedy_validation(config, log)
        run.finish(inputs=[CHECKPOINTS / "sft-final.safetensors", *data_files("sft")],
                   outputs=["outputs/learning/sft/validation-greedy.json"], summary=summary)
        return summary
    branch, _, mode = name.partition("_")
    mode = mode.replace("_", "-")
    if mode == "resume-check":
        result = resume_check(branch)
        files = [CHECKPOINTS / f"{branch}-continuous.pt.gz", CHECKPOINTS / f"{branch}-resume.pt.gz"]
        run.finish(inputs=files, outputs=[f"outputs/learning/{branch}/resume-check.json"],
                   summary=result)
        return result
    destination = CHECKPOINTS / f"{branch}-{mode}.pt.gz"
    refuse_to_overwrite(destination)
    summary = train(config, branch, mode, log)
    inputs = [config["model"]["path"], *data_files(branch)]
    if mode == "resume":
        inputs.append(CHECKPOINTS / f"{branch}-interrupt.pt.gz")
    outputs = [destination, f"outputs/learning/{branch}/{mode}.json"]
    if mode == "resume":
        outputs += [CHECKPOINTS / f"{branch}-final.safetensors",
                    CHECKPOINTS / f"{branch}-final.json"]
        if branch == "sft":
            outputs.append(CHECKPOINTS / "sft-peft")
    costs = summary.pop("costs")
    run.finish(inputs=inputs, outputs=outputs, summary=summary, run_info=costs)
    return summary
