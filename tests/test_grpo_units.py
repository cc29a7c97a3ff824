"""The GRPO trainer's parts on their own, without any process: the resume ledger, the sample
queue, the worker handle and the weight versions.

Their inputs are plain stand-ins for what the trainer passes: `queue.Queue` for the worker's
multiprocessing queues, a locked counter for a shared `multiprocessing.Value`, an object with a
`.value` for a shared `RawValue`, a recording process object for a spawned one.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from reprorl.grpo import checkpoints
from reprorl.grpo.batching import TokenBudgetBatcher
from reprorl.grpo.ledger import PositionLedger
from reprorl.grpo.metrics import MetricsWindow
from reprorl.grpo.processes import WorkerHandle, WorkerSignals
from reprorl.grpo.sample_queue import SampleQueue
from reprorl.grpo.samples import GroupResult, Sample, TrainingSequence
from reprorl.grpo.weight_sync import AdapterVersions

# ---------------------------------------------------------------- the ledger


def test_ledger_cursor_waits_for_every_sample_of_a_position():
    ledger = PositionLedger()
    ledger.arrive(0, 2)
    ledger.arrive(1, 1)
    ledger.consume(1)  # position 1 is done before position 0
    assert ledger.cursor == 0 and ledger.consumed_after_cursor == {1}
    ledger.consume(0)
    assert ledger.cursor == 0  # one sample of position 0 is still out
    ledger.consume(0)
    assert ledger.cursor == 2 and ledger.consumed_after_cursor == set()
    assert ledger.remaining == {}


def test_ledger_empty_group_is_consumed_on_arrival():
    ledger = PositionLedger()
    ledger.arrive(1, 0)  # filtered or zero-std: consumed beyond the cursor at once
    assert ledger.cursor == 0 and ledger.state() == {
        "next_prompt_index": 0, "consumed_after_cursor": [1]}
    ledger.arrive(0, 0)
    assert ledger.cursor == 2


def test_ledger_all_arrived_and_finished_in_epoch_mode():
    ledger = PositionLedger(end=3)
    assert not ledger.all_arrived() and not ledger.finished
    for position in range(3):
        ledger.arrive(position, 1)
    assert ledger.all_arrived() and not ledger.finished  # arrived, not yet trained
    for position in range(3):
        ledger.consume(position)
    assert ledger.finished
    by_steps = PositionLedger()
    by_steps.arrive(0, 0)
    assert not by_steps.all_arrived() and not by_steps.finished  # no end: never


def test_ledger_state_round_trip():
    ledger = PositionLedger(end=10)
    for position, samples in ((0, 1), (2, 0), (3, 0)):
        ledger.arrive(position, samples)
    state = ledger.state()
    assert state == {"next_prompt_index": 0, "consumed_after_cursor": [2, 3]}
    resumed = PositionLedger.from_state(state, end=10)
    assert resumed.cursor == 0 and resumed.consumed_after_cursor == {2, 3}
    resumed.arrive(0, 1)
    resumed.consume(0)
    resumed.arrive(1, 0)
    assert resumed.cursor == 4  # 0 and 1 now, 2 and 3 from the checkpoint
    assert not resumed.all_arrived()  # 4..9 are still to come


# ---------------------------------------------------------------- checkpoints


def test_checkpoints_are_ordered_by_step_and_a_resume_takes_the_newest(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint-"):
        checkpoints.latest(tmp_path)
    for step in (2, 10, 9):
        checkpoints.directory(tmp_path, step).mkdir()
    (tmp_path / ".checkpoint-11.abc.tmp").mkdir()  # a killed save's scratch: not one
    (tmp_path / "checkpoint-11-old").mkdir()  # a user's copy: not one
    assert [checkpoints.step_of(p) for p in checkpoints.found(tmp_path)] == [2, 9, 10]
    assert checkpoints.latest(tmp_path) == tmp_path / "checkpoint-10"


def test_a_fixed_schedule_checkpoint_resumes_at_its_next_block_with_its_versions():
    ledger = PositionLedger(end=10)
    for position, samples in ((0, 0), (1, 0), (3, 0)):
        ledger.arrive(position, samples)
    free = SimpleNamespace(schedule_lag=None, groups_per_step=4)
    assert checkpoints.cursor_state(ledger, 3, free) == ledger.state()
    fixed = SimpleNamespace(schedule_lag=1, groups_per_step=4)
    # version 2 trained blocks 0 and 1: block 2 starts at position 8, whatever has arrived
    assert checkpoints.cursor_state(ledger, 2, fixed) == {
        "next_prompt_index": 8, "consumed_after_cursor": []}
    assert checkpoints.cursor_state(ledger, 3, fixed)["next_prompt_index"] == 10  # the end
    assert checkpoints.cursor_state(PositionLedger(), 3, fixed)["next_prompt_index"] == 12
    folder = Path("checkpoint-5")
    assert checkpoints.scheduled_versions(folder, 2, 5) == [
        (3, folder / "versions" / "v3"), (4, folder / "versions" / "v4")]
    assert checkpoints.scheduled_versions(folder, 2, 1) == [(0, folder / "versions" / "v0")]
    assert checkpoints.scheduled_versions(folder, None, 5) == []  # free-running
    assert checkpoints.scheduled_versions(None, 2, 5) == []  # a fresh run


# ---------------------------------------------------------------- the sample queue


class Counter:
    """A shared multiprocessing.Value's interface: `.value` and `get_lock()`."""

    def __init__(self, value: int = 0):
        self.value, self.lock = value, threading.Lock()

    def get_lock(self):
        return self.lock


