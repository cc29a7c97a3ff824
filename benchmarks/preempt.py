"""What in-rule checkpoints cost and what a kill loses, on one default-profile stage.

    python benchmarks/preempt.py --from <a finished default run's folder> [--stage ppo_continuous]
    python benchmarks/preempt.py --dag <a finished default run's folder>

`--dag` reads the run's manifests: each training stage's seconds spent writing in-rule
checkpoints (`in_rule_checkpoints.writing_seconds`) against every stage's wall seconds, the
checkpoints' share of the whole DAG's work; last one JSON line.

In a scratch folder holding this checkout's code and the run's files the stage's command runs,
alternating: with no in-rule checkpoint (`--checkpoint-every 0`) and with the default (`60s`),
twice each; then with the default, killed (SIGKILL, then SIGTERM) at half its uninterrupted
time and rerun to the end. Every run must end with the first run's outputs (its manifest's
hashed section). Prints each run's seconds, the overhead ratio and the time each kill lost,
last one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from reprorl.core import config as configuration
from reprorl.core import layout, stages
from reprorl.core.manifest import read_json

ROOT = Path(__file__).resolve().parents[1]
CODE = ("Snakefile", "rules", "workflow", "configs", "src")  # this checkout's
RUN = ("data", "assets", "outputs")  # the finished run's (its seeds left out)


def clear(workdir: Path, stage: str, config: dict) -> None:
    """The stage's outputs and scratch gone, so its command runs again."""
    for value in stages.outputs(stage, config).values():
        for path in value if isinstance(value, list) else [value]:
            target = workdir / path
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    shutil.rmtree(workdir / layout.STAGE_SCRATCH, ignore_errors=True)


def command(stage: str, every: str) -> list[str]:
    return [sys.executable, "-m", "reprorl", stage, "--config", "configs/default.yaml",
            "--checkpoint-every", every]


def run(workdir: Path, stage: str, every: str, stop_after: float | None = None,
        signum: int = signal.SIGKILL) -> tuple[float, int]:
    """One run of the stage's command; (seconds, exit status)."""
    env = dict(os.environ, PYTHONPATH=str(workdir / "src"))
    started = time.perf_counter()
    process = subprocess.Popen(command(stage, every), cwd=workdir, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        status = process.wait(timeout=stop_after)
    except subprocess.TimeoutExpired:
        process.send_signal(signum)
        status = process.wait()
    return time.perf_counter() - started, status


def dag(folder: Path) -> None:
    """The in-rule checkpoints' share of a finished run's stage time, stage by stage."""
    rows, total, writing = [], 0.0, 0.0
    for manifest in sorted((folder / layout.MANIFESTS).glob("*.json")):
        run = read_json(manifest)["run"]
        total += run["wall_seconds"]
        work = run.get("in_rule_checkpoints")
        if work is None:
            continue
        writing += work["writing_seconds"]
        rows.append({"stage": manifest.stem, "wall_s": round(run["wall_seconds"], 1),
                     "written": work["written"], "writing_s": work["writing_seconds"]})
        print(f"{manifest.stem:28} {run['wall_seconds']:8.1f} s  {work['written']:3} "
              f"checkpoints  {work['writing_seconds']:6.2f} s writing", flush=True)
    print(json.dumps({"stages": rows, "training_stages": len(rows),
                      "stage_wall_seconds": round(total, 1),
                      "writing_seconds": round(writing, 3),
                      "overhead_share": round(writing / total, 5)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="origin", type=Path)
    parser.add_argument("--dag", type=Path, help="a finished default run's folder")
    parser.add_argument("--stage", default="ppo_continuous")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/reprorl-preempt"))
    args = parser.parse_args()
    if args.dag is not None:
        return dag(args.dag)
    if args.origin is None:
        parser.error("give --from <a finished default run's folder>, or --dag <one>")
    workdir, stage = args.workdir, args.stage
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    for origin, parts in ((ROOT, CODE), (args.origin, RUN)):
        for part in parts:
            source = origin / part
            if source.is_dir():
                shutil.copytree(source, workdir / part, symlinks=True,
                                ignore=shutil.ignore_patterns("seeds", "__pycache__"))
            else:
                shutil.copy2(source, workdir / part)
    config = configuration.load(workdir / "configs/default.yaml")
    expected = {}

    def finished() -> None:
        """The first run's outputs (manifest's hashed section) are every later run's."""
        hashed = read_json(workdir / layout.manifest(stage))["hashed"]
        assert expected.setdefault("hashed", hashed) == hashed, f"{stage}: other outputs"

    seconds: dict[str, list[float]] = {"none": [], "default": []}
    for _ in range(2):
        for name, every in (("none", "0"), ("default", "60s")):
            clear(workdir, stage, config)
            took, status = run(workdir, stage, every)
            assert status == 0, f"{stage} failed ({status})"
            finished()
            seconds[name].append(took)
            print(f"{stage} checkpoint_every {every}: {took:.1f} s", flush=True)
    whole = min(seconds["default"])
    kills = {}
    for signum in (signal.SIGKILL, signal.SIGTERM):
        clear(workdir, stage, config)
        first, status = run(workdir, stage, "60s", stop_after=whole / 2, signum=signum)
        assert status != 0, f"{stage} ended before the {signum.name}"
        second, status = run(workdir, stage, "60s")
        assert status == 0, f"{stage} failed after the {signum.name} ({status})"
        finished()
        work = read_json(workdir / layout.manifest(stage))["run"]["in_rule_checkpoints"]
        kills[signum.name] = {"killed_at_s": round(first, 1), "rerun_s": round(second, 1),
                              "lost_s": round(first + second - whole, 1),
                              "continued_from_step": work["continued_from_step"],
                              "steps_computed": work["steps_computed"]}
        print(f"{signum.name} at {first:.1f} s, rerun {second:.1f} s: "
              f"{first + second - whole:.1f} s lost of {whole:.1f} s", flush=True)
    overhead = min(seconds["default"]) / min(seconds["none"])
    print(json.dumps({"stage": stage, "seconds": seconds, "overhead_ratio": round(overhead, 4),
                      "kills": kills}))


if __name__ == "__main__":
    main()
