"""GRPO runs of the pipeline: the async engine (`reprorl.grpo`) on the 672 rollout prompts.

Both runs start from the SFT actor (its adapters keep training) and differ only in the reward:
- `grpo_verifier`: the rubric as an exact verifier, 1.0 for a rubric success else 0.0. It reads
  the situation behind each rollout prompt (`labels/rollouts.json`, train families only),
  through the `verifier` corpus scope: this run learns from the task's true criterion;
- `grpo_learned`: the frozen Bradley-Terry reward model's score ("predicted simulated
  preference"), minus `cut_penalty` for a response cut without EOS, as in PPO.
The embedded generation server samples; the trainer and the worker run beside it. On the
fixed schedule (`grpo.schedule_lag`, default 3) with the batch-invariant server a run's bytes
do not depend on timing, so each run is a resumable branch like SFT's: `interrupt` stops after
`interrupt_step` optimizer steps, `resume` finishes it in a fresh process and exports the
policy, `continuous` runs straight through (checkpointing each quarter of its planned steps,
whose adapters it keeps for the over-optimisation curve, `snapshots.py`). A state is the
engine's final checkpoint, decoded, its files as bytes, and every metrics window's keys that do
not depend on timing (`metrics.reproducible`); timings go to `logs/<stage>-metrics.jsonl`.
The in-rule checkpoints a killed job continues from are the same states, taken at the ends of
metrics windows (`InRuleCheckpoints`).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import torch

from reprorl.core import layout
from reprorl.core.codehash import code_hash
from reprorl.core.errors import ReproError
from reprorl.core.manifest import (
    atomic_directory,
    atomic_write_bytes,
    cpu_seconds,
    gpu_memory,
    peak_rss_mb,
)
from reprorl.core.preempt import SIGNALS
from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer, checkpoints
from reprorl.grpo.callbacks import planned_steps, report_names
from reprorl.grpo.distributed import ranks_from_env
from reprorl.grpo.identity import LOGGING
from reprorl.grpo.metrics import metrics_file, read_windows, reproducible
from reprorl.model import lora, roles
from reprorl.model.encoding import Example, collate, load_tokenizer, prompt_ids

from . import corpus, snapshots
from .exports import load_final, verified_final
from .resumable import Branch
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
    """The frozen reward model's score of (prompt, completion), loaded once in the worker, on
    the CPU whatever model.device says: the rollout worker sees no GPU (the seed's rule)."""

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
            model = {**self.config["model"], "device": "cpu"}
            self.role, _ = load_final("reward", "reward", {**self.config, "model": model})
            self.tokenizer = load_tokenizer(self.config["model"]["path"])
        eos, limits = self.tokenizer.eos_token_id, self.config["limits"]
        examples = [Example(str(i), tuple(prompt_ids(self.tokenizer, p[-1]["content"], limits)),
                            tuple(ids)) for i, (p, ids) in enumerate(zip(prompts, completion_ids))]
        scores = self.role.score(collate(examples, self.tokenizer.pad_token_id))
        return [float(s) - (0.0 if ids[-1] == eos else self.cut_penalty)
                for s, ids in zip(scores, completion_ids)]


PIPELINE_KEYS = ("cut_penalty", "vllm_server_base_url", "nproc_per_node")  # not the engine's


def engine_settings(config: dict) -> dict:
    """The profile's `grpo` keys that are AsyncGRPOConfig fields."""
    return {k: v for k, v in config["grpo"].items() if k not in PIPELINE_KEYS}


def dataset(run: str) -> list[dict]:
    pages = corpus.rollout_prompts()
    rows = [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "document_id": p["document_id"]} for p in pages]
    if run == "verifier":
        labels = {r["document_id"]: r["expected_action"]
                  for r in corpus.read(corpus.ROLLOUT_LABELS, "verifier")}
        if set(labels) != {r["document_id"] for r in rows}:
            raise ReproError(f"{corpus.ROLLOUT_LABELS} does not label exactly the rollout prompts")
        for row in rows:
            row["expected_action"] = labels[row["document_id"]]
    return rows


def interrupt_step(args: AsyncGRPOConfig, rows: int) -> int:
    """Where `interrupt` stops: half the run's steps, rounded down to whole metrics windows so
    the resumed run's windows are the continuous run's; one window at least."""
    window = args.steps_of("logging_steps")
    return max(window, planned_steps(args, rows) // 2 // window * window)


def history(metrics: Path, skip: int = 0) -> list[dict]:
    """The training windows of an engine's metrics.jsonl after its first `skip` records,
    reproducible keys only."""
    return [{k: v for k, v in record.items() if reproducible(k)}
            for record in read_windows(metrics)[skip:] if record.get("loss") is not None]


def as_tensor(data: bytes) -> torch.Tensor:
    """A file's bytes as a uint8 tensor (frombuffer refuses an empty buffer)."""
    return torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)[: len(data)]


