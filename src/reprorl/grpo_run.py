"""GRPO runs of the pipeline: the async engine (`reprorl.grpo`) on the 672 rollout prompts.

Both runs start from the SFT actor (its adapters keep training) and differ only in the reward:
- `grpo_verifier`: the rubric as an exact verifier, 1.0 for a rubric success else 0.0. It reads
  the situation behind each rollout prompt (`labels/rollouts.json`, train families only),
  through the `verifier` corpus scope: this run learns from the task's true criterion;
- `grpo_learned`: the frozen Bradley-Terry reward model's score ("predicted simulated
  preference"), minus `cut_penalty` for a response cut without EOS, as in PPO.
The embedded generation server samples; the trainer and the worker run beside it. With the
profile's `grpo.schedule_lag` (default 1) the schedule is fixed and the server batch invariant,
so a run's bytes do not depend on timing; with `schedule_lag: null` (free-running) they do.
The run's held-out evaluation is the generate/evaluate rules, shared with SFT and PPO.
"""

from __future__ import annotations

import json
import shutil
import time

import torch

from . import corpus, layout, roles
from .encoding import Example, collate, load_tokenizer, prompt_ids
from .errors import ReproError
from .exports import load_final, save_final, verified_final
from .grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from .manifest import atomic_write_bytes, peak_rss_mb, refuse_to_overwrite, write_json
from .rubric import evaluate_response


class RubricVerifier:
    """1.0 when the answer is a rubric success for the prompt's situation, else 0.0."""

    __name__ = "rubric_verifier"

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def __call__(self, completions, completion_ids, expected_action, **kwargs):
        rewards = []
        for completion, ids, action in zip(completions, completion_ids, expected_action):
            finish = "eos" if ids and ids[-1] == self.eos_id else "cut"
            verdict = evaluate_response(completion[-1]["content"], finish, action)
            rewards.append(1.0 if verdict["rubric_success"] else 0.0)
        return rewards


class LearnedReward:
    """The frozen reward model's score of (prompt, completion), loaded once in the worker."""

    __name__ = "learned_reward"

    def __init__(self, config: dict, cut_penalty: float):
        self.config, self.cut_penalty = config, cut_penalty
        self.role = self.tokenizer = None

    def __getstate__(self):  # the model is rebuilt in the worker, never pickled
        return {"config": self.config, "cut_penalty": self.cut_penalty}

    def __setstate__(self, state):
        self.__init__(state["config"], state["cut_penalty"])

    @torch.inference_mode()
    def __call__(self, prompts, completion_ids, **kwargs):
        if self.role is None:
            self.role, _ = load_final("reward", "reward", self.config)
            self.tokenizer = load_tokenizer(self.config["model"]["path"])
        eos, limits = self.tokenizer.eos_token_id, self.config["limits"]
        examples = [Example(str(i), tuple(prompt_ids(self.tokenizer, p[-1]["content"], limits)),
                            tuple(ids)) for i, (p, ids) in enumerate(zip(prompts, completion_ids))]
        scores = self.role.score(collate(examples, self.tokenizer.pad_token_id))
        return [float(s) - (0.0 if ids[-1] == eos else self.cut_penalty)
                for s, ids in zip(scores, completion_ids)]


def dataset(run: str) -> list[dict]:
    pages = corpus.rollout_prompts()
    rows = [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "document_id": p["document_id"]} for p in pages]
    if run == "verifier":
        labels = {r["document_id"]: r["expected_action"]
                  for r in corpus.read("labels/rollouts.json", "verifier")}
        if set(labels) != {r["document_id"] for r in rows}:
            raise ReproError("labels/rollouts.json does not label exactly the rollout prompts")
        for row in rows:
            row["expected_action"] = labels[row["document_id"]]
    return rows


