"""Crash safety: SIGKILL each training stage at random points, resume with --rerun-incomplete.

The stages under test are built once, uninterrupted (the reference). Then, per kill point,
Snakemake is started on the stage's target in a fresh copy of the reference and the whole
process group is killed at a random moment of the job: once the job has started (its log
exists), after a random fraction of its reference duration. A kill that arrives after the job
finished is a miss and is drawn again, so every recorded kill point landed mid-job. Right
after the kill, every file present under an output's final name must be byte-identical to the
reference's (no partial artifact is ever visible), and after `snakemake --unlock` and
`--rerun-incomplete` the stage's manifest must equal the reference's (hashed section). Async
GRPO is held to the same rule: on its fixed schedule a run replays bit for bit.
The kill points of every stage are printed in pytest's terminal summary.

In-rule checkpoints (`core/preempt.py`): each stage under test is stopped several times in one
working folder, by SIGTERM (what SLURM sends every process of a job at its time limit: a GRPO
run's server and worker get it too) and by SIGKILL, each at a random step, each stop followed
by `--rerun-incomplete`; the finished stage's files must be the uninterrupted run's, and all
its attempts together must have computed fewer than twice its steps. Steps count from where the
stage starts (a resume, from its interrupt); a stage with fewer safe points than stops (a short
GRPO run checkpoints at its windows' ends) takes the stops it has room for.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CRASH_REPORT, PREEMPT_REPORT, copy_workflow

from reprorl.core.manifest import read_json, sha256_file, sha256_json
from reprorl.core.stages import EXPORTS, MODES

pytestmark = pytest.mark.e2e
CI = ["--configfile", "configs/ci.yaml"]
# Training stages killed in the suite: every mode and every algorithm at least once (a stage's
# manifest is the target that makes Snakemake run exactly that stage). For all sixteen
# training stages set REPRORL_CRASH_STAGES=all (or a comma-separated list of stages); for more
# kill points REPRORL_CRASH_KILLS=N.
ALL_TRAINING = ["base_model", *(f"{b}_{m}" for b in EXPORTS for m in MODES)]
CHOSEN = os.environ.get("REPRORL_CRASH_STAGES", "")  # "all", or names separated by commas
STAGES = (ALL_TRAINING if CHOSEN == "all" else CHOSEN.split(",") if CHOSEN else
          ["base_model", "sft_interrupt", "reward_continuous", "ppo_resume",
           "grpo_learned_resume"])
KILLS_PER_STAGE = int(os.environ.get("REPRORL_CRASH_KILLS", "2"))
TRACKED = ("data", "assets", "outputs")


def _env(workdir: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(workdir / "src"), PYTHONDONTWRITEBYTECODE="1")


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args, *CI],
                          cwd=workdir, env=_env(workdir), capture_output=True, text=True,
                          timeout=900, check=False)


def _files(workdir: Path) -> dict[str, str]:
    """sha256 of every file under a final name; a manifest counts by its hashed section (its
    run section holds timings). Temporary files and folders (".tmp") and Snakemake's own are
    left out."""
    files = {}
    for top in TRACKED:
        for path in (workdir / top).rglob("*"):
            temporary = any(part.endswith(".tmp") or part == "scratch" for part in path.parts)
            if not path.is_file() or temporary or "benchmarks" in path.parts \
                    or path.name == ".snakemake_timestamp":
                continue
            name = str(path.relative_to(workdir))
            if "manifests" in path.parts:
                files[name] = sha256_json(read_json(path)["hashed"])
            else:
                files[name] = sha256_file(path)
    return files


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of every stage under test, and its files."""
    workdir = copy_workflow(tmp_path_factory.mktemp("crash-reference") / "wf")
    result = _snakemake(workdir, *[f"outputs/manifests/{s}.json" for s in STAGES])
    assert result.returncode == 0, result.stdout + result.stderr
    return workdir, _files(workdir)