TOKEN_IDS = itertools.count(1)  # no two samples share a token: a row holds their sum


def sample(position: int, tokens: int = 4, version: int = 0) -> Sample:
    ids = [next(TOKEN_IDS) for _ in range(tokens)]
    trained = min(2, tokens - 1)  # the first token is never trained: nothing predicts it
    flags = [0] * (tokens - trained) + [1] * trained
    sequence = TrainingSequence(ids, flags, [-0.5 * f for f in flags], [None] * tokens)
    return Sample(sequence, 1.0, 1.0, {}, 1.0, {}, version, position, position, 1, tokens,
                  0.0, "id", "")


class Pipeline:
    """A SampleQueue with its inputs, filled as the worker would fill them."""

    def __init__(self, end=None, max_staleness=1, budget=16, rows=1, patience=3,
                 stall_positions=None, stall_timeout=float("inf")):
        self.groups, self.version = queue.Queue(), SimpleNamespace(value=0)
        self.tokens, self.count = Counter(), Counter()
        self.ledger, self.window, self.messages = PositionLedger(end=end), MetricsWindow(), []
        self.checks, self.patience = 0, patience  # worker checks before it "fails"
        self.batcher = TokenBudgetBatcher(budget, rows, 1, 0)
        self.queue = SampleQueue(self.groups, self.ledger, self.version, max_staleness,
                                 self.tokens, self.count, self.window,
                                 check_worker=self.check, log=self.messages.append,
                                 stall_positions=stall_positions, stall_timeout=stall_timeout)

    def check(self):
        self.checks += 1
        if self.checks > self.patience:
            raise RuntimeError("worker gone")

    def put(self, position: int, *samples: Sample) -> None:
        self.tokens.value += sum(s.tokens for s in samples)
        self.count.value += len(samples)
        self.groups.put(GroupResult(position, list(samples),
                                    "trained" if samples else "zero_std"))

    def metrics(self) -> dict:
        return self.window.reduce()


def test_queue_fills_a_microbatch_and_carries_the_sample_that_does_not_fit():
    p = Pipeline(budget=16, end=1)
    p.put(0, sample(0), sample(0), sample(0), sample(0, tokens=8))
    first = p.queue.next_microbatch(p.batcher)
    assert [s.tokens for s in first] == [4, 4, 4]  # 12 + 8 > 16: the fourth waits
    assert p.tokens.value == 8 and p.count.value == 1  # taken samples left the counters
    assert p.queue.carried is not None
    second = p.queue.next_microbatch(p.batcher)
    assert [s.tokens for s in second] == [8] and p.tokens.value == 0
    assert p.metrics()["rollout/queue_size"] == (4 + 3 + 2 + 1) / 4
    assert p.ledger.remaining == {0: 4}  # taken, not yet trained: the trainer consumes them


def test_queue_drops_stale_samples_counting_them_and_freeing_their_position():
    p = Pipeline(max_staleness=1, end=2)
    p.put(0, sample(0, version=0), sample(0, version=0))
    p.put(1, sample(1, version=2))
    p.version.value = 2  # two versions later: position 0's samples are stale
    taken = p.queue.next_microbatch(p.batcher)
    assert [s.position for s in taken] == [1]
    assert p.metrics()["sample/dropped_stale_count"] == 2
    assert p.ledger.cursor == 1  # position 0 consumed by its drops
    assert p.tokens.value == 0 and p.count.value == 0


def test_carried_sample_is_judged_stale_again():
    p = Pipeline(budget=8, max_staleness=0)
    p.put(0, sample(0), sample(0), sample(0))
    assert len(p.queue.next_microbatch(p.batcher)) == 2  # 4 + 4 fills the budget of 8
    p.version.value = 1  # a step and a sync pass: the carried sample is now stale
    with pytest.raises(RuntimeError, match="worker gone"):  # nothing else ever arrives
        p.queue.next_microbatch(p.batcher)
    assert p.metrics()["sample/dropped_stale_count"] == 1
    assert p.queue.carried is None and p.ledger.remaining == {0: 2}


def test_oversize_sample_is_dropped_with_a_warning():
    p = Pipeline(budget=8, end=1)
    p.put(0, sample(0, tokens=9), sample(0, tokens=4))
    taken = p.queue.next_microbatch(p.batcher)
    assert [s.tokens for s in taken] == [4]
    assert p.messages == ["warning: dropped a 9-token sample (token_budget 8)"]
    assert p.metrics()["batch/dropped_oversize_count"] == 1


def test_queue_is_exhausted_once_every_position_arrived():
    p = Pipeline(end=2)
    p.put(0, sample(0))
    p.put(1)  # an empty group
    assert len(p.queue.next_microbatch(p.batcher)) == 1
    assert p.queue.exhausted and p.checks == 0  # no waiting on the worker for more
    assert p.queue.next_microbatch(p.batcher) == []


def test_a_fixed_block_comes_in_position_order_whatever_the_arrival_order():
    p = Pipeline(budget=8, end=6)
    p.ledger.arrive(0, 0)  # consumed before a resume: it never arrives again
    p.put(3, sample(3))  # the next block's: parked until its turn
    p.put(2, sample(2, tokens=3), sample(2, tokens=5))
    p.put(1, sample(1, tokens=2), sample(1, tokens=9))  # 9 > budget 8: dropped
    batches = p.queue.next_block(0, 3, p.batcher)
    assert [[(s.position, s.tokens) for s in b] for b in batches] == [[(1, 2), (2, 3)],
                                                                     [(2, 5)]]
    assert p.metrics()["batch/dropped_oversize_count"] == 1
    assert list(p.queue.parked) == [3]
    p.put(5)  # an empty group
    p.put(4, sample(4))
    assert [[s.position for s in b] for b in p.queue.next_block(3, 6, p.batcher)] == [[3, 4]]


def test_an_epoch_of_positions_without_samples_stops_the_run_naming_why():
    from reprorl.grpo.sample_queue import StalledRun

    p = Pipeline(stall_positions=3, patience=3, budget=4)  # one sample fills the row
    p.put(0)
    p.put(1, sample(1))  # one group with signal: trained, the count starts again
    assert [s.position for s in p.queue.next_microbatch(p.batcher)] == [1]
    for position in range(2, 5):
        p.put(position)  # every completion of these groups got the same reward
    with pytest.raises(StalledRun, match=r"3 prompt positions in a row \(an epoch of 3 "
                       r"prompts\) gave no sample to train; what arrived instead: 3 "
                       r"zero_std groups\. GRPO learns only from groups whose rewards differ"):
        p.queue.next_microbatch(p.batcher)


def test_no_trained_sample_for_stall_timeout_stops_the_run():
    from reprorl.grpo.sample_queue import StalledRun

    p = Pipeline(stall_timeout=0.2, patience=10_000)
    started = time.monotonic()
    with pytest.raises(StalledRun, match=r"no sample was trained for 0 s \(stall_timeout=0.2 "
                       r"s\); what arrived instead: nothing\. the worker is alive"):
        p.queue.next_microbatch(p.batcher)
    assert 0.2 <= time.monotonic() - started < 5


def test_queue_counts_the_time_it_waited():
    p = Pipeline(end=1, patience=1000)
    threading.Timer(0.2, p.put, (0, sample(0))).start()
    assert len(p.queue.next_microbatch(p.batcher)) == 1
    assert p.queue.wait_s >= 0.15


# ---------------------------------------------------------------- the worker handle


class FakeProcess:
    """A process that records what is done to it; it dies only when `stubborn` allows."""

    def __init__(self, target=None, args=(), name=None, daemon=None, stubborn=0):
        self.name, self.daemon, self.calls = name, daemon, []
        self.alive, self.exitcode, self.pid, self.stubborn = False, None, 1234, stubborn
        self.env_at_start = None

    def start(self):
        self.env_at_start = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.alive = True

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        self.calls.append("join")
        if self.stubborn <= 0:
            self.alive = False
        self.stubborn -= 1

    def kill(self):
        self.calls.append("kill")
        self.stubborn = 0


def handle(timeout: float = 30.0, process: FakeProcess | None = None):
    signals = WorkerSignals(SimpleNamespace(value=time.time()), threading.Event(),
                            queue.Queue(), threading.Event(), threading.Event())
    context = SimpleNamespace(Process=lambda **kw: process or FakeProcess(**kw))
    return WorkerHandle(context, signals, timeout), signals


def test_worker_is_spawned_with_the_gpu_hidden(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    worker, _ = handle()
    worker.start(target=print, args=())
    assert worker.process.env_at_start == "" and worker.process.daemon
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the trainer's own is restored
    assert worker.pid == 1234 and worker.failure() is None


def test_worker_that_dies_while_starting_is_reported_at_once_with_the_fix():
    worker, signals = handle()
    worker.start(target=print, args=())
    worker.process.alive, worker.process.exitcode = False, 1  # the spawn's import failed
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 1 while starting, before any of "
                       "its own code ran .*: the fix"):
        worker.wait_started("the fix")
    assert time.monotonic() - started < 1
    worker, signals = handle()
    worker.start(target=print, args=())
    signals.started.set()
    worker.wait_started("unused")  # running: returns at once


def test_worker_failure_names_traceback_exit_code_or_silence():
    worker, signals = handle(timeout=30.0)
    worker.start(target=print, args=())
    signals.tracebacks.put("Traceback ...\nValueError: boom")
    signals.failed.set()
    assert worker.failed
    with pytest.raises(RuntimeError, match="rollout worker failed:\nTraceback"):
        worker.raise_if_failed()

    worker, signals = handle()
    worker.start(target=print, args=())
    worker.process.alive, worker.process.exitcode = False, -9
    assert "exited with code -9 without a traceback" in worker.failure()

    worker, signals = handle(timeout=30.0)
    worker.start(target=print, args=())
    signals.heartbeat.value = time.time() - 100
    assert "no heartbeat for 100 s" in worker.failure()


def read_payload(inbox, started, out):
    """A worker that reads its payload and gives it back."""
    started.set()
    with inbox:
        out.put(pickle.loads(inbox.recv_bytes()))


def read_two_parts(inbox, started, out):
    """A worker that reads its payload and then one more part, as the rollout worker does,
    and gives back what it read (or that the pipe ended first)."""
    started.set()
    with inbox:
        first = pickle.loads(inbox.recv_bytes())
        out.put(first)
        try:
            out.put(pickle.loads(inbox.recv_bytes()))
        except EOFError:
            out.put("the pipe ended")


def leave_payload(inbox, started):
    """A worker that exits without reading its payload."""
    started.set()


def test_the_payload_follows_the_start_and_a_worker_dying_unread_blocks_nothing():
    """Arguments over a pipe's buffer reach a live worker, and a part sent later follows
    them (the trainer sends it once its server serves; the worker's silence counts from
    there, as it beats only once it has all); a stop before that part ends the
    waiting worker's pipe, so it exits by itself; a worker that exits unread ends the
    trainer's write (no thread left hanging); an unpicklable one fails before a spawn."""
    context = mp.get_context("spawn")
    payload = {"rows": ["x" * (1 << 17)]}
    signals = WorkerSignals.create(context)
    worker, out = WorkerHandle(context, signals, 60.0), context.Queue()
    worker.start(read_two_parts, (signals.started, out), payload)
    worker.wait_started("unused")
    assert out.get(timeout=60) == payload
    signals.heartbeat.value = time.time() - 1000  # the server took long to come up
    worker.send({"config": "y" * (1 << 17)})
    assert time.time() - signals.heartbeat.value < 60  # not hung: silent from the last part
    assert out.get(timeout=60) == {"config": "y" * (1 << 17)}
    worker.stop()

    signals = WorkerSignals.create(context)
    worker, out = WorkerHandle(context, signals, 60.0), context.Queue()
    worker.start(read_two_parts, (signals.started, out), payload)
    assert out.get(timeout=60) == payload  # read before any wait_started
    process = worker.process
    worker.close_outbox()
    assert out.get(timeout=60) == "the pipe ended"
    process.join(60)
    assert process.exitcode == 0
    worker.stop()

    signals = WorkerSignals.create(context)
    worker = WorkerHandle(context, signals, 60.0)
    worker.start(leave_payload, (signals.started,), payload)
    worker.wait_started("unused")
    worker.process.join(60)
    for thread in [t for t in threading.enumerate() if t.name == "worker-payload"]:
        thread.join(10)
        assert not thread.is_alive()
    worker.stop()

    worker = WorkerHandle(context, WorkerSignals.create(context), 60.0)
    with pytest.raises(Exception, match="pickle"):
        worker.start(leave_payload, (), {"reward": lambda: 0})
    assert worker.process is None and worker.outbox is None


def test_worker_stop_escalates_to_kill():
    """The worker ignores SIGTERM (a cluster's signal to every process of a job: its trainer
    stops it after a checkpoint), so a stop that is not obeyed ends in SIGKILL."""
    worker, signals = handle(process=FakeProcess(stubborn=1))
    worker.start(target=print, args=())
    process = worker.process
    worker.stop()
    assert signals.stop.is_set() and process.calls == ["join", "kill", "join"]
    assert worker.process is None and worker.pid is None
    worker.stop()  # stopped already: nothing to do

    polite, _ = handle()
    polite.start(target=print, args=())
    process = polite.process
    polite.stop()
    assert process.calls == ["join"]

    waiting, _ = handle()  # its server never served
    waiting.start(target=print, args=())
    waiting.waiting, process = True, waiting.process
    waiting.stop()
    assert process.calls == ["kill", "join"]  # nothing to finish: no 10 s grace


def test_a_worker_that_fails_while_the_server_loads_is_reported_then():
    """`check_starting`, which the trainer calls while its server loads: a worker that ran
    and then failed (reading its arguments) or died is reported, not only one that died
    importing; a healthy one, started or not, passes, whatever its heartbeat says."""
    worker, signals = handle()
    worker.start(target=print, args=())
    signals.heartbeat.value = time.time() - 1000
    worker.check_starting("unused")  # not started yet, alive
    signals.started.set()
    worker.check_starting("unused")  # running, silent: it beats once it has its arguments
    signals.tracebacks.put("Traceback ...\nModuleNotFoundError: No module named 'rewards'")
    signals.failed.set()
    with pytest.raises(RuntimeError, match="(?s)rollout worker failed:\nTraceback.*rewards"):
        worker.check_starting("unused")

    worker, signals = handle()
    worker.start(target=print, args=())
    signals.started.set()
    worker.process.alive, worker.process.exitcode = False, -9
    with pytest.raises(RuntimeError, match="exited with code -9 without a traceback"):
        worker.check_starting("unused")


# ---------------------------------------------------------------- weight versions


class RecordingAdmin:
    def __init__(self):
        self.calls = []

    def load_lora_adapter(self, name, path):
        self.calls.append(("load", name, Path(path).name))

    def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))


def test_adapter_versions_keep_the_newest_live(tmp_path):
    admin, version = RecordingAdmin(), SimpleNamespace(value=0)

    def export(directory: Path):
        directory.mkdir(parents=True)
        (directory / "adapter_model.safetensors").write_text("weights")

    checked: list[str] = []
    versions = AdapterVersions(admin, tmp_path, "policy", 2, version, export, checked.append)
    for n in range(4):
        transfer_s, sync_s = versions.publish(n)
        assert 0 <= transfer_s <= sync_s and version.value == n
        # an unloaded version's files outlive it by one publish: a request queued before the
        # unload may still make vLLM reload it from its path
        kept = {0: ["v0"], 1: ["v0", "v1"], 2: ["v0", "v1", "v2"], 3: ["v1", "v2", "v3"]}[n]
        assert sorted(p.name for p in tmp_path.iterdir()) == kept
    assert list(versions.live) == [2, 3] and versions.retired == [1]
    assert checked == ["policy-v0", "policy-v1", "policy-v2", "policy-v3"]  # each after its load
    assert admin.calls[:4] == [("load", "policy-v0", "v0"), ("load", "policy-v1", "v1"),
                               ("load", "policy-v2", "v2"), ("unload", "policy-v0")]
    assert ("unload", "policy-v1") in admin.calls and ("unload", "policy-v2") not in admin.calls
    assert versions.close() == [] and admin.calls[-2:] == [("unload", "policy-v2"),
                                                           ("unload", "policy-v3")]
    assert not versions.live


def test_a_sync_check_that_fails_leaves_the_version_unserved_but_unloadable(tmp_path):
    admin, version = RecordingAdmin(), SimpleNamespace(value=0)

    def check(name: str):
        if name.endswith("-v1"):
            raise RuntimeError(f"weight sync check failed for {name}")

    versions = AdapterVersions(admin, tmp_path, "policy-ab12", 2, version,
                               lambda d: d.mkdir(parents=True), check)
    versions.publish(0)
    with pytest.raises(RuntimeError, match="policy-ab12-v1"):
        versions.publish(1)
    assert version.value == 0  # the worker never samples under the unproven version
    assert versions.close() == [] and admin.calls[-2:] == [("unload", "policy-ab12-v0"),
                                                           ("unload", "policy-ab12-v1")]


def test_load_failures_say_what_to_fix_from_vllms_recorded_answers():
    """The client's message for each failure a real vLLM answered (its recorded bodies)."""
    import json

    import vllm_responses

    from reprorl.serve.client import load_failure

    recorded = json.loads(vllm_responses.RECORDED.read_text())

    def message(key: str) -> str:
        answer = recorded[key]
        return load_failure("http://s", "policy-ab-v1", "/runs/a/v1", answer["status"],
                            json.dumps(answer["body"]))

    assert "found no adapter at /runs/a/v1" in message("load_missing_path")
    assert "same path" in message("load_missing_path")  # not "start vLLM with --enable-lora"
    assert "Restart it with a --max-lora-rank" in message("load_rank_too_large")
    assert "already holds an adapter named policy-ab-v1" in message("load_twice")
    assert "start vLLM with --enable-lora" in load_failure(
        "http://s", "x", "/p", 404, '{"detail": "Not Found"}')  # no such route


def test_server_limits_read_from_metrics_refuse_what_cannot_hold_the_run():
    from reprorl.grpo.weight_sync import refuse_unfit_server
    from reprorl.serve.client import parse_prometheus

    one = ('vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
           'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
           'waiting_lora_adapters=""} 1.7e+09\n')
    metrics = parse_prometheus(one)
    assert metrics["engines"] == {"0"} and metrics["max_loras"] == 4
    refuse_unfit_server("http://s", metrics, 4)  # max_staleness 2: fits exactly
    with pytest.raises(RuntimeError, match="--max-loras 5 or more"):
        refuse_unfit_server("http://s", metrics, 5)
    two = one + 'vllm:num_requests_running{engine="1",model_name="m"} 0.0\n'
    with pytest.raises(RuntimeError, match="2 engine cores .*--data-parallel-size 1"):
        refuse_unfit_server("http://s", parse_prometheus(two), 2)
    refuse_unfit_server("http://s", None, 9)  # no /metrics: nothing to judge by


# ---------------------------------------------------------------- the trainer's surface


def test_reward_models_by_id_or_object_are_refused_up_front():
    import torch

    from reprorl.grpo.launch import reward_functions

    assert reward_functions(None) == [] and reward_functions(len) == [len]
    for given, words in (("trl-lib/reward-model", "the model id 'trl-lib/reward-model'"),
                         ([len, Path("rm")], "the model id 'rm'"),
                         (torch.nn.Linear(2, 1), "a Linear model"),
                         ([3], "a int, which is not callable")):
        with pytest.raises(TypeError, match=words):
            reward_functions(given)


def test_peft_config_is_honoured_or_refused_field_by_field():
    from peft import LoraConfig

    from reprorl.grpo.policy import refuse_unsupported_peft

    refuse_unsupported_peft(None)
    refuse_unsupported_peft(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    refuse_unsupported_peft(LoraConfig(r=4, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with pytest.raises(ValueError) as refused:
        refuse_unsupported_peft(LoraConfig(r=4, lora_dropout=0.05, use_rslora=True,
                                           modules_to_save=["lm_head"]))
    message = str(refused.value)
    for field in ("lora_dropout=0.05", "use_rslora=True", "modules_to_save=",
                  "target_modules=None"):
        assert field in message, message
    with pytest.raises(ValueError, match=r"target_modules=\{'q_proj'\}|target_modules=\['q_"):
        refuse_unsupported_peft(LoraConfig(target_modules=["q_proj"]))


def test_no_reward_source_is_refused_at_train_before_any_process(tiny_model, tmp_path):
    from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), embedded_server=True)
    rows = [{"prompt": [{"role": "user", "content": "q"}]}]
    trainer = AsyncGRPOTrainer(str(tiny_model), None, args, rows, log=lambda m: None)
    with pytest.raises(ValueError, match="nothing scores a completion"):
        trainer.train()
    assert not (tmp_path / "out").exists() and trainer.server is None


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_training_mode_is_the_seeds_inside_and_the_callers_after(gradient_checkpointing):
    """Inside: dropout off, checkpointing as asked, train() only with checkpointing. After, on
    success or on an error: the caller's mode and checkpointing, as the model was given."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reprorl.grpo.policy import checkpointing_on, training_mode

    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.1)).eval()
    for failing in (False, True):
        with contextlib.suppress(RuntimeError):
            with training_mode(model, gradient_checkpointing):
                assert model.training is gradient_checkpointing
                assert checkpointing_on(model) is gradient_checkpointing
                assert all(module.attention_dropout == 0.0 for module in model.modules()
                           if hasattr(module, "attention_dropout"))
                if failing:
                    raise RuntimeError("a failed run")
        assert model.training is False and checkpointing_on(model) is False
