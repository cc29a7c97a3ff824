"""The async GRPO engine end to end, with real processes: the trainer (this process), the
spawned rollout worker and the embedded generation server (`python -m reprorl.serve.server`).

Nothing stands in for the server or the worker. Reward functions, rollout-loop and config
subclasses are defined at module level because the worker is a spawned process that imports
them from this module. Each run is a few optimizer steps on the tiny model of `conftest.py`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch

from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop
from reprorl.grpo.metrics import reproducible
from reprorl.grpo.rows import epoch_order
from reprorl.model import lora

# Two rows of 100 tokens: a group (46 prompt tokens, 4 completions of 8 at most) fills most of
# a row, so a free-running step trains two groups or a few more; a fixed one, two groups.
BASE = {"embedded_server": True, "embedded_server_max_model_len": 128,
        "max_completion_length": 8, "num_generations": 4, "per_device_train_batch_size": 2,
        "token_budget": 100, "groups_per_step": 2, "learning_rate": 1e-3, "logging_steps": 1,
        "disable_tqdm": True, "vllm_server_timeout": 60.0, "rollout_worker_timeout": 60.0}
SEED_METRICS = (
    "reward", "reward_kept", "frac_reward_zero_std", "completions/mean_length",
    "completions/clipped_ratio", "completions/duplicate_frac",
    "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean",
    "sampling/masked_mean", "sampling/sampler_mass", "entropy", "clip_ratio/region_mean",
    "rollout/duration_s", "rollout/generated_tokens_per_s", "sample/staleness_mean",
    "sample/time_in_queue_s", "batch/samples_per_step", "perf/step_s", "perf/weight_sync_s",
    "rollout/vllm_retry_count", "rollout/queue_size", "rollout/concurrency",
    "rollout/concurrency_cap", "rollout/samples_per_rollout", "rollout/score_s",
    "reward_group_std", "rewards/token_sum_reward/mean", "completions/min_length",
    "completions/max_length", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/max",
    "clip_ratio/low_mean", "clip_ratio/high_max", "sample/staleness_max",
    "sample/dropped_stale_count", "batch/row_imbalance", "batch/trained_tokens_per_step",
    "batch/dropped_oversize_count", "perf/fwd_bwd_s", "perf/optimizer_s",
    "perf/rollout_wait_s", "perf/weight_sync_transfer_s")


# ---------------------------------------------------------------- rewards (module level)


def token_sum_reward(completion_ids, **kwargs):
    """Deterministic and varied within a group, so groups are rarely zero-std."""
    return [float(sum(ids) % 13) for ids in completion_ids]


async def first_token_reward(completion_ids, **kwargs):
    return [float(ids[0] % 3) if ids else 0.0 for ids in completion_ids]


class ParityReward:
    """A callable instance (named after its type) that scores only rows with a `parity`."""

    def __call__(self, completion_ids, parity, **kwargs):
        return [None if p is None else float(sum(ids) % 2 == (p == "odd"))
                for ids, p in zip(completion_ids, parity)]


def bad_reward(completions, **kwargs):
    raise ValueError("no score for this completion")


def constant_reward(completions, **kwargs):
    """The same value for every completion: no group ever has signal."""
    return [1.0] * len(completions)


def delayed_token_sum_reward(completion_ids, **kwargs):
    """token_sum_reward after a truly random pause: timing noise, the same values."""
    time.sleep(random.SystemRandom().uniform(0, 0.05))
    return token_sum_reward(completion_ids)


def flat_first_rows_reward(completion_ids, flat, **kwargs):
    """The same value for every completion of a `flat` row (its group drops), else
    token_sum_reward."""
    return [1.0 if f else v for f, v in zip(flat, token_sum_reward(completion_ids))]


def hung_reward(completions, **kwargs):
    time.sleep(60)
    return [0.0] * len(completions)


# ---------------------------------------------------------------- loops and configs


@dataclass
class RecordingConfig(AsyncGRPOConfig):
    record_path: str = ""  # where RecordingLoop appends the positions it is offered


class RecordingLoop(AsyncRolloutLoop):
    """Writes every position `filter_prompt` is offered (epoch * rows + index in the epoch's
    seeded order) and rejects the third prompt of every epoch.

    Why the third: the worker starts the second group only after the first has finished (the
    allowance's rule while no group size is known), and offers the next position in the same
    turn of its event loop as it starts a group, so the third position's "filtered" marker is
    always queued after the first group and before the second: the order never depends on
    timing."""

    def filter_prompt(self, row_index, row, epoch):
        rows = len(self.dataset)
        index = epoch_order(self.config.data_order_seed, epoch, rows).index(row_index)
        with open(self.config.record_path, "a") as handle:
            handle.write(f"{epoch * rows + index}\n")
        return index != 2


class FailingLoop(AsyncRolloutLoop):
    """One group of rollouts succeeds, then generate_one raises."""

    calls = 0

    async def generate_one(self, prompt, tools, group_id=0):
        self.calls += 1
        if self.calls > self.config.num_generations:
            raise RuntimeError("boom in worker")
        return await super().generate_one(prompt, tools, group_id)


class RejectAllLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return False


# ---------------------------------------------------------------- helpers


def make_args(tmp_path: Path, name: str, cls=AsyncGRPOConfig, **overrides):
    return cls(output_dir=str(tmp_path / name), **{**BASE, **overrides})


def make_rows(count: int, **columns) -> list[dict]:
    rows = [{"prompt": [{"role": "user", "content": f"question {i}"}]} for i in range(count)]
    for key, values in columns.items():
        for row, value in zip(rows, values):
            row[key] = value
    return rows


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def total(lines: list[dict], name: str) -> float:
    return sum(line.get(name) or 0 for line in lines)


def assert_stopped(output_dir: Path, trainer) -> None:
    """After train() returned or raised, neither child process is left running."""
    assert trainer.worker is None and trainer.server is None
    port = int((output_dir / "server.port").read_text())
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)


def checkpoint_bytes(checkpoint: Path) -> dict[str, bytes]:
    return {str(p.relative_to(checkpoint)): p.read_bytes()
            for p in sorted(checkpoint.rglob("*")) if p.is_file()}


def reproducible_windows(lines: list[dict]) -> list[dict]:
    """The training windows, less what timing decides (`metrics.reproducible`)."""
    return [{k: v for k, v in line.items() if reproducible(k)} for line in lines
            if "loss" in line]


def adapter_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in lora.peft_state(trainer.model).items()}


def server_log_text(log) -> str:
    """What a server started by `start_server` has logged so far."""
    log.flush()
    return Path(log.name).read_text()


def start_server(model: Path, directory: Path, *flags: str):
    """A real embedded server in its own process (the test owns it), and its URL."""
    directory.mkdir(parents=True, exist_ok=True)
    port_file, log_path = directory / "port", directory / "server.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "reprorl.serve.server", "--model", str(model), "--port", "0",
         "--port-file", str(port_file), "--max-model-len", "128", *flags],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            log.close()
            raise AssertionError(log_path.read_text())
        time.sleep(0.1)
    return process, log, f"http://127.0.0.1:{int(port_file.read_text())}"


# ---------------------------------------------------------------- 1. end to end


@pytest.fixture(scope="module")
def e2e(tiny_model, tmp_path_factory):
    """One short run shared by the end-to-end tests: a sync, an async and a partial reward,
    temperature 0.7, max_staleness 1 (two live adapter versions)."""
    tmp = tmp_path_factory.mktemp("grpo_e2e")
    args = make_args(tmp, "out", max_steps=3, save_steps=2, max_staleness=1, temperature=0.7)
    rows = make_rows(4, parity=["odd", None, "even", None])
    messages: list[str] = []
    trainer = AsyncGRPOTrainer(model=str(tiny_model),
                               reward_funcs=[token_sum_reward, first_token_reward,
                                             ParityReward()],
                               args=args, train_dataset=rows, log=messages.append)
    before = adapter_state(trainer)
    started = time.monotonic()
    result = trainer.train()
    return {"trainer": trainer, "result": result, "before": before, "out": Path(args.output_dir),
            "lines": read_metrics(Path(args.output_dir)), "messages": messages,
            "seconds": time.monotonic() - started}


@pytest.mark.timeout(120)
def test_run_completes_with_the_seed_metrics(e2e):
    assert e2e["result"].global_step == 3
    assert math.isfinite(e2e["result"].training_loss)
    lines = e2e["lines"]
    assert [line["step"] for line in lines if "perf/step_s" in line] == [1, 2, 3]
    present = set().union(*lines)
    missing = [name for name in SEED_METRICS if name not in present]
    assert not missing, f"metrics.jsonl lacks {missing}"
    steps = [line for line in lines if "perf/step_s" in line]
    assert all(line["batch/samples_per_step"] >= 8 for line in steps)  # a group in each row
    for line in steps:  # the rows as forwarded: a group's prompt once, never padded
        assert line["batch/packing_ratio"] > 1.5 and line["batch/pad_frac"] == 0
        assert line["batch/row_tokens_max"] <= 100 and line["batch/row_fill_frac"] <= 1
    assert all(0 < line["sampling/sampler_mass"] <= 1 + 1e-4 for line in steps)
    assert total(lines, "rollout/vllm_retry_count") == 0  # the server never failed a request
    assert any(m.startswith("step 3:") for m in e2e["messages"])
    assert_stopped(e2e["out"], e2e["trainer"])


@pytest.mark.timeout(120)
def test_rewards_sync_async_and_partial(e2e):
    present = set().union(*e2e["lines"])
    for name in ("token_sum_reward", "first_token_reward", "ParityReward"):
        assert f"rewards/{name}/mean" in present
        values = [line[f"rewards/{name}/mean"] for line in e2e["lines"]
                  if line.get(f"rewards/{name}/mean") is not None]
        assert values and all(math.isfinite(v) for v in values)
    parity = [line["rewards/ParityReward/mean"] for line in e2e["lines"]
              if line.get("rewards/ParityReward/mean") is not None]
    assert all(0.0 <= v <= 1.0 for v in parity)  # the None rows stay out of the mean


@pytest.mark.timeout(120)
def test_adapter_changed_and_adapter_cache_is_trimmed(e2e):
    after = lora.peft_state(e2e["trainer"].model)
    changed = [k for k, v in e2e["before"].items() if not torch.equal(v, after[k])]
    assert changed, "three optimizer steps left the LoRA adapter unchanged"
    cache = e2e["out"] / ".vllm_lora"
    versions = sorted(p.name for p in cache.iterdir() if re.fullmatch(r"v\d+", p.name))
    # max_staleness + 1 live versions, the newest, and the one unloaded at the last sync
    assert versions == ["v1", "v2", "v3"]  # (its files outlive the unload by one sync)


@pytest.mark.timeout(120)
def test_checkpoints_hold_adapter_optimizer_and_rollout_state(e2e):
    out = e2e["out"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    final = out / "checkpoint-3"
    assert (final / "adapter" / "adapter_config.json").is_file()
    assert (final / "adapter" / "adapter_model.safetensors").is_file()
    saved = torch.load(final / "trainer_state.pt", weights_only=True)
    assert saved["global_step"] == 3 and saved["optimizer"]["state"]
    state = json.loads((final / "rollout_state.json").read_text())
    assert state["model_version"] == 3 and state["global_step"] == 3
    assert state["dataset_rows"] == 4
    cursor, beyond = state["next_prompt_index"], state["consumed_after_cursor"]
    assert cursor + len(beyond) >= 6  # 3 steps x 8 samples: 6 groups of 4 resolved at least
    assert all(p > cursor for p in beyond)
    stored = lora.peft_state(e2e["trainer"].model)
    from safetensors.torch import load_file

    on_disk = load_file(final / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(on_disk[k], stored[k]) for k in stored)


@pytest.mark.timeout(120)
def test_sampler_logprobs_are_the_trainers_at_the_same_temperature(e2e):
    steps = [line for line in e2e["lines"] if "perf/step_s" in line]
    first = steps[0]  # version 0 sampled it and version 0 scores it: the same policy
    assert first["sample/staleness_mean"] == 0
    assert first["sampling/sampling_logp_difference/mean"] < 1e-4
    assert abs(first["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    for line in steps:  # later steps score samples one version old at most
        assert line["sample/staleness_max"] <= 1
        assert abs(line["sampling/importance_sampling_ratio/mean"] - 1) < 0.05
        assert line["sampling/sampling_logp_difference/mean"] < 0.2


@pytest.mark.timeout(120)
def test_synchronous_baseline_trains_only_fresh_samples(tiny_model, tmp_path):
    """synchronous=True: one step's samples under version v, then v+1. A full micro-batch must
    not wait for a sample the worker only makes after the next sync."""
    args = make_args(tmp_path, "out", max_steps=3, synchronous=True)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(4), log=lambda message: None)
    assert trainer.train().global_step == 3
    steps = [line for line in read_metrics(Path(args.output_dir)) if "perf/step_s" in line]
    assert [line["step"] for line in steps] == [1, 2, 3]
    for line in steps:
        assert line["sample/staleness_max"] == 0 and line["batch/samples_per_step"] == 8
        assert abs(line["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4


# ---------------------------------------------------------------- 2. resume and the cursor


@pytest.mark.timeout(150)
def test_resume_continues_step_cursor_and_metrics(tiny_model, tmp_path):
    rows = make_rows(4)
    out = tmp_path / "out"
    record = tmp_path / "seen.txt"  # the same path in both runs: it is part of the settings

    def trainer_for(max_steps, record, messages):  # one row of 62 tokens: two samples a step
        args = make_args(tmp_path, "out", RecordingConfig, max_steps=max_steps, save_steps=1,
                         save_total_limit=2, per_device_train_batch_size=1, token_budget=62,
                         record_path=str(record))
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                                   args=args, train_dataset=rows, log=messages.append)
        trainer.loop_cls = RecordingLoop
        return trainer

    assert trainer_for(3, record, []).train().global_step == 3
    metrics_after_first = (out / "metrics.jsonl").read_text()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    state = json.loads((out / "checkpoint-3" / "rollout_state.json").read_text())
    cursor, consumed = state["next_prompt_index"], state["consumed_after_cursor"]
    assert state["model_version"] == 3 and state["global_step"] == 3
    # Steps 1-2 train position 0, step 3 takes position 2's marker (filtered) and trains half
    # of position 1: the cursor stays at 1, and 2 is listed as consumed beyond it.
    assert (cursor, consumed) == (1, [2]), (cursor, consumed)
    seen_first = [int(x) for x in record.read_text().split()]
    assert set(consumed) <= set(seen_first)
    record.unlink()

    messages: list[str] = []
    result = trainer_for(5, record, messages).train(resume_from_checkpoint=True)
    assert result.global_step == 5
    assert any(f"step 3, next prompt {cursor}, version 3" in m for m in messages), messages
    seen = [int(x) for x in record.read_text().split()]
    assert seen[0] == cursor, f"resumed worker started at {seen[0]}, cursor {cursor}"
    assert seen == sorted(seen) and not set(seen) & set(consumed)
    text = (out / "metrics.jsonl").read_text()
    assert text.startswith(metrics_after_first), "metrics.jsonl was truncated on resume"
    new_steps = [json.loads(x)["step"] for x in text[len(metrics_after_first):].splitlines()]
    assert new_steps and min(new_steps) == 4 and max(new_steps) == 5
    final = json.loads((out / "checkpoint-5" / "rollout_state.json").read_text())
    assert final["model_version"] == 5 and final["next_prompt_index"] >= cursor
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]
    # other settings or other prompts: refused before any process starts, nothing written
    changed = trainer_for(6, record, [])
    changed.args.learning_rate = 2e-3
    with pytest.raises(ValueError, match=r"other settings \(learning_rate: 0.001 -> 0.002\)"):
        changed.train(resume_from_checkpoint=True)
    other_rows = trainer_for(6, record, [])
    other_rows.rows = make_rows(4)[::-1]
    with pytest.raises(ValueError, match="trained on other prompts"):
        other_rows.train(resume_from_checkpoint=True)
    state_path = out / "checkpoint-5" / "rollout_state.json"
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({k: v for k, v in state.items() if k != "config"}))
    with pytest.raises(ValueError, match="holds no run identity"):
        trainer_for(6, record, []).train(resume_from_checkpoint=True)
    assert not changed.model.training  # a refused resume leaves the model as it was given
    assert (out / "metrics.jsonl").read_text() == text


@pytest.mark.timeout(120)
def test_stale_samples_are_dropped_without_pinning_the_cursor(tiny_model, tmp_path):
    """max_staleness=0 and one row of 54 tokens: a micro-batch holds one 54-token sample (two
    only if their completions are short), so the next sample of a group waits across the step
    and its weight sync and is then stale, as is the rest of its group and any group generated
    meanwhile. They are dropped (never trained), and the one-epoch run (max_steps=-1) still
    ends, its cursor past every prompt."""
    args = make_args(tmp_path, "out", max_steps=-1, num_train_epochs=1, max_staleness=0,
                     per_device_train_batch_size=1, token_budget=54)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(4), log=lambda message: None)
    result = trainer.train()
    lines = read_metrics(Path(args.output_dir))
    steps = [line for line in lines if "perf/step_s" in line]
    assert total(lines, "sample/dropped_stale_count") >= 2 * len(steps) > 0
    assert all(line["sample/staleness_max"] == 0 for line in steps)
    assert all(line["batch/samples_per_step"] <= 2 for line in steps)
    final = Path(args.output_dir) / f"checkpoint-{result.global_step}"
    state = json.loads((final / "rollout_state.json").read_text())
    assert state["next_prompt_index"] == 4 and state["consumed_after_cursor"] == []
    assert_stopped(Path(args.output_dir), trainer)


# ---------------------------------------------------------------- 3. faults


@pytest.mark.timeout(120)
def test_worker_exception_reaches_the_trainer_with_its_traceback(tiny_model, tmp_path):
    args = make_args(tmp_path, "out", max_steps=1000)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(4), log=lambda message: None)
    trainer.loop_cls = FailingLoop
    with pytest.raises(RuntimeError, match="boom in worker") as caught:
        trainer.train()
    text = str(caught.value)
    assert "rollout worker failed" in text and "Traceback" in text and "generate_one" in text
    assert_stopped(Path(args.output_dir), trainer)


@pytest.mark.timeout(120)
def test_killed_worker_is_reported_with_its_exit_code(tiny_model, tmp_path):
    killed_at: list[float] = []
    trainer = None

    def log(message):
        if message.startswith("step 1:") and not killed_at:
            os.kill(trainer.worker.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    args = make_args(tmp_path, "out", max_steps=1000, rollout_worker_timeout=30.0)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(4), log=log)
    with pytest.raises(RuntimeError, match=r"exited with code -9"):
        trainer.train()
    assert killed_at and time.monotonic() - killed_at[0] < args.rollout_worker_timeout
    assert_stopped(Path(args.output_dir), trainer)


def fails_after_step_1(tiny_model, tmp_path, url, at_step_1, **overrides):
    """A run against the server at `url` in which `at_step_1()` is called at the first step's
    log line; returns train()'s ServerDownError text, its seconds and the run's args. No
    weight sync after the cold one: only the worker talks to the server afterwards."""
    def log(message):
        if message.startswith("step 1:"):
            at_step_1()

    args = make_args(tmp_path, "out", embedded_server=False, vllm_server_base_url=url,
                     weight_sync_steps=1000, max_steps=1000, **overrides)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(4), log=log)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ServerDownError") as caught:
        trainer.train()
    assert trainer.worker is None
    return str(caught.value), time.monotonic() - started, args


@pytest.mark.timeout(150)
def test_server_down_names_the_server_and_the_retries(tiny_model, tmp_path):
    server, server_log, url = start_server(tiny_model, tmp_path / "server")
    try:
        text, seconds, args = fails_after_step_1(
            tiny_model, tmp_path, url, lambda: (server.kill(), server.wait()), vllm_max_retries=2)
        assert seconds < 60
        assert f"the generation server at {url} failed 3 times" in text, text
        assert "raise vllm_max_retries" in text
        assert server.returncode == -signal.SIGKILL  # the test's kill, not something else
        lines = read_metrics(Path(args.output_dir))
        assert lines[0]["step"] == 1
        # Recorded per successful request only: the server never came back, so none of them
        # needed a retry (the failed ones raised instead).
        assert total(lines, "rollout/vllm_retry_count") == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server_log.close()


@pytest.mark.timeout(150)
def test_a_server_that_stops_answering_times_out_per_request(tiny_model, tmp_path):
    """The real server frozen (SIGSTOP) after the first step: the kernel still accepts its
    connections, nothing answers. Each request gives up after vllm_request_timeout."""
    server, server_log, url = start_server(tiny_model, tmp_path / "server")
    try:
        text, seconds, _ = fails_after_step_1(
            tiny_model, tmp_path, url, lambda: server.send_signal(signal.SIGSTOP),
            vllm_max_retries=1, vllm_request_timeout=3.0)
        assert seconds < 90
        assert f"the generation server at {url} failed 2 times (last: TimeoutError" in text
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
        server_log.close()


@pytest.mark.timeout(120)
def test_reward_exception_names_the_function(tiny_model, tmp_path):
    args = make_args(tmp_path, "out", max_steps=1000)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=[token_sum_reward,
                                                                     bad_reward],
                               args=args, train_dataset=make_rows(4), log=lambda message: None)
    with pytest.raises(RuntimeError, match="reward function 'bad_reward' raised ValueError: "
                                           "no score for this completion"):
        trainer.train()
    assert_stopped(Path(args.output_dir), trainer)


def test_lambda_reward_is_refused_before_any_process_starts(tiny_model, tmp_path):
    args = make_args(tmp_path, "out", max_steps=2)
    trainer = AsyncGRPOTrainer(model=str(tiny_model),
                               reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=args, train_dataset=make_rows(2), log=lambda message: None)
    with pytest.raises(TypeError, match=r"reward function '<lambda>' cannot be pickled"):
        trainer.train()
    assert not (Path(args.output_dir) / "server.log").exists()
    assert getattr(trainer, "worker", None) is None


@pytest.mark.timeout(120)
def test_filter_rejecting_every_prompt_fails_the_run(tiny_model, tmp_path):
    """Epoch mode: every position arrives as 'filtered', so the trainer's loop ends with no
    step; the worker's error must still reach train()."""
    args = make_args(tmp_path, "out", max_steps=-1, num_train_epochs=1)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(3), log=lambda message: None)
    trainer.loop_cls = RejectAllLoop
    with pytest.raises(RuntimeError, match="filter_prompt rejected every prompt of epoch 0"):
        trainer.train()
    assert_stopped(Path(args.output_dir), trainer)


