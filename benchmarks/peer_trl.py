"""TRL's GRPOTrainer beside reprorl's AsyncGRPOTrainer, side by side in one run.

    pip install -e ".[bench]"        # TRL 1.16 and peft; reprorl itself needs neither
    python benchmarks/peer_trl.py --steps 40     # in a checkout (or a working directory of one)

Run from a working directory holding the pipeline's default-profile model and SFT actor
(`assets/model`, `assets/checkpoints/sft-*`) and its corpus (`data/generated`); whatever is
missing is built there first with `python -m snakemake --cores all sft_resume --configfile
<config>` (base model, corpus, SFT), by benchmarks/grpo_async.py's `ensure_sft`. TRL is checked
before anything is built or trained: without it the script stops with one line naming the
install.

The two arms, run TRL, reprorl, TRL, reprorl (`--rounds 2`), each for `--steps` optimizer
steps, on what they share:
- the policy: the default profile's SFT actor, i.e. the embedded base model `assets/model`
  (float32) with the SFT LoRA adapter (rank 8, alpha 16, the seven projections of every
  layer), trained further as a LoRA: reprorl loads it with `exports.load_final`, TRL gets the
  same adapter from its PEFT export (`assets/checkpoints/sft-peft`) as a trainable
  `PeftModel`; the script checks that both give the same logits before it starts;
- the prompts: the corpus's 672 rollout prompts as `grpo_run.dataset("verifier")` reads them,
  in reprorl's own order (its seeded epoch shuffle, `rows.epoch_order`), which TRL reads
  in that order with `shuffle_dataset=False`: TRL's step s and reprorl's block s are the same
  4 prompts, rendered by the same chat template to the same token ids;
- the reward: `grpo_run.RubricVerifier`, the pipeline's rubric verifier (1.0 for a rubric
  success of the prompt's expected action, else 0.0; cheap), the same function on both sides;
- groups of 4 (`num_generations`), completions of 64 tokens at most, temperature 1 without
  truncation (TRL's defaults top_p=1, top_k=0), seed 49, learning rate 5e-4 held constant,
  max_grad_norm 1, AdamW (fused) without weight decay, no KL term, no gradient checkpointing;
- a step of 4 prompts x 4 completions = 16 samples: TRL `per_device_train_batch_size=16`,
  one micro-batch, one generation per step; reprorl `groups_per_step=4` of the profile.

How the arms differ (each side's own defaults, the reprorl side those of configs/default.yaml):
- generation: TRL samples in its own process with transformers' `generate()` (left-padded
  batch of 16, KV cache), between its steps; reprorl's spawned rollout worker asks the
  embedded server (`reprorl serve`, its own process, 1 torch thread, continuous batching)
  while the trainer trains, on the fixed schedule of the profile (`schedule_lag` 3: step s
  trains samples drawn by weight version s - 3, so up to 4 blocks are in flight);
- threads: TRL's one process has `--trl-threads` torch threads, by default what TRL gets
  when nobody sets them (torch's default: one per core, 2 here); reprorl's trainer 1
  (`--trainer-threads`) beside the server's 1, as the pipeline's GRPO rule runs: both sides
  compute on the machine's two cores. Beside another job using the cores TRL's two threads
  wait on each other (measured: 52 s for 3 steps against 6.5 s with 1, the same tokens), so
  on a busy machine `--trl-threads 1` is TRL's better setting;
- samples per step: TRL trains all 16, a group whose 4 rewards are equal included (its
  advantages are 0: its tokens are in the loss and its normalisation but move nothing);
  reprorl drops such a group before training, so a step has 16 samples or fewer, and a block
  whose 4 groups all drop trains nothing (its time still counts; the next step takes the
  next block, so reprorl then sees a few more prompts than TRL);
- the loss: TRL's default `dapo` (clipped surrogate, epsilon 0.2, rewards scaled by the group
  std, tokens averaged over the step); reprorl's score centering over the sampler's top 8
  log-probs with importance-sampling masking [0.5, 5.0] against the server's log-probs;
- the forward: TRL one padded batch of 16 prompt + completion rows (plus the log-probs
  `generate()` does not give: one forward without gradient when it needs old log-probs,
  which with one iteration per generation it skips); reprorl tree-packed rows of at most 320
  tokens, a group's shared prompt forwarded once;
- weights: TRL generates with the weights it trains (on-policy); reprorl writes the adapter
  after every step and the server loads it (`perf/weight_sync_s`);
- overridden TRL defaults, and why: `bf16=False` (TRL turns bf16 autocast on by default, the
  profile trains in float32), `gradient_checkpointing=False` (TRL's default True; the
  profile's is off for the tiny model), `learning_rate`/`lr_scheduler_type` (1e-6 linear by
  default: the profile's 5e-4 constant, so both policies drift alike over the run),
  `use_cpu=True` (reprorl's trainer is CPU only), `save_strategy="no"`, `report_to="none"`,
  `disable_tqdm`; everything else (loss, scaling, logging every 10 steps) is TRL's default;
- reprorl's overrides of its profile: `max_steps`, `save_strategy="no"`, `logging_steps=1`
  (a metrics window per step, which the shares below are summed from).

Measured per arm: trained tokens (completion tokens in the loss, EOS included; TRL: every
sampled completion, counted where the reward sees it; reprorl: `batch/trained_tokens_per_step`)
over the time from the first step's start to the last step's end (TRL: its callbacks'
`on_step_begin` / `on_step_end`, generation inside; reprorl: the training loop's start to
the last step's end, including the first rollouts' wait, the spawned worker's start and any
empty block; not the server's start-up before it, nor the model loading of either). Also
the same from the end of the first step ("steady": leaves out both sides' first step, but
reprorl's first step also generated the blocks its lag of 3 has in flight, so this favours
it), TRL's "signal" tokens (those of groups with unequal rewards, what reprorl trains), the share
of TRL's time in `generate()`, and reprorl's split of its time: waiting for rollouts (the
server and worker bound the step), forward + backward, optimizer, weight sync, other; and the
embedded server's share of the same time (its engine thread busy, in decode and in prefill,
from its `reprorl:engine_*` counters read at the loop's start and end) with the sequences,
rows (the sequences and idle slots beside them) and adapters (weight versions) an average
decode forward carried. The
last line is one JSON object: `reprorl_tokens_per_s`, `trl_tokens_per_s` (all rounds' tokens
over all rounds' seconds), `ratio` (reprorl over TRL), then the details.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from grpo_async import ensure_sft  # benchmarks/: the script's own folder

from reprorl.core import config as configuration
from reprorl.core import layout
from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from reprorl.grpo.metrics import metrics_file, read_windows
from reprorl.grpo.rows import epoch_order
from reprorl.model.encoding import load_tokenizer
from reprorl.pipeline import exports
from reprorl.pipeline.grpo_run import RubricVerifier, dataset, engine_settings

ROOT = Path(__file__).resolve().parent.parent
INSTALL = 'pip install -e ".[bench]"'
TRL_VERSION = "1.16."
REPRORL_SHARES = (("rollout wait", "perf/rollout_wait_s"), ("fwd+bwd", "perf/fwd_bwd_s"),
                  ("optimizer", "perf/optimizer_s"), ("weight sync", "perf/weight_sync_s"))


def require_trl() -> str:
    """TRL's version; one clear line and exit 1 when the bench extra is not installed."""
    try:
        for name in ("trl", "peft", "datasets"):  # datasets comes with trl; the arm needs it
            importlib.import_module(name)
    except ImportError as error:
        sys.exit(f"benchmarks/peer_trl.py needs TRL {TRL_VERSION}x and peft ({error}): "
                 f"install the bench extra in the checkout: {INSTALL}")
    import trl

    if not trl.__version__.startswith(TRL_VERSION):
        print(f"warning: TRL {trl.__version__} installed; this benchmark was written for "
              f"{TRL_VERSION}x ({INSTALL})", flush=True)
    return trl.__version__


