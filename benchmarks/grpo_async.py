"""Async GRPO against the same engine run synchronously, side by side in one run.

Both arms start from the same SFT actor, train on the same 672 rollout prompts with the same
reward (the rubric verifier by default, `--reward learned` for the reward model), seed and
step budget (`--steps` optimizer steps of `per_device_train_batch_size` samples), with the
embedded server:
- sync: the worker fills one step's samples under version v, then waits until the trainer has
  stepped and synced v+1 (generation waits for training, one version at a time);
- async: the default flow control (`max_staleness` = 4, token allowance).
Printed: trained samples/s and trained tokens/s of each arm and their ratio, with the queue and
backpressure metrics that explain it. Needs the pipeline's model and SFT adapters:

    snakemake --cores all sft_resume   # once
    python benchmarks/grpo_async.py --steps 40
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from reprorl import config as configuration
from reprorl import exports
from reprorl.encoding import load_tokenizer
from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from reprorl.grpo_run import LearnedReward, RubricVerifier, dataset

REPORTED = ("perf/rollout_wait_s", "rollout/backpressure_s", "rollout/queue_size",
            "sample/staleness_mean", "rollout/concurrency", "perf/fwd_bwd_s", "perf/step_s",
            "frac_reward_zero_std", "rollout/vllm_kv_cache_usage_frac")


def arm(config: dict, synchronous: bool, steps: int, workdir: Path, reward: str) -> dict:
    settings = {k: v for k, v in config["grpo"].items()
                if k not in ("cut_penalty", "vllm_server_base_url")}
    settings.update(max_steps=steps, save_strategy="no", logging_steps=1, disable_tqdm=True,
                    synchronous=synchronous)
    tokenizer = load_tokenizer(config["model"]["path"])
    actor, _ = exports.load_final("sft", "actor", config)
    output_dir = workdir / ("sync" if synchronous else "async")
    args = AsyncGRPOConfig(output_dir=str(output_dir), embedded_server=True,
                           dtype=config["model"]["dtype"],
                           embedded_server_max_model_len=config["limits"]["context_tokens"],
                           max_completion_length=config["limits"]["response_tokens"], **settings)
    function = (RubricVerifier(tokenizer.eos_token_id) if reward == "verifier"
                else LearnedReward(config, config["grpo"]["cut_penalty"]))
    trainer = AsyncGRPOTrainer(actor.backbone, function, args, dataset(reward), tokenizer,
                               log=lambda message: None)
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    windows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text()
               .splitlines()]
    trained = [w for w in windows if w.get("batch/samples_per_step") is not None]
    samples = sum(w["batch/samples_per_step"] for w in trained)
    tokens = sum(w["batch/trained_tokens_per_step"] for w in trained)
    # time from the first step's start: server start-up and the cold sync cost both arms alike
    train_s = sum(w["perf/step_s"] for w in trained)
    means = {}
    for key in REPORTED:
        values = [w[key] for w in windows if w.get(key) is not None]
        means[key] = sum(values) / len(values) if values else None
    return {"steps": result.global_step, "wall_s": seconds, "train_s": train_s,
            "samples": samples, "trained_tokens": tokens,
            "samples_per_s": samples / train_s, "trained_tokens_per_s": tokens / train_s,
            "stale_dropped": sum(w.get("sample/dropped_stale_count") or 0 for w in windows),
            **means}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reward", choices=("verifier", "learned"), default="verifier")
    parser.add_argument("--trainer-threads", type=int, default=1,
                        help="torch threads of the trainer (the embedded server has 1); with 1 "
                             "the two sides of the async arm each own a core on 2 cores")
    args = parser.parse_args()
    config = configuration.load(args.config)
    import torch

    torch.set_num_threads(args.trainer_threads)
    workdir = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    try:
        sync = arm(config, True, args.steps, workdir, args.reward)
        fast = arm(config, False, args.steps, workdir, args.reward)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{'':34} {'sync':>12} {'async':>12}")
    for key in ("steps", "train_s", "wall_s", "samples", "trained_tokens", "samples_per_s",
                "trained_tokens_per_s", "stale_dropped", *REPORTED):
        a, b = sync[key], fast[key]
        show = (lambda v: "n/a" if v is None else f"{v:12.3f}")
        print(f"{key:34} {show(a):>12} {show(b):>12}")
    print(f"\nasync / sync, trained samples per second: "
          f"{fast['samples_per_s'] / sync['samples_per_s']:.2f}x")
    print(f"async / sync, trained tokens per second:  "
          f"{fast['trained_tokens_per_s'] / sync['trained_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