@pytest.mark.timeout(120)
def test_oversize_samples_are_dropped_with_a_warning(tiny_model, tmp_path, caplog):
    """token_budget 64: samples of the short prompts (41 prompt tokens + 8 at most) fit, those
    of the long one (81 prompt tokens) never do; the epoch still ends."""
    rows = [{"prompt": [{"role": "user", "content": text}]} for text in ("hi", "x" * 40, "yo")]
    args = make_args(tmp_path, "out", max_steps=-1, num_train_epochs=1, token_budget=64)
    messages: list[str] = []
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=rows, log=messages.append)
    with caplog.at_level(logging.WARNING, logger="reprorl.grpo"):
        result = trainer.train()
    lines = read_metrics(Path(args.output_dir))
    dropped = total(lines, "batch/dropped_oversize_count")
    assert dropped > 0 and result.global_step >= 1
    warnings = [m for m in messages if m.startswith("warning: dropped a")]
    assert len(warnings) == dropped
    assert any("over token_budget=64" in r.getMessage() for r in caplog.records)
    assert all(line["sample/forwarded_tokens_max"] <= 64 for line in lines
               if "perf/step_s" in line)
    state = json.loads((Path(args.output_dir) / f"checkpoint-{result.global_step}"
                        / "rollout_state.json").read_text())
    assert state["next_prompt_index"] == 3