def ordered_rows(config: dict) -> list[dict]:
    """The rollout prompts in reprorl's first-epoch order for the profile's seed."""
    rows = dataset("verifier")
    seed = AsyncGRPOConfig(**shared_settings(config)).data_order_seed
    return [rows[i] for i in epoch_order(seed, 0, len(rows))]


def shared_settings(config: dict) -> dict:
    """The profile's GRPO settings as AsyncGRPOConfig fields."""
    settings = engine_settings(config)
    return {**settings, "dtype": config["model"]["dtype"],
            "max_completion_length": config["limits"]["response_tokens"],
            "embedded_server_max_model_len": config["limits"]["context_tokens"]}


def steady(tokens: list[float], ends: list[float]) -> float | None:
    """Trained tokens/s from the end of the first step to the end of the last."""
    if len(tokens) < 2 or len(ends) != len(tokens):
        return None
    return sum(tokens[1:]) / (ends[-1] - ends[0])


# ------------------------------------------------------------------------------ reprorl


class TimedAsyncTrainer(AsyncGRPOTrainer):
    """Notes when the training loop starts and when each optimizer step ends, and the embedded
    server's engine counters at the loop's start and end."""

    def _loop(self) -> None:
        self.loop_started, self.step_ends = time.monotonic(), []
        self.engine_work = [engine_work(self.args.vllm_server_base_url)]
        super()._loop()
        self.engine_work.append(engine_work(self.args.vllm_server_base_url))

    def _record_step(self, step, step_s: float) -> None:
        self.step_ends.append(time.monotonic())
        super()._record_step(step, step_s)


