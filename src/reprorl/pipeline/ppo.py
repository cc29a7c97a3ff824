"""PPO with four roles: actor and critic learn, reference and reward model stay frozen.

One iteration: draw 4 of the 672 rollout prompts (own permutation generator, reshuffled when
exhausted), sample one response each from the actor, the 4 decoded together by the
batch-invariant engine (`sampling.sample_many`; temperature 1, full vocabulary, response <= 64
tokens, each with its own generator seeded from the run's) recording the behaviour log-probs,
then score the visited prefixes with the reference (log-probs) and the critic (values) and the
finished responses with the reward model, all detached for the targets (`losses`); then 2
updates of the actor and of the critic (two AdamW optimisers) on that same batch, the old
log-probs and values never replaced; the critic's values and the re-scoring before the first
update are that update's own forwards (kept with their graph). 100 iterations: 400 responses,
200 actor and 200 critic updates.

Modes (`resumable.py`): `interrupt` stops after iteration 40 and saves at that boundary, so no
rollout is ever pending in a state; `resume` runs the last 60 in a fresh process; `continuous`
runs 100 and keeps the actor's adapters after iterations 25, 50, 75 and 100 for the
over-optimisation curve (`snapshots.py`, `curves.py`). A profile for a larger model may cut the
iterations and the interrupt point (`ppo.iterations`, `ppo.interrupt_at`). docs/pipeline.md
lists where it departs from the seed.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import time

import torch

from reprorl.core import devices, layout, numerics
from reprorl.core.codehash import code_hash
from reprorl.core.errors import ReproError
from reprorl.core.manifest import (
    atomic_directory,
    hash_paths,
    peak_rss_mb,
    read_json,
    record_read,
    write_json,
)
from reprorl.core.progress import progress
from reprorl.core.state import seed_everything
from reprorl.model import losses, roles
from reprorl.model.encoding import Example, collate, load_tokenizer, prompt_ids
from reprorl.model.schedule import linear_warmup_decay

from . import corpus, snapshots
from .exports import load_final
from .resumable import Branch, ResumableRun, optimizer_step
from .rubric import evaluate_response

ITERATIONS, INTERRUPT_AT, PROMPTS_PER_ITERATION, UPDATES_PER_BATCH = 100, 40, 4, 2
# Sampling temperature, fixed by the specification: the actor loss and the log-ratio penalty use
# untempered log-probs, which are the behaviour log-probs only at temperature 1.
TEMPERATURE = 1.0
INPUT_CHECKPOINTS = [*layout.final_files("sft"), *layout.final_files("reward")]


def build_roles(config: dict) -> dict[str, roles.Role]:
    actor, _ = load_final("sft", "actor", config)
    reference, _ = load_final("sft", "reference", config)
    reward, _ = load_final("reward", "reward", config)
    reward.requires_grad_(False)
    critic, _ = load_final("sft", "critic", config, adapters_only=True)
    return {"actor": actor, "reference": reference, "reward": reward, "critic": critic}


def next_prompts(order: list[int], cursor: int, generator: torch.Generator, count: int,
                 population: int) -> tuple[list[int], list[int], int]:
    chosen = []
    while len(chosen) < count:
        if cursor == len(order):
            order, cursor = torch.randperm(population, generator=generator).tolist(), 0
        chosen.append(order[cursor])
        cursor += 1
    return chosen, order, cursor


def right_aligned(rows: list[list[float]], width: int,
                  device: torch.device | None = None) -> torch.Tensor:
    """Per-response lists placed in the last columns, the layout of left-padded batches."""
    out = torch.zeros(len(rows), width, device=device)
    for i, row in enumerate(rows):
        out[i, width - len(row):] = torch.tensor(row)
    return out


def masked_rows(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [x[i][mask[i]].tolist() for i in range(x.shape[0])]


class PhaseTimer:
    """Seconds spent per named phase, summed over the run."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def collect(roles_: dict, tokenizer, pages: list[dict], iteration: int, generator, settings,
            limits, timer: PhaseTimer) -> tuple[list[dict], dict]:
    """Sample, score and build the targets of one iteration's responses."""
    # imported here: sampling brings in transformers (seconds), which ppo_report never needs
    from reprorl.serve.sampling import response_text, sample_many

    actor = roles_["actor"]
    device = actor.device
    with timer("generation"):
        prompts = [prompt_ids(tokenizer, page["prompt"], limits, page["document_id"])
                   for page in pages]
        # one generator per response, seeded from the run's: a response's draws do not depend
        # on what is sampled beside it; the iteration's responses decode as one group of rows
        seeds = torch.randint(2**62, (len(prompts),), generator=generator).tolist()
        samples = sample_many(actor.backbone, prompts, limits["response_tokens"],
                              tokenizer.eos_token_id, limits["context_tokens"],
                              [devices.generator(seed, device) for seed in seeds],
                              TEMPERATURE, rows=PROMPTS_PER_ITERATION)
    examples = [Example(page["document_id"], tuple(ids), tuple(result.response_ids))
                for page, ids, result in zip(pages, prompts, samples)]
    batch = collate(examples, tokenizer.pad_token_id).to(device)
    width = roles.Role.response_width(batch)
    mask = batch.response_mask[:, -width:]
    with torch.no_grad():
        with timer("reference_scoring"):
            logp_ref, _ = roles_["reference"].token_logprobs(batch)
        with timer("reward_scoring"):
            scores = roles_["reward"].score(batch)
    # The first update's own forwards (same weights, same batch, graph kept): the critic's
    # values for GAE and the actor's re-scored log-probs come from them, detached
    with timer("critic_values"):
        values_live, _ = roles_["critic"].values(batch)
    with timer("teacher_forced_rescoring"):
        logp_live, _ = actor.token_logprobs(batch)
    values, logp_now = values_live.detach(), logp_live.detach()
    logp_old = right_aligned([s.logprobs for s in samples], width, device)
    cut = torch.tensor([s.finish_reason == "cut" for s in samples], device=device)
    rewards = losses.token_rewards(logp_old, logp_ref, mask, scores, cut,
                                     settings["kl_coef"], settings["cut_penalty"])
    advantages, returns = losses.gae(rewards, values * mask, mask,
                                       settings["gamma"], settings["lam"])
    per_token = {name: masked_rows(x, mask) for name, x in (
        ("behaviour_logprobs", logp_old), ("reference_logprobs", logp_ref), ("values", values),
        ("rewards", rewards), ("advantages", advantages), ("returns", returns))}
    rollouts = [
        {
            "rollout_id": f"iteration-{iteration:03d}-slot-{slot}",
            "document_id": page["document_id"],
            "prompt_ids": list(examples[slot].prompt_ids),
            "response_ids": samples[slot].response_ids,
            "text": response_text(tokenizer, samples[slot]),
            "finish_reason": samples[slot].finish_reason,
            "reward_model_score": float(scores[slot]),
            **{name: rows[slot] for name, rows in per_token.items()},
        }
        for slot, page in enumerate(pages)
    ]
    tensors = {"batch": batch, "mask": mask, "logp_old": logp_old, "advantages": advantages,
               "returns": returns,
               "rescoring_gap": float(((logp_now - logp_old).abs() * mask).max()),
               "first_forwards": {"actor": logp_live, "critic": values_live}}
    return rollouts, tensors