# ---------------------------------------------------------------- hardening


@pytest.mark.timeout(240)
def test_a_server_with_an_api_key_serves_the_trainer_and_refuses_others(tiny_model, tmp_path):
    server, server_log, url = start_server(tiny_model, tmp_path / "server", "--api-key",
                                           "s3cret")
    try:
        keyless = requests.post(f"{url}/v1/completions", json={"prompt": [5]}, timeout=10)
        assert keyless.status_code == 401 and keyless.json() == {"error": "Unauthorized"}
        wrong = make_args(tmp_path, "wrong", embedded_server=False, vllm_server_base_url=url,
                          vllm_server_api_key="guess", max_steps=2)
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                                   args=wrong, train_dataset=make_rows(4), log=lambda m: None)
        with pytest.raises(RuntimeError, match=r"requires an API key \(HTTP 401\) and the key "
                           "given was refused: set vllm_server_api_key"):
            trainer.train()
        args = make_args(tmp_path, "out", embedded_server=False, vllm_server_base_url=url,
                         vllm_server_api_key="s3cret", max_steps=2)
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                                   args=args, train_dataset=make_rows(4), log=lambda m: None)
        assert trainer.train().global_step == 2
        state = (Path(args.output_dir) / "checkpoint-2" / "rollout_state.json").read_text()
        assert "s3cret" not in state  # the key is never written into a checkpoint
        # the weight routes want the key too; a full-model run given it syncs through them
        for route in ("/collective_rpc", "/reset_prefix_cache"):
            keyless = requests.post(url + route, json={"method": "reload_weights"}, timeout=10)
            assert keyless.status_code == 401
        args = make_args(tmp_path, "full", embedded_server=False, vllm_server_base_url=url,
                         vllm_server_api_key="s3cret", max_steps=1, use_peft=False)
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                                   args=args, train_dataset=make_rows(4), log=lambda m: None)
        assert trainer.train().global_step == 1
        assert max(trainer.run.weights.check.differences) < 1e-4  # on for a server not ours
        assert "reloaded weights from " + str(tiny_model) in server_log_text(server_log)
    finally:
        server.kill()
        server.wait()
        server_log.close()


