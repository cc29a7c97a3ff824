"""PPO with four roles: actor and critic learn, reference and reward model stay frozen.

One iteration: draw 4 of the 672 rollout prompts (own permutation generator, reshuffled when
exhausted), sample one response each from the actor with a KV cache (temperature 1, full
vocabulary, response <= 64 tokens) recording the behaviour log-probs, then score the visited
prefixes with the reference (log-probs) and the critic (values) and the finished responses with
the reward model, all detached. Targets come from `ppo_math`; then 2 updates of the actor and
of the critic (two AdamW optimisers) on that same batch, the old log-probs and values never
replaced. 100 iterations: 400 responses, 200 actor and 200 critic updates.

Modes: `interrupt` stops after iteration 40 and saves at that boundary (no pending rollout);
`resume` runs the last 60 in a fresh process; `continuous` runs 100. `resume_check` passes only
on bitwise equality of the resume and continuous final states.
Departures from the seed: sampling uses a KV cache (the seed recomputes the prefix per token:
same distribution, ~Nx faster, see benchmarks/sampling.py); the 4 responses of an iteration are
scored in one left-padded batch.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from . import corpus, ppo_math, roles
from .codehash import code_hash
from .encoding import Example, collate, load_tokenizer, prompt_ids
from .manifest import (
    ReproError,
    atomic_directory,
    hash_paths,
    peak_rss_mb,
    read_json,
    refuse_to_overwrite,
    write_json,
)
from .progress import progress
from .roles import CHECKPOINTS, load_final
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

ITERATIONS, INTERRUPT_AT, PROMPTS_PER_ITERATION, UPDATES_PER_BATCH = 100, 40, 4, 2
# Sampling temperature, fixed by the specification: the actor loss and the KL reward use
# untempered log-probs, which are the behaviour log-probs only at temperature 1.
TEMPERATURE = 1.0
ROLLOUT_PROMPTS = 672
ROLLOUT_DIR = Path("outputs/learning/rollouts")
INPUT_CHECKPOINTS = [CHECKPOINTS / f"{b}-final.{e}" for b in ("sft", "reward")
                     for e in ("safetensors", "json")]


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


def right_aligned(rows: list[list[float]], width: int) -> torch.Tensor:
    """Per-response lists placed in the last columns, the layout of left-padded batches."""
    out = torch.zeros(len(rows), width)
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
    actor = roles_["actor"]
    examples, samples = [], []
    with timer("generation"):
        for page in pages:
            ids = prompt_ids(tokenizer, page["prompt"], limits, page["document_id"])
            result = sample(actor.backbone, ids, limits["response_tokens"],
                            tokenizer.eos_token_id, generator, TEMPERATURE)
            samples.append(result)
            examples.append(Example(page["document_id"], tuple(ids), tuple(result.response_ids)))
    batch = collate(examples, tokenizer.pad_token_id)
    width = roles.Role.response_width(batch)
    mask = batch.response_mask[:, -width:]
    with torch.no_grad():
        with timer("reference_scoring"):
            logp_ref, _ = roles_["reference"].token_logprobs(batch)
        with timer("critic_values"):
            values, _ = roles_["critic"].values(batch)
        with timer("reward_scoring"):
            scores = roles_["reward"].score(batch)
        with timer("teacher_forced_rescoring"):
            logp_now, _ = actor.token_logprobs(batch)
    logp_old = right_aligned([s.logprobs for s in samples], width)
    cut = torch.tensor([s.finish_reason == "cut" for s in samples])
    rewards = ppo_math.token_rewards(logp_old, logp_ref, mask, scores, cut,
                                     settings["kl_coef"], settings["cut_penalty"])
    advantages, returns = ppo_math.gae(rewards, values * mask, mask,
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
               "rescoring_gap": float(((logp_now - logp_old).abs() * mask).max())}
    return rollouts, tensors


def _step(optimizer, lr: float, loss: torch.Tensor, max_grad_norm: float) -> float:
    """Backward, clip, step; returns the gradient norm before clipping."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss.backward()
    parameters = optimizer.param_groups[0]["params"]
    norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
    optimizer.step()
    return norm


def update(roles_: dict, optimizers: dict, tensors: dict, lrs: dict, settings: dict,
           timer: PhaseTimer) -> dict:
    """One update of the actor and one of the critic on the iteration's batch."""
    batch, mask = tensors["batch"], tensors["mask"]
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    with timer("actor_optimisation"):
        logp, _ = roles_["actor"].token_logprobs(batch)
        loss, stats = ppo_math.actor_loss(logp, tensors["logp_old"], tensors["advantages"],
                                          mask, settings["clip_epsilon"])
        stats["actor_loss"] = float(loss.detach())
        stats["actor_grad_norm"] = _step(optimizers["actor"], lrs["actor"], loss,
                                         settings["max_grad_norm"])
    with timer("critic_optimisation"):
        values, _ = roles_["critic"].values(batch)
        loss = ppo_math.critic_loss(values, tensors["returns"], mask)
        stats["critic_loss"] = float(loss.detach())
        stats["critic_grad_norm"] = _step(optimizers["critic"], lrs["critic"], loss,
                                          settings["max_grad_norm"])
    for name in ("reference", "reward"):
        if any(p.grad is not None for p in roles_[name].parameters()):
            raise ReproError(f"the frozen {name} role received a gradient")
    return stats


def identity(config: dict, initial: dict) -> dict:
    return {
        "config": {k: config[k] for k in ("model", "limits", "ppo")},
        "base_model_sha256": hash_paths([config["model"]["path"]]),
        "data_sha256": hash_paths([corpus.CORPUS_DIR / "train/pages.json"]),
        "checkpoints_sha256": hash_paths(INPUT_CHECKPOINTS),
        "code_sha256": code_hash("ppo_continuous"),
        "roles_initial": initial,
    }