def reprorl_arm(config: dict, rows: list[dict], steps: int, workdir: Path,
                threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(config["model"]["path"])
    actor, _ = exports.load_final("sft", "actor", config)
    output_dir = workdir / "reprorl"
    shutil.rmtree(output_dir, ignore_errors=True)
    args = AsyncGRPOConfig(output_dir=str(output_dir), embedded_server=True,
                           **{**shared_settings(config), "max_steps": steps,
                              "save_strategy": "no", "logging_steps": 1,
                              "disable_tqdm": True})
    trainer = TimedAsyncTrainer(actor.backbone, RubricVerifier(tokenizer.eos_token_id), args,
                                rows, tokenizer, log=lambda message: None)
    started = time.monotonic()
    result = trainer.train()
    wall = time.monotonic() - started
    windows = read_windows(metrics_file(output_dir))
    trained = [w for w in windows if w.get("batch/samples_per_step") is not None]

    def total(key: str) -> float:
        return sum(w.get(key) or 0.0 for w in trained)

    seconds = trainer.step_ends[-1] - trainer.loop_started
    tokens = total("batch/trained_tokens_per_step")
    shares = {name: total(key) / seconds for name, key in REPRORL_SHARES}
    shares["other"] = 1.0 - sum(shares.values())
    concurrency = [w["rollout/concurrency"] for w in windows
                   if w.get("rollout/concurrency") is not None]
    return {"arm": "reprorl", "steps": result.global_step, "seconds": seconds,
            "samples": int(total("batch/samples_per_step")), "tokens": int(tokens),
            "tokens_per_s": tokens / seconds,
            "steady_tokens_per_s": steady([w["batch/trained_tokens_per_step"] for w in trained],
                                          trainer.step_ends),
            "signal_tokens_per_s": tokens / seconds,
            "train_call_s": wall, "step_s_sum": total("perf/step_s"),
            "first_step_wait_s": trained[0].get("perf/rollout_wait_s"),
            "empty_blocks": trainer.run.version.value - result.global_step,
            "rollouts_in_flight": sum(concurrency) / len(concurrency) if concurrency else None,
            "shares": shares, "server": server_shares(*trainer.engine_work)}


def engine_work(base_url: str) -> dict:
    """The embedded server's `reprorl:engine_*` counters (its /metrics), and when read."""
    import requests

    text = requests.get(f"{base_url}/metrics", timeout=30).text
    work = {name: float(value) for name, value in
            re.findall(r"^reprorl:engine_(\w+)_total\{[^}]*\} (\S+)$", text, re.M)}
    return {**work, "at": time.monotonic()}


def server_shares(before: dict, after: dict) -> dict:
    """What the server's engine thread did between two readings: its busy share of that time,
    split into decode and prefill, and what its decode forwards carried."""
    delta = {key: after[key] - before[key] for key in before}
    forwards = max(1.0, delta["decode_forwards"])
    return {"busy": delta["busy_seconds"] / delta["at"],
            "decode": delta["decode_seconds"] / delta["at"],
            "prefill": delta["prefill_seconds"] / delta["at"],
            "rows_per_decode_forward": delta["decode_rows"] / forwards,
            "slots_per_decode_forward": delta["decode_slots"] / forwards,
            "adapters_per_decode_forward": delta["decode_adapters"] / forwards}


# ---------------------------------------------------------------------------------- TRL


class CountingReward:
    """The shared reward, counting the completion tokens TRL trains (all it sampled) and
    those of groups with unequal rewards (what reprorl would keep)."""

    __name__ = "rubric_verifier"

    def __init__(self, reward, group: int):
        self.reward, self.group = reward, group
        self.tokens, self.signal_tokens, self.samples, self.per_call = 0, 0, 0, []

    def __call__(self, completion_ids, **kwargs):
        rewards = self.reward(completion_ids=completion_ids, **kwargs)
        lengths = [len(ids) for ids in completion_ids]
        self.tokens += sum(lengths)
        self.per_call.append(sum(lengths))
        self.samples += len(lengths)
        for start in range(0, len(rewards), self.group):  # a prompt's completions lie together
            if len(set(rewards[start:start + self.group])) > 1:
                self.signal_tokens += sum(lengths[start:start + self.group])
        return rewards


def trl_model(config: dict):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(config["model"]["path"], dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(layout.peft("sft")), is_trainable=True)


def trl_arm(config: dict, rows: list[dict], steps: int, workdir: Path, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self):
            self.first, self.ends = None, []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first is None:
                self.first = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.monotonic())

    class TimedGRPOTrainer(GRPOTrainer):
        """Adds up the seconds spent in transformers' generate()."""

        generate_s = 0.0

        def _generate_single_turn(self, *args, **kwargs):
            started = time.monotonic()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.generate_s += time.monotonic() - started

    torch.set_num_threads(threads)
    grpo = config["grpo"]
    tokenizer = load_tokenizer(config["model"]["path"])
    group = grpo["num_generations"]
    args = GRPOConfig(
        output_dir=str(workdir / "trl"), max_steps=steps, num_generations=group,
        per_device_train_batch_size=grpo["groups_per_step"] * group,
        max_completion_length=config["limits"]["response_tokens"],
        learning_rate=grpo["learning_rate"], lr_scheduler_type="constant",
        max_grad_norm=grpo["max_grad_norm"], weight_decay=grpo["weight_decay"],
        temperature=grpo["temperature"], seed=grpo["seed"], shuffle_dataset=False,
        bf16=False, gradient_checkpointing=False, use_cpu=True, save_strategy="no",
        report_to="none", disable_tqdm=True)
    reward = CountingReward(RubricVerifier(tokenizer.eos_token_id), group)
    clock = StepClock()
    trainer = TimedGRPOTrainer(model=trl_model(config), reward_funcs=reward, args=args,
                               train_dataset=Dataset.from_list(rows),
                               processing_class=tokenizer, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # its log dicts would bury the table
    started = time.monotonic()
    trainer.train()
    wall = time.monotonic() - started
    seconds = clock.ends[-1] - clock.first
    zero_std = [h["frac_reward_zero_std"] for h in trainer.state.log_history
                if "frac_reward_zero_std" in h]
    return {"arm": "trl", "steps": trainer.state.global_step, "seconds": seconds,
            "samples": reward.samples, "tokens": reward.tokens,
            "tokens_per_s": reward.tokens / seconds,
            "steady_tokens_per_s": steady(reward.per_call, clock.ends),
            "signal_tokens_per_s": reward.signal_tokens / seconds, "train_call_s": wall,
            "frac_reward_zero_std": sum(zero_std) / len(zero_std) if zero_std else None,
            "shares": {"generate": trainer.generate_s / seconds,
                       "other": 1.0 - trainer.generate_s / seconds}}


# ------------------------------------------------------------------------------ checks


def check_same_policy(config: dict, rows: list[dict]) -> float:
    """Both arms' starting policies on one prompt: the largest logit difference."""
    import torch

    tokenizer = load_tokenizer(config["model"]["path"])
    ids = tokenizer.apply_chat_template([rows[0]["prompt"]], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    ids = torch.tensor(ids)
    ours, _ = exports.load_final("sft", "actor", config)
    theirs = trl_model(config)
    with torch.no_grad():
        a = ours.backbone.eval()(input_ids=ids).logits
        b = theirs.eval()(input_ids=ids).logits
    return float((a - b).abs().max())


def row(result: dict) -> str:
    shares = " ".join(f"{k} {v:.0%}" for k, v in result["shares"].items())
    return (f"{result['arm']:8}{result['steps']:>6}{result['samples']:>8.0f}"
            f"{result['tokens']:>8.0f}{result['seconds']:>9.1f}{result['tokens_per_s']:>9.1f}"
            f"{result['signal_tokens_per_s']:>9.1f}{shown(result['steady_tokens_per_s'])}"
            f"{result['train_call_s']:>9.1f}  {shares}")


def shown(value: float | None) -> str:
    return f"{'n/a' if value is None else f'{value:.1f}':>9}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/default.yaml"))
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per arm")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times to run the pair TRL, reprorl (alternating)")
    parser.add_argument("--trl-threads", type=int, default=None,
                        help="torch threads of TRL's single process (default: torch's own "
                             "default, one per core, as TRL runs when nobody sets it)")
    parser.add_argument("--trainer-threads", type=int, default=1,
                        help="torch threads of reprorl's trainer (its embedded server has 1)")
    args = parser.parse_args()
    trl_version = require_trl()
    if args.trl_threads is None:  # read before an arm sets it: the arms share this process
        import torch

        args.trl_threads = torch.get_num_threads()
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" at every model load
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated",
                            category=FutureWarning)
    config = configuration.load(args.config)
    ensure_sft(args.config)
    rows = ordered_rows(config)
    drift = check_same_policy(config, rows)
    print(f"TRL {trl_version}; same starting policy: max |logit difference| {drift:.2e}",
          flush=True)
    if drift > 1e-3:
        sys.exit("the two arms' starting policies differ: is sft-peft the SFT actor's export?")
    workdir = Path(tempfile.mkdtemp(prefix="peer-trl-"))
    results = []
    try:
        for round_ in range(args.rounds):
            for name, run in (("trl", trl_arm), ("reprorl", reprorl_arm)):
                threads = args.trl_threads if name == "trl" else args.trainer_threads
                result = run(config, rows, args.steps, workdir, threads)
                result["round"] = round_ + 1
                results.append(result)
                print(f"round {round_ + 1} {name}: {result['tokens_per_s']:.1f} trained "
                      f"tokens/s over {result['seconds']:.1f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{'arm':8}{'steps':>6}{'samples':>8}{'tokens':>8}{'loop s':>9}{'tok/s':>9}"
          f"{'signal/s':>9}{'steady/s':>9}{'train()s':>9}  share of the loop's time")
    for result in results:
        print(row(result))

    def rate(arm: str, key: str = "tokens") -> float:
        mine = [r for r in results if r["arm"] == arm]
        if key == "signal":
            return sum(r["signal_tokens_per_s"] * r["seconds"] for r in mine) / sum(
                r["seconds"] for r in mine)
        return sum(r[key] for r in mine) / sum(r["seconds"] for r in mine)

    ours, theirs = rate("reprorl"), rate("trl")
    per_round = [round(a["tokens_per_s"] / b["tokens_per_s"], 3)
                 for b, a in zip(results[::2], results[1::2])]
    print(f"\ntrained tokens/s, all rounds: reprorl {ours:.1f}, TRL {theirs:.1f}, ratio "
          f"{ours / theirs:.2f}x (per round: {', '.join(f'{r:.2f}x' for r in per_round)}); "
          f"on TRL's tokens with signal {rate('trl', 'signal'):.1f}: "
          f"{ours / rate('trl', 'signal'):.2f}x")
    steady_rates = {}
    for arm in ("reprorl", "trl"):
        values = [r["steady_tokens_per_s"] for r in results
                  if r["arm"] == arm and r["steady_tokens_per_s"] is not None]
        steady_rates[arm] = sum(values) / len(values) if values else None
    if None not in steady_rates.values():
        print(f"from the end of step 1 (mean of the rounds): reprorl {steady_rates['reprorl']:.1f}"
              f", TRL {steady_rates['trl']:.1f}, ratio "
              f"{steady_rates['reprorl'] / steady_rates['trl']:.2f}x")
    reprorl_runs = [r for r in results if r["arm"] == "reprorl"]
    share = {k: sum(r["shares"][k] * r["seconds"] for r in reprorl_runs)
             / sum(r["seconds"] for r in reprorl_runs) for k in reprorl_runs[0]["shares"]}
    print("reprorl's loop time: " + ", ".join(f"{k} {v:.1%}" for k, v in share.items())
          + " (rollout wait: the trainer idle on the worker and the embedded server)")
    server = {k: sum(r["server"][k] for r in reprorl_runs) / len(reprorl_runs)
              for k in reprorl_runs[0]["server"]}
    print(f"reprorl's embedded server (mean of the rounds): its engine thread busy "
          f"{server['busy']:.1%} of the loop (decode {server['decode']:.1%}, prefill "
          f"{server['prefill']:.1%}); a decode forward carried "
          f"{server['rows_per_decode_forward']:.1f} sequences in "
          f"{server['slots_per_decode_forward']:.1f} rows and "
          f"{server['adapters_per_decode_forward']:.2f} adapters (weight versions in flight)")
    summary = {"reprorl_tokens_per_s": round(ours, 2), "trl_tokens_per_s": round(theirs, 2),
               "ratio": round(ours / theirs, 3), "ratio_per_round": per_round,
               "trl_signal_tokens_per_s": round(rate("trl", "signal"), 2),
               "steady_tokens_per_s": {k: v and round(v, 2) for k, v in steady_rates.items()},
               "reprorl_time_shares": {k: round(v, 3) for k, v in share.items()},
               "reprorl_server": {k: round(v, 3) for k, v in server.items()},
               "steps": args.steps, "rounds": args.rounds, "trl_version": trl_version,
               "trl_threads": args.trl_threads, "reprorl_trainer_threads": args.trainer_threads,
               "runs": [{k: round(v, 3) if isinstance(v, float) else v
                         for k, v in r.items() if k not in ("shares", "server")} for r in results]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