def test_the_embedded_server_has_a_fresh_key_and_serves_only_the_run_adapters(e2e):
    """The e2e run's server wanted its own random key and loaded adapters only from the run's
    `.vllm_lora`; the key reached neither the command line nor the checkpoints."""
    trainer, out = e2e["trainer"], e2e["out"]
    key = trainer.args.vllm_server_api_key
    assert key and len(key) >= 32
    assert all(key not in p.read_text() for p in out.rglob("*.json"))
    log = (out / "server.log").read_text()
    name = trainer.run.weights.name  # policy-<8 hex>: this run's, so a shared server takes it
    assert re.fullmatch(r"policy-[0-9a-f]{8}", name)
    assert key not in log and f"loaded LoRA adapter {name}-v0 from " + str(
        (out / ".vllm_lora" / "v0").resolve()) in log


UNGUARDED = """
from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from test_grpo import BASE, make_rows, token_sum_reward

rows = make_rows(4)
rows[0]["notes"] = "x" * (1 << 17)  # the worker's arguments outgrow a pipe's 64 KiB buffer
trainer = AsyncGRPOTrainer(model={model!r}, reward_funcs=token_sum_reward, train_dataset=rows,
                           args=AsyncGRPOConfig(output_dir={out!r}, **{{**BASE, "max_steps": 2}}))
trainer.train()
"""


@pytest.mark.timeout(180)
def test_a_script_without_a_main_guard_fails_at_once_with_the_fix(tiny_model, tmp_path):
    """The README example copied into a script as is: the spawned worker imports the script,
    which must not build a second trainer; the user gets the fix in one line. With a dataset
    whose rows outgrow a pipe's buffer, as the pipeline's do: if they went with the spawn, the
    trainer would block for good writing what the dead worker never reads."""
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED.format(model=str(tiny_model), out=str(tmp_path / "out")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=170, check=False)
    assert result.returncode != 0
    assert time.monotonic() - started < 120
    last = result.stderr.strip().splitlines()[-1]
    assert "the rollout worker exited with code 1 while starting" in last, result.stderr
    assert 'under `if __name__ == "__main__":`' in last
    assert "AsyncGRPOTrainer built inside the spawned rollout worker" in result.stderr


@pytest.mark.timeout(180)
def test_rewards_without_signal_stop_the_run_after_an_epoch(tiny_model, tmp_path):
    """max_steps=1 with a reward that is the same for every completion: no step can happen;
    after an epoch of prompts the run stops and says why."""
    args = make_args(tmp_path, "out", max_steps=1)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=constant_reward, args=args,
                               train_dataset=make_rows(3), log=lambda m: None)
    with pytest.raises(RuntimeError, match=r"3 prompt positions in a row \(an epoch of 3 "
                       r"prompts\) gave no sample to train; what arrived instead: 3 zero_std "
                       r"groups\. GRPO learns only from groups whose rewards differ"):
        trainer.train()
    assert_stopped(Path(args.output_dir), trainer)


@pytest.mark.timeout(180)
def test_a_hung_reward_function_times_out(tiny_model, tmp_path):
    args = make_args(tmp_path, "out", max_steps=2, reward_timeout=2.0)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=hung_reward, args=args,
                               train_dataset=make_rows(2), log=lambda m: None)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reward function 'hung_reward' took more than "
                       r"reward_timeout=2 s to score one group"):
        trainer.train()
    assert time.monotonic() - started < 60
    assert_stopped(Path(args.output_dir), trainer)


@pytest.mark.timeout(180)
def test_a_diverged_policy_is_never_published(tiny_model, tmp_path):
    """A learning rate that overflows the weights: the step that makes them non-finite stops
    the run before the version is written or loaded."""
    args = make_args(tmp_path, "out", max_steps=20, learning_rate=1e38, save_steps=1)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(4), log=lambda m: None)
    with pytest.raises(RuntimeError, match=r"step (\d+) left the policy's parameters "
                       r"non-finite") as caught:
        trainer.train()
    bad = int(re.search(r"step (\d+) left", str(caught.value)).group(1))
    out = Path(args.output_dir)
    assert not (out / f"checkpoint-{bad}").exists()
    assert (out / f"checkpoint-{bad - 1}").exists() or bad == 1
    assert_stopped(out, trainer)


# ---------------------------------------------------------------- reproducibility


@pytest.mark.timeout(600)
def test_a_fixed_schedule_replays_bit_for_bit(tiny_model, tmp_path):
    """schedule_lag=1: the final adapter is bitwise the same across runs that differ in rollout
    concurrency, server threads and a random delay in the reward, and after a resume from a
    checkpoint in a new trainer; schedule_lag=0 (synchronous) too, one group at a time against
    64 rollouts in flight."""
    rows = make_rows(8)

    def run(name, reward=token_sum_reward, resume=False, interrupt=None, **overrides):
        args = make_args(tmp_path, name, max_staleness=1, **{
            "max_steps": 4, "schedule_lag": 1, **overrides})
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=reward, args=args,
                                   train_dataset=rows, log=lambda m: None)
        torch.seed()  # each run starts from another RNG, as a fresh process would
        trainer.train(resume_from_checkpoint=resume or None, interrupt_after_step=interrupt)
        return adapter_state(trainer), read_metrics(Path(args.output_dir))

    first, lines = run("first")
    steps = [line for line in lines if "perf/step_s" in line]
    assert [line["sample/staleness_max"] for line in steps] == [0, 1, 1, 1]  # max(0, s - 1)
    second, _ = run("second", delayed_token_sum_reward, max_concurrent_rollouts=4,
                    embedded_server_threads=2)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    _, interrupted = run("resumed", interrupt=2)
    assert [line["step"] for line in interrupted if "loss" in line] == [1, 2]
    resumed, after = run("resumed", resume=True)
    assert all(torch.equal(first[k], resumed[k]) for k in first)
    # the final checkpoint byte for byte (adapter, optimizer, RNG, cursor), and every window's
    # reproducible values: the resumed run is the first run, timings apart
    assert checkpoint_bytes(tmp_path / "first/checkpoint-4") == checkpoint_bytes(
        tmp_path / "resumed/checkpoint-4")
    for resumed_window, window in zip(reproducible_windows(after), reproducible_windows(lines),
                                      strict=True):
        assert resumed_window == window, {k: (resumed_window.get(k), window.get(k))
                                          for k in resumed_window.keys() | window.keys()
                                          if resumed_window.get(k) != window.get(k)}
    synchronous, lines = run("synchronous", schedule_lag=None, synchronous=True)
    assert all(line["sample/staleness_max"] == 0 for line in lines if "perf/step_s" in line)
    one_group, _ = run("one_group", delayed_token_sum_reward, schedule_lag=0,
                       max_concurrent_rollouts=4)
    assert all(torch.equal(synchronous[k], one_group[k]) for k in first)
    assert not all(torch.equal(synchronous[k], first[k]) for k in first)  # lag matters


@pytest.mark.timeout(400)
def test_a_fixed_schedule_steps_over_an_empty_block_and_resumes_after_it(tiny_model, tmp_path):
    """Block 0 (rows 0 and 1, in dataset order) has no signal: it trains nothing and publishes
    the same weights as version 1; block 1 is then sampled by version 0 (lag 1). A run resumed
    after that ends bitwise where the continuous one does."""
    rows = make_rows(8, flat=[True, True] + [False] * 6)

    def run(name, resume=False, **overrides):
        args = make_args(tmp_path, name, max_staleness=1, schedule_lag=1,
                         train_sampling_strategy="sequential", **{"max_steps": 3, **overrides})
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=flat_first_rows_reward,
                                   args=args, train_dataset=rows, log=lambda m: None)
        trainer.train(resume_from_checkpoint=resume or None)
        return adapter_state(trainer), read_metrics(Path(args.output_dir)), args

    continuous, lines, args = run("continuous")
    steps = [line for line in lines if "perf/step_s" in line]
    assert len(steps) == 3 and steps[0]["sample/staleness_max"] == 1  # block 1 from version 0
    state = json.loads((Path(args.output_dir) / "checkpoint-3" / "rollout_state.json")
                       .read_text())
    assert state["model_version"] == 4 and state["next_prompt_index"] == 8  # 4 blocks of 2
    run("resumed", max_steps=1)
    resumed, _, _ = run("resumed", resume=True)
    assert all(torch.equal(continuous[k], resumed[k]) for k in continuous)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("end", ["max_steps", "interrupt"])
def test_a_fixed_schedule_samples_no_block_past_the_calls_last_step(tiny_model, tmp_path, end):
    """Lag 1, 4 blocks. max_steps 2: version 1, published after step 1, would sample block 2
    while step 2 trains block 1, and no step would ever train it; the worker samples blocks 0
    and 1 only. An epoch interrupted after step 1: version 0 would sample block 1 beside block
    0, and the call stops before training it (its resume samples it again); the worker samples
    block 0 only. The server (the test's own, so it can be asked after the run) completed
    exactly their requests, blocks x 2 groups x 4 samples."""
    server, server_log, url = start_server(tiny_model, tmp_path / "server", "--max-loras", "4")
    try:
        ending = {"max_steps": 2} if end == "max_steps" else {"num_train_epochs": 1}
        args = make_args(tmp_path, "out", embedded_server=False, vllm_server_base_url=url,
                         weight_sync_check=False, max_staleness=1, schedule_lag=1, **ending)
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                                   args=args, train_dataset=make_rows(8), log=lambda m: None)
        steps = 2 if end == "max_steps" else 1
        assert trainer.train(interrupt_after_step=None if end == "max_steps" else 1
                             ).global_step == steps
        text = requests.get(f"{url}/metrics", timeout=10).text
        done = re.findall(r'^vllm:request_success_total\{finished_reason="(\w+)",[^}]*\} (\S+)$',
                          text, re.M)
        assert sum(float(n) for reason, n in done if reason != "abort") == steps * 2 * 4, done
    finally:
        server.kill()
        server.wait()
        server_log.close()


@pytest.mark.parametrize("max_steps, interrupt, limit", [
    (-1, None, -1),  # epochs: their end bounds the worker
    (5, None, (3 + 5 - 2) * 2),  # 3 steps to go; the next block is block 3 (one was empty)
    (-1, 3, (3 + 3 - 2) * 2),
    (5, 3, (3 + 3 - 2) * 2),  # the nearer end
    (-1, 2, -1),  # an interrupt at the resumed step never fires: the run goes on
    (5, 1, (3 + 5 - 2) * 2),
    (2, None, 3 * 2),  # max_steps reached (a final checkpoint resumed): no block at all
])
def test_the_position_limit_is_the_calls_nearest_end_ahead(tiny_model, tmp_path, max_steps,
                                                           interrupt, limit):
    args = make_args(tmp_path, "out", schedule_lag=1, max_steps=max_steps)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward, args=args,
                               train_dataset=make_rows(8), log=lambda m: None)
    trainer.run = SimpleNamespace(version=SimpleNamespace(value=3), global_step=2,
                                  interrupt_after_step=interrupt)
    assert trainer._position_limit() == limit
    trainer.args.schedule_lag = None  # free-running: no schedule to bound
    assert trainer._position_limit() == -1


@pytest.mark.timeout(400)
def test_an_interrupt_at_the_last_step_before_empty_blocks_resumes_to_the_same_checkpoint(
        tiny_model, tmp_path):
    """One epoch of 4 blocks whose last has no signal: 3 steps. Interrupted after step 3 and
    resumed, the run walks the empty block as the continuous run does, and both end in the
    same final checkpoint, byte for byte (version 4, the epoch's end), not the interrupt's."""
    rows = make_rows(8, flat=[False] * 6 + [True, True])

    def run(name, resume=False, interrupt=None):
        args = make_args(tmp_path, name, max_staleness=1, schedule_lag=1,
                         train_sampling_strategy="sequential", num_train_epochs=1)
        trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=flat_first_rows_reward,
                                   args=args, train_dataset=rows, log=lambda m: None)
        torch.seed()  # each run starts from another RNG, as a fresh process would
        result = trainer.train(resume_from_checkpoint=resume or None,
                               interrupt_after_step=interrupt)
        return result.global_step

    assert run("continuous") == 3
    assert run("resumed", interrupt=3) == 3
    assert run("resumed", resume=True) == 3
    final = checkpoint_bytes(tmp_path / "continuous/checkpoint-3")
    assert json.loads(final["rollout_state.json"])["model_version"] == 4
    assert checkpoint_bytes(tmp_path / "resumed/checkpoint-3") == final


class SwappedWeightsTrainer(AsyncGRPOTrainer):
    """From version 1 on, serves other weights than it trains (as an adapter that loads with
    HTTP 200 but is not applied would)."""

    def _export_policy(self, directory: Path) -> None:
        super()._export_policy(directory)
        if self.run.global_step >= 1:
            from safetensors.torch import load_file, save_file

            file = directory / "adapter_model.safetensors"
            tensors = load_file(file)
            save_file({k: v + 0.05 for k, v in tensors.items()}, str(file))


@pytest.mark.timeout(120)
def test_weight_sync_check_passes_true_syncs_and_stops_at_a_wrong_one(tiny_model, tmp_path):
    """weight_sync_check on the embedded server (off there by default): the canary's log-probs
    equal the trainer's after every true sync, and the first sync that serves other weights
    stops the run naming its version, with every process stopped."""
    args = make_args(tmp_path, "good", max_steps=2, weight_sync_check=True, temperature=0.7)
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(4), log=lambda message: None)
    assert trainer.train().global_step == 2
    differences = trainer.run.weights.check.differences
    assert len(differences) == 3 and max(differences) < 1e-4  # cold sync and one per step
    args = make_args(tmp_path, "swapped", max_steps=2, weight_sync_check=True)
    trainer = SwappedWeightsTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                                    args=args, train_dataset=make_rows(4),
                                    log=lambda message: None)
    with pytest.raises(RuntimeError, match=r"weight sync check failed for policy-[0-9a-f]{8}-v1"
                                           r": the server's log-probs .* differ"):
        trainer.train()
    assert trainer.run.weights.check.differences[0] < 1e-4
    assert_stopped(Path(args.output_dir), trainer)


# ---------------------------------------------------------------- 5. full-model training


def model_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.timeout(300)
def test_full_model_training_syncs_merged_weights_and_resumes_bit_for_bit(tiny_model,
                                                                          tmp_path):
    """use_peft=False (TRL's peft_config=None): every weight trains, no LoRA layer exists, and
    each sync reloads the merged weights into the embedded server: the canary's log-probs equal
    the trainer's after every sync (the server's own prefix cache included), and the first
    step's samples score alike on both sides. The checkpoint holds the whole model; on the
    synchronous schedule an interrupted run resumed in a new trainer ends byte for byte where
    the straight one does. An adapter asked for beside use_peft=False, or a lag the single
    served version cannot give, is refused before anything starts."""
    def trainer_for(name, **overrides):
        args = make_args(tmp_path, name, use_peft=False, weight_sync_check=True,
                         temperature=0.7, max_staleness=1, **{"max_steps": 3, **overrides})
        return AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                                args=args, train_dataset=make_rows(4), log=lambda m: None)

    trainer = trainer_for("free")
    before = model_state(trainer)
    assert trainer.train().global_step == 3
    after = model_state(trainer)
    assert not any(isinstance(m, lora.LoRALinear) for m in trainer.model.modules())
    assert all(not torch.equal(before[k], after[k]) for k in before), "a weight did not train"
    differences = trainer.run.weights.check.differences
    assert len(differences) == 4 and max(differences) < 1e-4  # the cold sync and one per step
    print(f"full-model syncs, embedded server: canary |difference| at most {max(differences):.2g}")
    lines = read_metrics(tmp_path / "free")
    first = next(line for line in lines if "perf/step_s" in line)
    assert first["sample/staleness_max"] == 0
    assert first["sampling/sampling_logp_difference/max"] < 1e-4
    checkpoint = tmp_path / "free" / "checkpoint-3"
    assert (checkpoint / "model" / "model.safetensors").is_file()
    assert not (checkpoint / "adapter").exists()
    served = sorted(p.name for p in (tmp_path / "free" / ".vllm_lora").iterdir())
    assert served == ["v2", "v3"]  # the served version, and the one its files outlive by a sync
    assert_stopped(tmp_path / "free", trainer)

    trainer_for("straight", synchronous=True).train()
    trainer_for("resumed", synchronous=True).train(interrupt_after_step=1)
    resumed = trainer_for("resumed", synchronous=True)
    assert resumed.train(resume_from_checkpoint=True).global_step == 3
    assert checkpoint_bytes(tmp_path / "resumed/checkpoint-3") == checkpoint_bytes(
        tmp_path / "straight/checkpoint-3")

    with pytest.raises(ValueError, match="use_peft=False trains the full model, but lora_path"):
        AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                         args=make_args(tmp_path, "x", use_peft=False), train_dataset=make_rows(4),
                         lora_path=str(checkpoint / "model"))
    with pytest.raises(ValueError, match="schedule_lag >= 1 samples from several weight"):
        make_args(tmp_path, "x", use_peft=False, schedule_lag=1)