def train(config: dict, mode: str, log=print) -> dict:
    settings, limits = config["ppo"], config["limits"]
    seed_everything(settings["seed"])
    tokenizer = load_tokenizer(config["model"]["path"])
    pages = corpus.read("train/pages.json", "learning")
    if len(pages) != ROLLOUT_PROMPTS or any(p["population"] != "rollout" for p in pages):
        raise ReproError(f"expected the {ROLLOUT_PROMPTS} rollout prompts, found {len(pages)}")
    roles_ = build_roles(config)
    initial = roles.isolation_report(roles_)
    optimizers = {
        name: torch.optim.AdamW([p for p in roles_[name].parameters() if p.requires_grad],
                                lr=settings[f"{name}_learning_rate"],
                                weight_decay=settings["weight_decay"])
        for name in ("actor", "critic")
    }
    total = ITERATIONS * UPDATES_PER_BATCH

    def schedule(step: int) -> dict:
        return {name: linear_warmup_decay(step, total, settings[f"{name}_learning_rate"],
                                          settings["warmup_ratio"], settings["final_lr_ratio"])
                for name in optimizers}

    prompt_generator = torch.Generator().manual_seed(settings["prompt_seed"])
    generation = torch.Generator().manual_seed(settings["generation_seed"])
    run_identity = identity(config, initial)
    order, cursor, iteration, updates, history, consumed = [], 0, 0, 0, [], []
    if mode == "resume":
        state = load_state(CHECKPOINTS / "ppo-interrupt.pt.gz")
        difference = first_difference(state["identity"], run_identity, "identity")
        if difference or state["pending_rollouts"]:
            raise ReproError(f"the PPO interrupt state cannot be resumed by this run "
                             f"({difference or 'pending rollouts'}); rerun ppo_interrupt")
        for name, role in roles_.items():
            roles.load_learned(role, state["learned"][name])
        for name, optimizer in optimizers.items():
            optimizer.load_state_dict(state["optimizers"][name])
        prompt_generator.set_state(state["prompt_generator"])
        generation.set_state(state["generation"])
        restore_rng(state["rng"])
        order, cursor, iteration = state["order"], state["cursor"], state["iteration"]
        updates, history, consumed = state["updates"], state["history"], state["consumed"]
        if state["scheduler"] != {"next_update": updates, "next_lr": schedule(updates)}:
            raise ReproError("the saved PPO schedule position does not match this run's")
    stop = INTERRUPT_AT if mode == "interrupt" else ITERATIONS
    timer = PhaseTimer()
    started = time.perf_counter()
    bar = progress(ITERATIONS, f"ppo {mode}", initial=iteration)
    # the iteration files appear under their final folder only once the run has finished
    with atomic_directory(ROLLOUT_DIR / mode) as rollout_dir:
        while iteration < stop:
            chosen, order, cursor = next_prompts(order, cursor, prompt_generator,
                                                 PROMPTS_PER_ITERATION, len(pages))
            rollouts, tensors = collect(roles_, tokenizer, [pages[i] for i in chosen],
                                        iteration + 1, generation, settings, limits, timer)
            ids = [r["rollout_id"] for r in rollouts]
            if set(ids) & set(consumed) or len(set(ids)) != len(ids):
                twice = sorted(set(ids) & set(consumed))
                raise ReproError(f"rollout ids consumed twice: {twice}")
            update_stats = []
            for _ in range(UPDATES_PER_BATCH):
                update_stats.append(update(roles_, optimizers, tensors, schedule(updates),
                                           settings, timer))
                updates += 1
            consumed.extend(ids)
            iteration += 1
            bar.update(1)
            entry = {
                "iteration": iteration,
                "rollout_ids": ids,
                "mean_reward_model_score":
                    sum(r["reward_model_score"] for r in rollouts) / len(ids),
                "cut": sum(r["finish_reason"] == "cut" for r in rollouts),
                "mean_response_tokens": sum(len(r["response_ids"]) for r in rollouts) / len(ids),
                "rescoring_gap": tensors["rescoring_gap"],
                "updates": update_stats,
            }
            history.append(entry)
            write_json(rollout_dir / f"iteration-{iteration:03d}.json",
                       {"iteration": iteration, "rollouts": rollouts})
            if iteration % 10 == 0 or iteration == stop:
                log(f"ppo {mode}: iteration {iteration}/{ITERATIONS}, mean RM score "
                    f"{entry['mean_reward_model_score']:.3f}, {time.perf_counter() - started:.0f}s")
    bar.close()
    seconds = time.perf_counter() - started
    final = {name: roles.learned_identity(role) for name, role in roles_.items()}
    for name, role in roles_.items():
        if roles.frozen_identity(role) != initial[name]["frozen_identity"]:
            raise ReproError(f"the frozen base of the {name} role changed")
    for name in ("reference", "reward"):
        if final[name] != initial[name]["learned_identity"]:
            raise ReproError(f"the frozen {name} role changed during PPO")
    for name in ("actor", "critic"):
        if final[name] == initial[name]["learned_identity"]:
            raise ReproError(f"PPO did not change the {name}")
    state = {
        "identity": run_identity,
        "learned": {name: {n: t.detach().clone() for n, t in roles.learned_state(r).items()}
                    for name, r in roles_.items()},
        "optimizers": {name: o.state_dict() for name, o in optimizers.items()},
        "prompt_generator": prompt_generator.get_state(),
        "generation": generation.get_state(),
        "rng": rng_state(),
        "order": order, "cursor": cursor, "iteration": iteration, "updates": updates,
        "scheduler": {"next_update": updates, "next_lr": schedule(updates)},
        "history": history, "consumed": consumed, "pending_rollouts": [],
    }
    storage = save_state(CHECKPOINTS / f"ppo-{mode}.pt.gz", state)
    costs = {"seconds": seconds, "phase_seconds": timer.seconds, "peak_rss_mb": peak_rss_mb()}
    report = {"mode": mode, "iterations": iteration, "updates_per_optimizer": updates,
              "history": history, "final_learned": final, "roles_initial": initial,
              "checkpoint": storage,
              "reference_and_reward_unchanged": True,
              "numerical_note": "behaviour log-probs come from the cached sampler and are the "
                                "ones used; rescoring_gap is their largest difference from a "
                                "teacher-forced pass before the first update"}
    # costs vary run to run: they go to the manifest's run section, not into this file
    write_json(f"outputs/learning/ppo/{mode}.json", report)
    if mode == "resume":
        roles.save_final(roles_["actor"], "ppo", run_identity, config)
        roles.save_final(roles_["critic"], "critic", run_identity, config)
    return {"mode": mode, "iterations": iteration, "updates_per_optimizer": updates,
            "costs": costs}