def _upstream_ready(reference_dir: Path, destination: Path) -> Path:
    """A copy of the reference project: its code (not the checkout's, which may have moved on
    since), files, times and Snakemake's records."""
    return copy_workflow(destination, reference_dir, ("data", "assets", "outputs", ".snakemake"))


def _kill_mid_job(workdir: Path, stage: str, latest: float, rng: random.Random,
                  forcerun: bool) -> float | None:
    """Start Snakemake on the stage, SIGKILL its process group at a random moment up to
    `latest` seconds after the job started; the delay, or None when the job had already
    finished (a miss). The whole group must be gone afterwards (server and worker too)."""
    target = f"outputs/manifests/{stage}.json"
    log = workdir / f"logs/{stage}.log"
    command = [sys.executable, "-m", "snakemake", "--cores", "2", target]
    if forcerun:  # the target before --forcerun, which takes several values
        command += ["--forcerun", stage]
    process = subprocess.Popen([*command, *CI], cwd=workdir, env=_env(workdir),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.monotonic() + 120
    while not log.exists():
        assert process.poll() is None and time.monotonic() < deadline, f"{stage} never started"
        time.sleep(0.05)
    delay = rng.uniform(0.02, 1.0) * latest
    time.sleep(delay)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    deadline = time.monotonic() + 10
    while _process_group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _process_group_alive(process.pid), "a child process survived the kill"
    return None if (workdir / target).exists() else round(delay, 2)


def _kill_points(reference_dir: Path, stage: str, tmp_path: Path, check_after_kill):
    """KILLS_PER_STAGE kills that landed mid-job, each followed by the user's recovery
    (`--unlock`, `--rerun-incomplete`). The reference time was measured beside other jobs, so
    a job alone may finish sooner: a miss is drawn again, each time within a shorter span."""
    rng = random.Random(f"{stage}-kills")
    seconds = float((reference_dir / f"outputs/benchmarks/{stage}.tsv").read_text()
                    .splitlines()[1].split()[0])
    target = f"outputs/manifests/{stage}.json"
    landed, misses = [], 0
    while len(landed) < KILLS_PER_STAGE:
        workdir = _upstream_ready(reference_dir, tmp_path / f"kill{len(landed) + misses}")
        delay = _kill_mid_job(workdir, stage, 0.95 * 0.7**misses * seconds, rng, forcerun=True)
        if delay is None:
            misses += 1
            assert misses <= 3 * KILLS_PER_STAGE, f"{stage}: the job kept finishing first"
            continue
        landed.append(delay)
        check_after_kill(workdir)
        assert _snakemake(workdir, "--unlock", target).returncode == 0
        result = _snakemake(workdir, "--rerun-incomplete", target)
        assert result.returncode == 0, result.stdout + result.stderr
        yield workdir
    CRASH_REPORT[stage] = {"kill_points": len(landed), "seconds_into_job": landed,
                           "misses_redrawn": misses, "reference_job_s": seconds}


@pytest.mark.parametrize("stage", STAGES)
def test_sigkill_then_rerun_incomplete_equals_uninterrupted(reference, stage, tmp_path):
    reference_dir, reference_files = reference
    expected = read_json(reference_dir / f"outputs/manifests/{stage}.json")["hashed"]

    def nothing_partial(workdir: Path) -> None:
        for name, digest in _files(workdir).items():
            assert reference_files.get(name) == digest, f"{name} differs after the kill"

    for workdir in _kill_points(reference_dir, stage, tmp_path, nothing_partial):
        assert read_json(workdir / f"outputs/manifests/{stage}.json")["hashed"] == expected


PREEMPTED = STAGES  # the stages whose in-rule checkpoints are tested
STOPS = (signal.SIGTERM, signal.SIGKILL, signal.SIGTERM, signal.SIGKILL)
EVERY = 3  # checkpoint_every of the stopped runs, in steps (the reference ran with the default)


def _work(workdir: Path, stage: str) -> list[str]:
    """The stage's work log (`preempt.py`): a `start N` line per attempt, a line per step."""
    logs = list((workdir / "assets/scratch").glob(f"{stage}-*/work.log"))
    return logs[0].read_text().splitlines() if logs else []


def _position(lines: list[str]) -> int:
    """The step the latest attempt has reached."""
    starts = [i for i, line in enumerate(lines) if line.startswith("start")]
    if not starts:
        return 0
    return int(lines[starts[-1]].split()[1]) + sum(
        line.isdigit() for line in lines[starts[-1]:])


def _stop_at(workdir: Path, stage: str, step: int, signum: int, first: bool) -> int:
    """Start Snakemake on the stage, send `signum` to its whole process group once the stage
    has reached `step`; returns the step the signal found it at."""
    target = f"outputs/manifests/{stage}.json"
    how = ["--forcerun", stage] if first else ["--rerun-incomplete"]
    process = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "2", target, *how,
         "--config", f"checkpoint_every={EVERY}", *CI], cwd=workdir, env=_env(workdir),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while (reached := _position(_work(workdir, stage))) < step:
        assert process.poll() is None, f"{stage} ended before step {step}"
        assert time.monotonic() < deadline, f"{stage} never reached step {step}"
        time.sleep(0.01)
    os.killpg(process.pid, signum)
    assert process.wait(timeout=120) != 0
    deadline = time.monotonic() + 10
    while _process_group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _process_group_alive(process.pid), "a child process survived the stop"
    assert not (workdir / target).exists()
    return reached