def update(roles_: dict, optimizers: dict, tensors: dict, lrs: dict, settings: dict,
           timer: PhaseTimer) -> dict:
    """One update of the actor and one of the critic on the iteration's batch. The first
    update takes the forwards `collect` ran with these weights; later ones forward again."""
    batch, mask = tensors["batch"], tensors["mask"]
    first = tensors.pop("first_forwards", {})
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    with timer("actor_optimisation"):
        logp = first["actor"] if first else roles_["actor"].token_logprobs(batch)[0]
        loss, stats = losses.actor_loss(logp, tensors["logp_old"], tensors["advantages"],
                                          mask, settings["clip_epsilon"])
        stats["actor_loss"] = float(loss.detach())
        stats["actor_grad_norm"] = optimizer_step(optimizers["actor"], lrs["actor"], loss,
                                                  settings["max_grad_norm"], "PPO actor")
    with timer("critic_optimisation"):
        values = first["critic"] if first else roles_["critic"].values(batch)[0]
        loss = losses.critic_loss(values, tensors["returns"], mask)
        stats["critic_loss"] = float(loss.detach())
        stats["critic_grad_norm"] = optimizer_step(optimizers["critic"], lrs["critic"], loss,
                                                   settings["max_grad_norm"], "PPO critic")
    for name in ("reference", "reward"):
        if any(p.grad is not None for p in roles_[name].parameters()):
            raise ReproError(f"the frozen {name} role received a gradient")
    return stats


def identity(config: dict, initial: dict) -> dict:
    return {
        "config": {k: config[k] for k in ("model", "limits", "ppo")},
        "base_model_sha256": hash_paths([config["model"]["path"]]),
        "data_sha256": hash_paths([layout.CORPUS / corpus.ROLLOUT_PROMPTS]),
        "checkpoints_sha256": hash_paths(INPUT_CHECKPOINTS),
        "code_sha256": code_hash("ppo_continuous"),
        "roles_initial": initial,
    }


