"""The async GRPO trainer's callbacks and logging integrations, with real processes and the
real libraries: transformers' `TrainerCallback`s at the Trainer's points, a callback that stops
a run which then resumes to the uninterrupted run's bytes, and `report_to` writing TensorBoard
event files, a local trackio project and an offline wandb run, each read back."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_grpo import (
    assert_stopped,
    checkpoint_bytes,
    make_args,
    make_rows,
    read_metrics,
    token_sum_reward,
)
from transformers import TrainerCallback

from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer

EVENTS = ("on_init_end", "on_train_begin", "on_step_begin", "on_pre_optimizer_step",
          "on_optimizer_step", "on_step_end", "on_log", "on_save", "on_train_end")


class Recorder(TrainerCallback):
    """Every event with the step the state says; asks for a checkpoint after step 1."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []

    def __getattribute__(self, name):
        if name in EVENTS:
            def record(args, state, control, **kwargs):
                self.events.append((name, state.global_step))
                if name == "on_step_end" and state.global_step == 1:
                    control.should_save = True
                return control
            return record
        return super().__getattribute__(name)


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def fixed_args(tmp_path: Path, name: str, **overrides) -> AsyncGRPOConfig:
    return make_args(tmp_path, name, max_staleness=1, max_steps=4, schedule_lag=1,
                     logging_steps=2, logging_first_step=True, **overrides)


@pytest.mark.timeout(240)
def test_callbacks_see_each_point_and_one_stops_a_run_that_resumes(tiny_model, tmp_path):
    rows = make_rows(8)
    recorder = Recorder()
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=fixed_args(tmp_path, "first"), train_dataset=rows,
                               callbacks=[recorder], log=lambda m: None)
    assert trainer.train().global_step == 4
    steps = [[e for e, s in recorder.events if s == step and e not in (
        "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step")] for step in range(5)]
    assert recorder.events[:2] == [("on_init_end", 0), ("on_train_begin", 0)]
    assert recorder.events[-1] == ("on_train_end", 4)
    # a window at step 1 (logging_first_step) and every 2 steps; a checkpoint where the
    # callback asked (1) and at max_steps (DefaultFlowCallback)
    assert steps[1] == ["on_step_end", "on_log", "on_save"]
    assert steps[2] == ["on_step_end", "on_log"] and steps[3] == ["on_step_end"]
    assert steps[4][:3] == ["on_step_end", "on_log", "on_save"]
    assert [e for e, _ in recorder.events].count("on_optimizer_step") == 4
    first = Path(trainer.args.output_dir)
    assert sorted(p.name for p in first.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-4"]
    assert trainer.state.log_history == read_metrics(first)

    stopper = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=fixed_args(tmp_path, "stopped"), train_dataset=rows,
                               callbacks=[StopAt(2)], log=lambda m: None)
    assert stopper.pop_callback(StopAt).step == 2
    stopper.add_callback(StopAt(2))
    assert stopper.train().global_step == 2
    assert_stopped(tmp_path / "stopped", stopper)  # worker and server down
    assert (tmp_path / "stopped/checkpoint-2").is_dir()
    resumed = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=fixed_args(tmp_path, "stopped"), train_dataset=rows,
                               log=lambda m: None)
    assert resumed.train(resume_from_checkpoint=True).global_step == 4
    assert resumed.state.log_history == read_metrics(tmp_path / "stopped")
    assert checkpoint_bytes(first / "checkpoint-4") == checkpoint_bytes(
        tmp_path / "stopped/checkpoint-4")


@pytest.mark.timeout(240)
def test_report_to_writes_tensorboard_trackio_and_offline_wandb(tiny_model, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    project = f"reprorl-test-{tmp_path.name}"
    args = make_args(tmp_path, "out", max_steps=2, report_to="all", run_name="tiny",
                     project=project, logging_dir=str(tmp_path / "tb"))
    assert set(args.report_to) >= {"tensorboard", "trackio", "wandb"}
    args.report_to = ["tensorboard", "trackio", "wandb"]
    trainer = AsyncGRPOTrainer(model=str(tiny_model), reward_funcs=token_sum_reward,
                               args=args, train_dataset=make_rows(4), log=lambda m: None)
    assert trainer.train().global_step == 2
    windows = [w for w in read_metrics(tmp_path / "out") if "loss" in w]
    assert [w["step"] for w in windows] == [1, 2]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for name in ("loss", "reward", "entropy", "perf/step_s"):
        points = events.Scalars(f"train/{name}")
        assert [p.step for p in points] == [1, 2]
        assert [p.value for p in points] == pytest.approx([w[name] for w in windows], rel=1e-6)

    from trackio.sqlite_storage import SQLiteStorage

    try:
        logs = [r for r in SQLiteStorage.get_logs(project, "tiny") if "train/loss" in r]
        assert [r["train/loss"] for r in logs] == pytest.approx([w["loss"] for w in windows])
        assert [r["train/global_step"] for r in logs] == [1, 2]
    finally:
        SQLiteStorage.get_project_db_path(project).unlink(missing_ok=True)

    import wandb

    wandb.finish()  # what a script's exit does: the run's records flushed
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    deadline = time.monotonic() + 30  # wandb's own service may still be writing the file
    while len(history := [h for h in wandb_history(runs[0]) if "train/loss" in h]) < 2 and (
            time.monotonic() < deadline):
        time.sleep(0.2)
    assert [h["train/loss"] for h in history] == pytest.approx([w["loss"] for w in windows])
    assert [h["train/global_step"] for h in history] == [1, 2]


def wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline wandb run's `.wandb` file: a LevelDB-style log (a 7-byte
    header, then 32 KiB blocks of records: crc, length, kind, data) of protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, rows, chunk, pos = path.read_bytes(), [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a record still being written
            break
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        chunk = body if kind in (1, 2) else chunk + body  # full or first; middle or last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows
