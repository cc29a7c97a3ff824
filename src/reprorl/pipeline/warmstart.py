"""SFT and the Bradley-Terry reward model: one loop, two losses, bitwise-exact resume.

SFT (actor role): 168 demonstrations x 3 epochs, 8 examples per update -> 63 updates.
Cross-entropy on response tokens (EOS included); prompt and padding masked by position; each
update divides the summed token losses of its 8 examples by their total response tokens (not a
mean of per-example means), the 8 in one left-padded batch.
Reward model (reward role): 840 train pairs x 2 epochs, 8 pairs per update -> 210 updates.
Bradley-Terry loss -mean(logsigmoid(r_chosen - r_rejected)), the score read at the last
response token; the 8 pairs are 8 packed rows (`encoding.collate_pairs`).
Both: AdamW, linear warm-up over 10 % of updates then linear decay to 10 %, gradient norm
clipped at 1. Validation (180 pairs) is measured after each epoch and never used to select.
The losses are `losses.sft_loss` and `losses.bradley_terry_loss`; the modes are
`resumable.py`'s (`interrupt` stops after epoch 1). docs/pipeline.md lists where it departs
from the seed.
"""

from __future__ import annotations

import math
import time

import torch

from reprorl.core import layout, numerics
from reprorl.core.codehash import code_hash
from reprorl.core.errors import ReproError
from reprorl.core.manifest import hash_paths, peak_rss_mb
from reprorl.core.progress import progress
from reprorl.core.state import seed_everything
from reprorl.model import roles
from reprorl.model.encoding import Example, collate, collate_pairs, example, load_tokenizer
from reprorl.model.losses import bradley_terry_loss, sft_loss
from reprorl.model.schedule import linear_warmup_decay

from . import corpus
from .resumable import Branch, ResumableRun, optimizer_step

EPOCHS = {"sft": 3, "reward": 2}
POPULATION = {"sft": 168, "reward": 840}
# a profile may cut both (a small budget for a large model): keys absent from the config keep
# the specification's, so the default profile's config, and its hashes, do not name them
CUT = {"sft": "examples", "reward": "pairs"}
EXAMPLES_PER_UPDATE = 8
INTERRUPT_AFTER_EPOCHS = 1
VALIDATION_PAIRS = 180
VALIDATION_BATCH = 16
ROLE = {"sft": "actor", "reward": "reward"}
# the corpus files each branch learns from, and the validation pairs both measure on
DATA = {"sft": (corpus.DEMOS, corpus.DEMO_LABELS), "reward": (corpus.TRAIN_PAIRS,)}
VALIDATION = corpus.VALIDATION_PAIRS


# ---------------------------------------------------------------- data


def load_data(branch: str, tokenizer, limits: dict, settings: dict) -> tuple[list, list]:
    """Training items and validation pairs (`examples`, `pairs` and `validation_pairs` of them,
    evenly spaced, where a profile cuts them), read through the corpus's learning scope."""
    def pair(row):
        return (example(tokenizer, row["prompt"], row["chosen"], limits, row["document_id"]),
                example(tokenizer, row["prompt"], row["rejected"], limits, row["document_id"]))

    if branch == "sft":
        pages, labels = DATA["sft"]
        answers = {r["document_id"]: r["response"] for r in corpus.read(labels, "learning")}
        items = [example(tokenizer, r["prompt"], answers[r["document_id"]], limits,
                         r["document_id"])
                 for r in corpus.read(pages, "learning")]
    else:
        items = [pair(r) for r in corpus.read(DATA["reward"][0], "learning")]
    validation = [pair(r) for r in corpus.read(VALIDATION, "learning")]
    if len(items) != POPULATION[branch] or len(validation) != VALIDATION_PAIRS:
        raise ReproError(f"{branch}: expected {POPULATION[branch]} items and "
                         f"{VALIDATION_PAIRS} validation pairs, found {len(items)}, "
                         f"{len(validation)}")
    return (spread(items, settings.get(CUT[branch])),
            spread(validation, settings.get("validation_pairs")))