def train(config: dict, run: str, log=print) -> dict:
    settings, limits = dict(config["grpo"]), config["limits"]
    cut_penalty, server_url = settings.pop("cut_penalty"), settings.pop("vllm_server_base_url")
    output_dir = layout.grpo_output_dir(run)
    tokenizer = load_tokenizer(config["model"]["path"])
    rows = dataset(run)
    reward = (RubricVerifier(tokenizer.eos_token_id) if run == "verifier"
              else LearnedReward(config, cut_penalty))
    if run == "learned":  # the worker loads it; checked here so a bad file fails first
        verified_final("reward")
    actor, sft_meta = load_final("sft", "actor", config)
    initial = roles.learned_identity(actor)
    policy = f"grpo_{run}"
    for path in (*layout.final_files(policy), layout.peft(policy)):  # inputs sound: outputs
        refuse_to_overwrite(path)
    shutil.rmtree(output_dir, ignore_errors=True)  # inputs are sound: a re-run starts afresh
    if server_url is not None:
        settings["vllm_server_base_url"] = server_url
    args = AsyncGRPOConfig(
        output_dir=str(output_dir), embedded_server=server_url is None,
        dtype=config["model"]["dtype"],
        embedded_server_max_model_len=limits["context_tokens"],
        max_completion_length=limits["response_tokens"], disable_tqdm=False, **settings)
    # the rule's cores are shared: the embedded server takes its threads, the trainer the rest
    # (benchmarks/grpo_async.py: a trainer with 2 threads beside the server is slower, 0.92x)
    if args.embedded_server:
        torch.set_num_threads(max(1, torch.get_num_threads() - args.embedded_server_threads))
    trainer = AsyncGRPOTrainer(actor.backbone, reward, args, rows, tokenizer, log=log)
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    if result.global_step and roles.learned_identity(actor) == initial:
        raise ReproError(f"GRPO ({run}) took {result.global_step} steps but left the actor "
                         "unchanged")
    identity = {"run": run, "sft": sft_meta["sha256"], "grpo": settings}
    save_final(actor, policy, identity, config)
    shutil.rmtree(output_dir / ".vllm_lora", ignore_errors=True)  # a serving cache only
    (output_dir / "server.port").unlink(missing_ok=True)
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    # windows of training steps only (the closing flush holds a few worker records)
    records = [r for r in map(json.loads, lines) if r.get("loss") is not None]
    keys = ("reward", "reward_kept", "frac_reward_zero_std", "entropy",
            "sample/staleness_mean", "sample/dropped_stale_count", "completions/mean_length",
            "sampling/importance_sampling_ratio/mean", "sampling/masked_mean",
            "perf/rollout_wait_s", "rollout/backpressure_s")

    def mean_of(part: list[dict]) -> dict:
        out = {}
        for key in keys:
            values = [r[key] for r in part if r.get(key) is not None]
            out[key] = sum(values) / len(values) if values else None
        return out

    tenth = max(2, len(records) // 10)  # first and last tenth of the windows, two at least
    summary = {
        "run": run, "reward_function": type(reward).__name__, "steps": result.global_step,
        "train_loss": result.training_loss, "seconds": seconds,
        "first_windows": mean_of(records[:tenth]), "last_windows": mean_of(records[-tenth:]),
        "windows": len(records), "settings": settings,
        "note": "sampled at temperature 1 during training; an async run is not bitwise "
                "reproducible (which version served which request depends on timing)",
    }
    write_json(layout.grpo_report(run), summary)
    atomic_write_bytes(layout.grpo_metrics(run), (output_dir / "metrics.jsonl").read_bytes())
    return summary


def stage(name: str, config: dict, run, log=print) -> dict:
    summary = train(config, name.removeprefix("grpo_"), log)
    run.finish(
        summary={k: summary[k] for k in ("run", "steps", "first_windows", "last_windows")},
        run_info={"seconds": summary["seconds"], "peak_rss_mb": peak_rss_mb()})
    return {k: summary[k] for k in ("run", "steps", "seconds", "last_windows")}