def engine_state(identity: dict, checkpoint: Path, windows: list[dict]) -> dict:
    """A branch state (as `resumable` compares it) from the engine's checkpoint folder."""
    from safetensors.torch import load_file

    saved = checkpoints.trainer_state(checkpoint)
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    return {
        "identity": identity,
        "learned": {"actor": load_file(checkpoint / checkpoints.policy_folder(use_peft=True)
                                       / lora.PEFT_WEIGHTS)},
        "optimizers": {"actor": saved["optimizer"]},
        "rng": {"torch": saved["torch_rng"],
                **({"cuda": saved["cuda_rng"]} if "cuda_rng" in saved else {})},
        "updates": saved["global_step"],
        "progress": {"rollout_state": checkpoints.rollout_state(checkpoint),
                     "num_tokens": saved["num_tokens"], "loss_sum": saved["loss_sum"],
                     "history": windows},
        "checkpoint": {str(p.relative_to(checkpoint)): as_tensor(p.read_bytes()) for p in files},
    }


def restore_checkpoint(state: dict, output_dir: Path) -> Path:
    """The interrupt's checkpoint folder, written back byte for byte under `output_dir`."""
    checkpoint = checkpoints.directory(output_dir, state["updates"])
    for name, data in state["checkpoint"].items():
        atomic_write_bytes(checkpoint / name, data.numpy().tobytes())
    return checkpoint


class InRuleCheckpoints:
    """A GRPO run's in-rule checkpoints (`core/preempt.py`), taken at its metrics windows'
    ends (a window split by a restart would log other means): the engine's checkpoint as a
    branch state, with the curve's snapshot adapters and the metrics log beside it."""

    def __init__(self, preempt, identity: dict, output_dir: Path, keep_every: int | None):
        self.preempt, self.identity, self.output_dir = preempt, identity, output_dir
        self.keep_every = keep_every  # a straight run's snapshot steps (None: it keeps none)
        self.kept, self.log = preempt.folder / "kept", preempt.folder / "metrics.jsonl"
        self.windows: list[dict] = []  # those of the state the run starts from
        self.skip = 0  # the metrics log's records from before this attempt
        self.trainer = None

    def start(self, saved: dict | None, continued: bool) -> Path | None:
        """Start from `saved` (None: the start), `continued` if it is this job's own
        checkpoint: the engine checkpoint restored, the earlier attempts' metrics log put
        back (up to the checkpoint's step); returns the checkpoint to resume from."""
        step = saved["updates"] if saved else 0
        self.preempt.start(step)
        if saved is None:
            return None
        self.windows = saved["progress"]["history"]
        if continued and self.log.exists():  # its lines as the trainer wrote them
            lines = [line for line in self.log.read_text().splitlines(keepends=True)
                     if json.loads(line)["step"] <= step]
            atomic_write_bytes(metrics_file(self.output_dir), "".join(lines).encode())
            self.skip = len(lines)
        return restore_checkpoint(saved, self.output_dir)

    def safe_point(self, step: int, window_end: bool) -> None:
        """The trainer's hook after each optimizer step."""
        if self.keep_every and step % self.keep_every == 0:  # it saved a curve point
            self.keep(checkpoints.directory(self.output_dir, step))
        self.preempt.reached(step, self.state, safe=window_end)

    def keep(self, checkpoint: Path) -> None:
        """A curve point's adapters into the scratch (a rerun continues past it), replacing
        those of a killed attempt that reached the point after its last checkpoint."""
        target = self.kept / snapshots.snapshot_name(checkpoints.step_of(checkpoint))
        shutil.rmtree(target, ignore_errors=True)
        with atomic_directory(target) as folder:
            shutil.copytree(checkpoint / checkpoints.policy_folder(use_peft=True), folder,
                            dirs_exist_ok=True)

    def windows_now(self) -> list[dict]:
        return self.windows + history(metrics_file(self.output_dir), self.skip)

    def state(self) -> dict:
        """The run now, a branch state; its metrics log copied beside it."""
        engine = self.preempt.folder / "engine"
        shutil.rmtree(engine, ignore_errors=True)
        checkpoint = self.trainer.save_checkpoint_into(engine)
        state = engine_state(self.identity, checkpoint, self.windows_now())
        shutil.rmtree(engine)
        metrics = metrics_file(self.output_dir)
        atomic_write_bytes(self.log, metrics.read_bytes() if metrics.is_file() else b"")
        return state