@pytest.mark.parametrize("stage", PREEMPTED)
def test_stopped_stages_continue_from_their_checkpoints(reference, stage, tmp_path):
    reference_dir, reference_files = reference
    manifest = read_json(reference_dir / f"outputs/manifests/{stage}.json")
    work = manifest["run"]["in_rule_checkpoints"]
    steps = work["steps_computed"]  # uninterrupted: all of them
    first, end = work["continued_from_step"], work["continued_from_step"] + steps
    if steps == 0:  # e.g. the CI's verifier GRPO run, whose groups all drop
        pytest.skip(f"{stage} computes no step in this profile: nothing to stop")
    workdir = _upstream_ready(reference_dir, tmp_path / "wf")
    rng, stops = random.Random(f"{stage}-stops"), []
    for number, signum in enumerate(STOPS):
        done = _position(_work(workdir, stage)) if number else first
        if end - done < 2:  # a stage with fewer safe points than stops (a GRPO run's
            break  # windows): it checkpointed at its end, no later step to stop at
        room = (end - done) // (len(STOPS) - number + 1)
        step = done + rng.randint(1, max(1, room))
        reached = _stop_at(workdir, stage, step, signum, first=number == 0)
        lines = _work(workdir, stage)
        if signum == signal.SIGTERM:  # the checkpoint is written at the next step: none lost
            assert lines[-1].startswith("stop") and lines[-1].split()[1] == lines[-2]
        stops.append((signal.Signals(signum).name, reached))
        assert _snakemake(workdir, "--unlock").returncode == 0
    result = _snakemake(workdir, "--rerun-incomplete", f"outputs/manifests/{stage}.json")
    assert result.returncode == 0, result.stdout + result.stderr
    finished = read_json(workdir / f"outputs/manifests/{stage}.json")
    assert finished["hashed"] == manifest["hashed"]
    files = _files(workdir)
    assert {n: d for n, d in files.items() if n in reference_files} == {
        n: reference_files[n] for n in files if n in reference_files}
    assert not list((workdir / "assets/scratch").glob("*"))  # gone once the stage is complete
    work = finished["run"]["in_rule_checkpoints"]
    assert work["attempts"] == len(stops) + 1 and work["steps_computed"] < 2 * steps
    PREEMPT_REPORT[stage] = {"stops": stops, "steps": steps,
                             "steps_computed": work["steps_computed"]}


def _process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