def spread(items: list, count: int | None) -> list:
    """`count` items evenly spaced through the list (all of it when no cut is set): the corpus
    is written situation by situation, so the first N would hold the first situations only."""
    if count is None or count >= len(items):
        return items
    return [items[i * len(items) // count] for i in range(count)]


def epochs(settings: dict, branch: str) -> int:
    return settings.get("epochs", EPOCHS[branch])


def examples_of(item: Example | tuple[Example, Example]) -> tuple[Example, ...]:
    """An SFT item is one example, a reward item a (chosen, rejected) pair."""
    return item if isinstance(item, tuple) else (item,)


# ---------------------------------------------------------------- one update, one validation


def update_loss(role, branch: str, items: list, pad_id: int) -> tuple[torch.Tensor, dict]:
    if branch == "sft":
        logprobs, mask = role.token_logprobs(collate(items, pad_id))
        loss = sft_loss(logprobs, mask)
        return loss, {"response_tokens": int(mask.sum())}
    chosen, rejected = role.score_pairs(collate_pairs(items, pad_id))
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
        scores = role.score_pairs(collate_pairs(chunk, pad_id))
        chosen.append(scores[0])
        rejected.append(scores[1])
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
        "data_sha256": hash_paths([layout.CORPUS / n for n in (*DATA[branch], VALIDATION)]),
        "code_sha256": code_hash(f"{branch}_continuous"),
        "initial_learned": roles.learned_identity(role),
        "frozen_base": roles.frozen_identity(role),
    }


def train(config: dict, branch: str, mode: str, checkpoint_every=None, log=print) -> dict:
    branch_run = Branch(branch, mode)
    settings = config[branch]
    seed_everything(settings["seed"])
    tokenizer = load_tokenizer(config["model"]["path"])
    items, validation = load_data(branch, tokenizer, config["limits"], settings)
    role = roles.build(ROLE[branch], config["model"])
    parameters = [p for p in role.parameters() if p.requires_grad]
    expected = role.adapter_parameters + (role.head.weight.numel() + 1 if role.head else 0)
    if sum(p.numel() for p in parameters) != expected:
        raise ReproError(f"{branch}: trainable parameters are not exactly adapters (+ head)")
    optimizer = torch.optim.AdamW(parameters, lr=settings["learning_rate"],
                                  weight_decay=settings["weight_decay"], **numerics.ADAMW)
    sampler = torch.Generator().manual_seed(settings["sampler_seed"])
    total = math.ceil(len(items) / EXAMPLES_PER_UPDATE) * epochs(settings, branch)
    schedule = lambda step: linear_warmup_decay(  # noqa: E731
        step, total, settings["learning_rate"], settings["warmup_ratio"],
        settings["final_lr_ratio"])
    run = ResumableRun(branch_run, identity(config, branch, role), {ROLE[branch]: role},
                       {ROLE[branch]: optimizer}, {"sampler": sampler}, schedule,
                       checkpoint_every)
    # the loop's position: an epoch's order and offset are kept, so a checkpoint may fall
    # between two updates of an epoch; at an epoch's end both are empty again
    updates, progress_ = run.resume() or (
        0, {"epoch": 0, "order": [], "offset": 0, "history": [], "validation_history": []})
    history, validation_history = progress_["history"], progress_["validation_history"]
    stop = branch_run.stop(INTERRUPT_AFTER_EPOCHS, epochs(settings, branch))
    pad_id, tokens_seen = tokenizer.pad_token_id, 0
    started = time.perf_counter()
    bar = progress(total, f"{branch} {mode}", initial=updates)
    for epoch in range(progress_["epoch"], stop):
        if not progress_["order"]:
            progress_["order"] = torch.randperm(len(items), generator=sampler).tolist()
        order = progress_["order"]
        for offset in range(progress_["offset"], len(items), EXAMPLES_PER_UPDATE):
            batch = [items[i] for i in order[offset : offset + EXAMPLES_PER_UPDATE]]
            lr = schedule(updates)
            optimizer.zero_grad(set_to_none=True)
            loss, stats = update_loss(role, branch, batch, pad_id)
            norm = optimizer_step(optimizer, lr, loss, settings["max_grad_norm"],
                                  f"{branch} update {updates}")
            updates += 1
            bar.update(1)
            tokens_seen += sum(len(e.input_ids) for item in batch for e in examples_of(item))
            history.append({"epoch": epoch + 1, "update": updates, "lr": lr,
                            "loss": float(loss.detach()), "grad_norm": norm,
                            "items": [examples_of(item)[0].name for item in batch], **stats})
            progress_["offset"] = offset + EXAMPLES_PER_UPDATE
            run.reached(updates, progress_)
        validation_history.append({"epoch": epoch + 1,
                                   **validate(role, branch, validation, pad_id)})
        progress_ |= {"epoch": epoch + 1, "order": [], "offset": 0}
        log(f"{branch} {mode}: epoch {epoch + 1}/{epochs(settings, branch)}, "
            f"{updates}/{total} updates, "
            f"loss {history[-1]['loss']:.4f}, validation {validation_history[-1]}")
    bar.close()
    seconds = time.perf_counter() - started
    storage = run.save(updates, progress_)
    report = {
        "branch": branch, "mode": mode, "epochs_completed": stop, "updates": updates,
        "total_updates": total, "history": history, "validation_history": validation_history,
        "trainable_parameters": sum(p.numel() for p in parameters),
        "learned_identity": roles.learned_identity(role),
        "frozen_identity": run.identity["frozen_base"], "checkpoint": storage,
    }
    # costs vary run to run: they go to the manifest's run section, not into this file
    branch_run.report(report)
    branch_run.export(run.identity, config, {branch: role})
    costs = {"seconds": seconds, "peak_rss_mb": peak_rss_mb(),
             "tokens_per_second": tokens_seen / seconds if seconds else None,
             "in_rule_checkpoints": run.checkpoints.finish()}
    return {k: v for k, v in report.items() if k not in ("history",)} | {"costs": costs}


def stage(name: str, config: dict, run, log=print) -> dict:
    branch, _, mode = name.partition("_")
    Branch(branch, mode).refuse_to_overwrite()
    summary = train(config, branch, mode, run.checkpoint_every, log)
    costs = summary.pop("costs")
    run.finish(summary=summary, run_info=costs)
    return summary