def train(config: dict, run: str, mode: str, checkpoint_every=None, log=print) -> dict | None:
    """The run's `mode`; under torchrun, rank 0 alone reads and writes the stage's files (the
    other ranks train beside it, then return None)."""
    settings, limits = engine_settings(config), config["limits"]
    cut_penalty, server_url, nproc = (config["grpo"][k] for k in PIPELINE_KEYS)
    branch = f"grpo_{run}"
    stage_name = f"{branch}_{mode}"
    branch_run = Branch(branch, mode)
    output_dir = layout.grpo_output_dir(branch, mode)
    tokenizer = load_tokenizer(config["model"]["path"])
    rows = dataset(run)
    reward = (RubricVerifier(tokenizer.eos_token_id) if run == "verifier"
              else LearnedReward(config, cut_penalty))
    # the worker loads the reward model; checked here so a bad file fails first
    reward_sha256 = verified_final("reward")[1]["sha256"] if run == "learned" else None
    actor, sft_meta = load_final("sft", "actor", config)
    initial = roles.learned_identity(actor)
    if server_url is not None:
        settings["vllm_server_base_url"] = server_url
    if report_names(settings.get("report_to")):  # its logs outside output_dir
        settings.update(run_name=stage_name, project="reprorl",
                        logging_dir=str(layout.tensorboard_dir(stage_name)))
    args = AsyncGRPOConfig(
        output_dir=str(output_dir), embedded_server=server_url is None,
        dtype=config["model"]["dtype"], embedded_server_device=config["model"]["device"],
        embedded_server_max_model_len=limits["context_tokens"],
        max_completion_length=limits["response_tokens"], disable_tqdm=False, **settings)
    # the ranks join their process group here, with the profile's backend and timeout (the
    # trainer's own call then finds the group joined)
    ranks = ranks_from_env(args.ddp_backend, args.ddp_timeout, actor.device)
    if ranks.world_size != nproc:
        raise ReproError(f"{stage_name} runs {ranks.world_size} trainer rank(s) but "
                         f"grpo.nproc_per_node is {nproc}: launch it as its rule does (torchrun "
                         f"--nproc-per-node {nproc}), or set grpo.nproc_per_node")
    if ranks.main:
        branch_run.refuse_to_overwrite()  # inputs are sound: checkpoints kept
        shutil.rmtree(output_dir, ignore_errors=True)  # inputs are sound: a re-run starts afresh
    stop, planned = interrupt_step(args, len(rows)), planned_steps(args, len(rows))
    if branch_run.keeps_snapshots:  # a checkpoint at each curve point: its adapter is kept
        args.save_steps = snapshots.every(planned)
        args.save_total_limit = None
    trained = {k: v for k, v in settings.items() if k not in LOGGING}  # logs change no bit
    identity = {"run": run, "sft_sha256": sft_meta["sha256"], "grpo": trained,
                "cut_penalty": cut_penalty,
                "reward_sha256": reward_sha256, "code_sha256": code_hash(f"{branch}_continuous"),
                "initial_learned": initial}
    if nproc > 1:  # one rank's identity stays as it was before ranks existed
        identity["nproc_per_node"] = nproc
    if config["model"]["device"] != "cpu":  # likewise a CPU run's; bits depend on the device
        identity["device"] = config["model"]["device"]
    resume_from = in_rule = None
    if ranks.main:  # rank 0 decides when the run stops: the other ranks ignore signals
        in_rule = InRuleCheckpoints(branch_run.checkpoints(identity, checkpoint_every),
                                    identity, output_dir,
                                    args.save_steps if branch_run.keeps_snapshots else None)
        # a resume reads its interrupt state either way: the stage's input, which the
        # manifest names, and which a checkpoint of this job descends from
        start = branch_run.interrupt_state(identity) if branch_run.resumes else None
        latest = in_rule.preempt.latest()
        resume_from = in_rule.start(latest or start, continued=latest is not None)
    else:
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    resume_from = ranks.share(resume_from)  # the others read it once rank 0 has written it
    # the rule's cores are shared: the embedded server takes its threads, the trainer the rest
    # but at least one (benchmarks/grpo_async.py: a trainer with 2 threads beside the server is
    # slower, 0.92x); the pipeline's one-thread rules thus run a 1-thread trainer beside a
    # 1-thread server and the worker, which take turns more than they overlap
    if args.embedded_server:
        torch.set_num_threads(max(1, torch.get_num_threads() - args.embedded_server_threads))
    trainer = AsyncGRPOTrainer(actor.backbone, reward, args, rows, tokenizer, log=log)
    started = time.perf_counter()
    if in_rule is not None:
        in_rule.trainer = trainer
    result = trainer.train(resume_from_checkpoint=resume_from,
                           interrupt_after_step=branch_run.stop(stop, None),
                           safe_point=in_rule and in_rule.safe_point)
    seconds = time.perf_counter() - started
    # every rank's cost, gathered before the others leave, so the manifest counts them all
    rank_costs = ranks.gather(own_costs())
    if not ranks.main:
        return None
    reached = result.global_step == stop  # fewer: the run ended first (empty blocks)
    if mode == "interrupt" and not reached:
        log(f"warning: {branch} ended after {result.global_step} of the {stop} steps before "
            "its interrupt: the interrupt state is the run's end, the resume has nothing to do")
    if mode != "resume" and result.global_step and roles.learned_identity(actor) == initial:
        raise ReproError(f"GRPO ({run}) took {result.global_step} steps but left the actor "
                         "unchanged")
    metrics, windows = metrics_file(output_dir), in_rule.windows_now()
    final = engine_state(identity, checkpoints.directory(output_dir, result.global_step),
                         windows)
    # a signal after the last window's end: the final state is this job's last checkpoint
    in_rule.preempt.stop_if_asked(result.global_step, lambda: final)
    storage = branch_run.save(final)
    in_rule.preempt.keep(layout.state(*branch_run))  # a job whose end is lost reruns from it
    atomic_write_bytes(layout.metrics_log(stage_name),
                       metrics.read_bytes() if metrics.is_file() else b"")
    branch_run.export(identity, config, {branch: actor})
    if branch_run.keeps_snapshots:  # the curve points, and the end if the run ended early
        for checkpoint in checkpoints.found(output_dir):
            step = checkpoints.step_of(checkpoint)
            if step % args.save_steps == 0 or step == result.global_step:
                in_rule.keep(checkpoint)
        with atomic_directory(layout.snapshots(branch)) as folder:
            snapshots.write_plan(folder, planned)
            # copied, not moved: a rerun from the final checkpoint needs them
            shutil.copytree(in_rule.kept, folder, dirs_exist_ok=True)
    shutil.rmtree(output_dir, ignore_errors=True)  # its final checkpoint is in the state
    keys = ("reward", "reward_kept", "frac_reward_zero_std", "entropy",
            "sample/staleness_mean", "sample/dropped_stale_count", "completions/mean_length",
            "sampling/importance_sampling_ratio/mean", "sampling/masked_mean")

    def mean_of(part: list[dict]) -> dict:
        out = {}
        for key in keys:
            values = [r[key] for r in part if r.get(key) is not None]
            out[key] = sum(values) / len(values) if values else None
        return out

    tenth = max(2, len(windows) // 10)  # first and last tenth of the windows, two at least
    report = {
        "run": run, "mode": mode, "reward_function": type(reward).__name__,
        "steps": result.global_step, "interrupt_step": stop, "train_loss": result.training_loss,
        # interrupt mode: False when the run ended before that step (empty blocks train
        # nothing), and then the resume check compares two runs that were never apart;
        # null in the other modes, which do not stop there
        "reached_interrupt_step": reached if mode == "interrupt" else None,
        "first_windows": mean_of(windows[:tenth]), "last_windows": mean_of(windows[-tenth:]),
        "windows": len(windows), "history": windows, "settings": trained,
        "checkpoint": storage,
        "note": "sampled at temperature 1 during training; on the fixed schedule the run "
                "replays bit for bit (timings, in logs/ and the manifest, excepted)",
    }
    # costs vary run to run: they go to the manifest's run section, not into this file
    branch_run.report(report)
    return {**report, "seconds": seconds, "other_ranks": rank_costs[1:],
            "in_rule_checkpoints": in_rule.preempt.finish()}


def own_costs() -> dict:
    """This process's CPU seconds and peak memory so far, rounded as a manifest's."""
    return {"cpu_seconds": round(cpu_seconds(), 3), "peak_rss_mb": round(peak_rss_mb(), 1),
            **gpu_memory()}


def stage(name: str, config: dict, run, log=print) -> dict:
    run_name, mode = name.removeprefix("grpo_").rsplit("_", 1)
    summary = train(config, run_name, mode, run.checkpoint_every, log)
    if summary is None:  # a torchrun rank other than 0: rank 0 writes the manifest
        run.leave_to_another_process()
        return {"rank": ranks_from_env().rank}
    costs = {"seconds": summary["seconds"], "peak_rss_mb": peak_rss_mb(),
             "in_rule_checkpoints": summary["in_rule_checkpoints"]}
    if summary["other_ranks"]:  # torchrun: this process is rank 0 (its costs as of now)
        ranks = [own_costs(), *summary["other_ranks"]]
        costs.update(ranks=ranks, cpu_seconds=round(sum(r["cpu_seconds"] for r in ranks), 3))
    run.finish(
        summary={k: summary[k] for k in ("run", "mode", "steps", "first_windows",
                                         "last_windows")},
        run_info=costs)
    return {k: summary[k] for k in ("run", "mode", "steps", "seconds", "last_windows")}