def iterate(roles_: dict, optimizers: dict, tokenizer, pages: list[dict], number: int,
            generation, schedule, updates: int, settings: dict, limits: dict,
            timer: PhaseTimer) -> tuple[list[dict], dict]:
    """One PPO iteration: collect the batch, then UPDATES_PER_BATCH updates on it."""
    rollouts, tensors = collect(roles_, tokenizer, pages, number, generation, settings, limits,
                                timer)
    update_stats = [update(roles_, optimizers, tensors, schedule(updates + u), settings, timer)
                    for u in range(UPDATES_PER_BATCH)]
    count = len(rollouts)
    entry = {
        "iteration": number,
        "rollout_ids": [r["rollout_id"] for r in rollouts],
        "mean_reward_model_score": sum(r["reward_model_score"] for r in rollouts) / count,
        "cut": sum(r["finish_reason"] == "cut" for r in rollouts),
        "mean_response_tokens": sum(len(r["response_ids"]) for r in rollouts) / count,
        "rescoring_gap": tensors["rescoring_gap"],
        "updates": update_stats,
    }
    return rollouts, entry


def budget(settings: dict) -> tuple[int, int]:
    """Iterations and the interrupt point: the specification's, unless a profile cuts them
    (keys absent from the default profile's config, whose hashes therefore do not name them)."""
    iterations = settings.get("iterations", ITERATIONS)
    interrupt_at = settings.get("interrupt_at", min(INTERRUPT_AT, iterations // 2))
    if not 0 < interrupt_at < iterations:
        raise ReproError(f"config key ppo.interrupt_at: {interrupt_at} must lie between 1 and "
                         f"ppo.iterations - 1 = {iterations - 1}, so that a resume has work left")
    return iterations, interrupt_at


def learning_rates(settings: dict, step: int) -> dict:
    """Both optimisers' rates at update `step`: warm-up, then linear decay."""
    return {name: linear_warmup_decay(step, budget(settings)[0] * UPDATES_PER_BATCH,
                                      settings[f"{name}_learning_rate"],
                                      settings["warmup_ratio"], settings["final_lr_ratio"])
            for name in ("actor", "critic")}


def consume(state: dict, entry: dict) -> None:
    """Record a finished iteration in the run's progress; a rollout is consumed only once."""
    ids = entry["rollout_ids"]
    if set(ids) & set(state["consumed"]) or len(set(ids)) != len(ids):
        twice = sorted(set(ids) & set(state["consumed"]))
        raise ReproError(f"rollout ids consumed twice: {twice}")
    state["consumed"].extend(ids)
    state["iteration"] = entry["iteration"]
    state["history"].append(entry)


def train(config: dict, mode: str, checkpoint_every=None, log=print) -> dict:
    branch_run = Branch("ppo", mode)
    settings, limits = config["ppo"], config["limits"]
    seed_everything(settings["seed"])
    tokenizer = load_tokenizer(config["model"]["path"])
    pages = corpus.rollout_prompts()
    roles_ = build_roles(config)
    initial = roles.isolation_report(roles_)
    optimizers = {
        name: torch.optim.AdamW([p for p in roles_[name].parameters() if p.requires_grad],
                                lr=settings[f"{name}_learning_rate"],
                                weight_decay=settings["weight_decay"], **numerics.ADAMW)
        for name in ("actor", "critic")
    }
    schedule = functools.partial(learning_rates, settings)
    prompt_generator = torch.Generator().manual_seed(settings["prompt_seed"])
    generation = torch.Generator().manual_seed(settings["generation_seed"])
    run = ResumableRun(branch_run, identity(config, initial), roles_, optimizers,
                       {"prompts": prompt_generator, "generation": generation}, schedule,
                       checkpoint_every, step_key="iteration")
    updates, state = run.resume() or (
        0, {"order": [], "cursor": 0, "iteration": 0, "history": [], "consumed": []})
    iterations, interrupt_at = budget(settings)
    stop = branch_run.stop(interrupt_at, iterations)
    timer = PhaseTimer()
    started = time.perf_counter()
    bar = progress(iterations, f"ppo {mode}", initial=state["iteration"])
    # the iteration files (and a straight run's snapshots) are written beside the in-rule
    # checkpoints, which a rerun continues with, and appear under their final folders only
    # once the run has finished
    keep_at = snapshots.points(iterations) if branch_run.keeps_snapshots else []
    rollout_dir, snapshot_dir = (run.checkpoints.folder / name for name in ("rollouts", "kept"))
    rollout_dir.mkdir(parents=True, exist_ok=True)
    if keep_at:
        snapshots.write_plan(snapshot_dir, iterations)
    while state["iteration"] < stop:
        chosen, state["order"], state["cursor"] = next_prompts(
            state["order"], state["cursor"], prompt_generator, PROMPTS_PER_ITERATION,
            len(pages))
        number = state["iteration"] + 1
        rollouts, entry = iterate(roles_, optimizers, tokenizer, [pages[i] for i in chosen],
                                  number, generation, schedule, updates, settings, limits,
                                  timer)
        consume(state, entry)
        updates += UPDATES_PER_BATCH
        bar.update(1)
        write_json(rollout_dir / f"iteration-{number:03d}.json",
                   {"iteration": number, "rollouts": rollouts})
        if number in keep_at:
            snapshots.keep(roles_["actor"].backbone, snapshot_dir, number,
                           config["model"]["path"])
        if number % 10 == 0 or number == stop:
            seconds = time.perf_counter() - started
            log(f"ppo {mode}: iteration {number}/{iterations}, mean RM score "
                f"{entry['mean_reward_model_score']:.3f}, {seconds:.0f}s")
        run.reached(updates, state)
    bar.close()
    seconds = time.perf_counter() - started
    storage = run.save(updates, state)
    # copied, not moved: a rerun from the final checkpoint (a job whose end was lost) needs them
    for scratch, path in ((rollout_dir, layout.rollouts(mode)),
                          *([(snapshot_dir, layout.snapshots("ppo"))] if keep_at else [])):
        with atomic_directory(path) as folder:
            shutil.copytree(scratch, folder, dirs_exist_ok=True)
    final = {name: roles.learned_identity(role) for name, role in roles_.items()}
    costs = {"seconds": seconds, "phase_seconds": timer.seconds, "peak_rss_mb": peak_rss_mb(),
             "in_rule_checkpoints": run.checkpoints.finish()}
    report = {"mode": mode, "iterations": state["iteration"], "updates_per_optimizer": updates,
              "history": state["history"], "final_learned": final, "roles_initial": initial,
              "checkpoint": storage,
              "reference_and_reward_unchanged": True,
              "numerical_note": "behaviour log-probs come from the cached sampler and are the "
                                "ones used; rescoring_gap is their largest difference from a "
                                "teacher-forced pass before the first update"}
    # costs vary run to run: they go to the manifest's run section, not into this file
    branch_run.report(report)
    branch_run.export(run.identity, config, {"ppo": roles_["actor"], "critic": roles_["critic"]})
    return {"mode": mode, "iterations": state["iteration"], "updates_per_optimizer": updates,
            "costs": costs}


def rollout_report(mode: str = "continuous") -> dict:
    """Rubric verdicts and reward-model scores of the responses PPO sampled, per iteration.

    An evaluation: it reads the rollout prompts' situations (labels/rollouts.json), which the
    training stages never see, and changes nothing.
    """
    actions = {r["document_id"]: r["expected_action"]
               for r in corpus.read(corpus.ROLLOUT_LABELS, "evaluation")}
    record_read(layout.rollouts(mode))
    iterations = []
    for path in sorted(layout.rollouts(mode).glob("iteration-*.json")):
        content = read_json(path)
        rollouts = content["rollouts"]
        verdicts = [evaluate_response(r["text"], r["finish_reason"], actions[r["document_id"]])
                    for r in rollouts]
        iterations.append({
            "iteration": content["iteration"],
            "rubric_success_rate": sum(v["rubric_success"] for v in verdicts) / len(verdicts),
            "recognized_rate": sum(v["recognized"] for v in verdicts) / len(verdicts),
            "mean_reward_model_score": sum(r["reward_model_score"] for r in rollouts)
            / len(rollouts),
        })
    numbers = [entry["iteration"] for entry in iterations]
    if not numbers or numbers != list(range(1, len(numbers) + 1)):
        raise ReproError(f"{layout.rollouts(mode)} holds iterations {numbers[:3]}..., not 1 to "
                         f"the run's last: rerun ppo_{mode}")

    def window(rows: list[dict]) -> dict:
        keys = ("rubric_success_rate", "recognized_rate", "mean_reward_model_score")
        return {k: sum(r[k] for r in rows) / len(rows) for k in keys}

    report = {"mode": mode, "first_10": window(iterations[:10]),
              "last_10": window(iterations[-10:]), "iterations": iterations,
              "note": "sampled at temperature 1 during training; no gain is required"}
    write_json(layout.PPO_SAMPLED, report)
    return {k: v for k, v in report.items() if k != "iterations"}


def stage(name: str, config: dict, run, log=print) -> dict:
    if name == "ppo_report":
        summary = rollout_report()
        log(f"PPO sampled responses: {summary}")
        run.finish(summary=summary)
        return summary
    mode = name.removeprefix("ppo_")
    Branch("ppo", mode).refuse_to_overwrite()
    summary = train(config, mode, run.checkpoint_every, log)
    costs = summary.pop("costs")
    run.finish(summary=summary, run_info=costs)
    return summary