def resume_check() -> dict:
    resumed = CHECKPOINTS / "ppo-resume.pt.gz"
    final = load_state(resumed)
    return check_resume(
        "PPO", CHECKPOINTS / "ppo-continuous.pt.gz", resumed,
        "outputs/learning/ppo/resume-check.json",
        {"iterations": final["iteration"], "updates_per_optimizer": final["updates"],
         "rollout_ids": len(final["consumed"])})


def rollout_report(mode: str = "continuous") -> dict:
    """Rubric verdicts and reward-model scores of the responses PPO sampled, per iteration.

    An evaluation: it reads the rollout prompts' situations (labels/rollouts.json), which the
    training stages never see, and changes nothing.
    """
    actions = {r["document_id"]: r["expected_action"]
               for r in corpus.read("labels/rollouts.json", "evaluation")}
    iterations = []
    for path in sorted((ROLLOUT_DIR / mode).glob("iteration-*.json")):
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
    if len(iterations) != ITERATIONS:
        raise ReproError(f"{ROLLOUT_DIR / mode} holds {len(iterations)} iterations, not "
                         f"{ITERATIONS}: rerun ppo_{mode}")

    def window(rows: list[dict]) -> dict:
        keys = ("rubric_success_rate", "recognized_rate", "mean_reward_model_score")
        return {k: sum(r[k] for r in rows) / len(rows) for k in keys}

    report = {"mode": mode, "first_10": window(iterations[:10]),
              "last_10": window(iterations[-10:]), "iterations": iterations,
              "note": "sampled at temperature 1 during training; no gain is required"}
    write_json("outputs/learning/ppo/rollout-rubric.json", report)
    return {k: v for k, v in report.items() if k != "iterations"}


def stage(name: str, config: dict, run, log=print) -> dict:
    if name == "ppo_report":
        summary = rollout_report()
        log(f"PPO sampled responses: {summary}")
        run.finish(inputs=[ROLLOUT_DIR / "continuous", corpus.CORPUS_DIR / "labels/rollouts.json"],
                   outputs=["outputs/learning/ppo/rollout-rubric.json"], summary=summary)
        return summary
    mode = name.removeprefix("ppo_")
    if mode == "resume_check":
        result = resume_check()
        run.finish(inputs=[CHECKPOINTS / "ppo-continuous.pt.gz",
                           CHECKPOINTS / "ppo-resume.pt.gz"],
                   outputs=["outputs/learning/ppo/resume-check.json"], summary=result)
        return result
    destination = CHECKPOINTS / f"ppo-{mode}.pt.gz"
    refuse_to_overwrite(destination)
    summary = train(config, mode, log)
    inputs = [config["model"]["path"], corpus.CORPUS_DIR / "train/pages.json",
              *INPUT_CHECKPOINTS]
    outputs = [destination, f"outputs/learning/ppo/{mode}.json", ROLLOUT_DIR / mode]
    if mode == "resume":
        inputs.append(CHECKPOINTS / "ppo-interrupt.pt.gz")
        outputs += [CHECKPOINTS / f"{n}-final.{e}" for n in ("ppo", "critic")
                    for e in ("safetensors", "json")] + [CHECKPOINTS / "ppo-peft"]
    costs = summary.pop("costs")
    run.finish(inputs=inputs, outputs=outputs, summary=summary,
               run_info=costs)
    return summary
