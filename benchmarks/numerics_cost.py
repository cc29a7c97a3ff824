"""What portable numerics cost: the default DAG in `native` and in `portable` mode, side by side.

    python benchmarks/numerics_cost.py --scratch /tmp/cost [--profile configs/default.yaml]

Clones this checkout's HEAD twice into the scratch folder, runs `snakemake --cores all` on the
profile in each, one after the other (native first), each with `--config numerics=<mode>`,
and times the whole Snakemake process and every stage (from the manifests). Both clones are
kept: the portable one is a fresh run of the README's profile. Prints each stage's ratio and,
last, one JSON line with the whole DAG's ratio portable / native.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

MODES = ("native", "portable")


def cpu() -> str:
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return (f"{fields.get('model name', platform.processor())}, family {fields.get('cpu family')}"
            f" model {fields.get('model')}")


def run(clone: Path, profile: str, mode: str, cores: str) -> dict:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", cores,
                             "--configfile", profile, "--config", f"numerics={mode}"],
                            cwd=clone, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    (clone / "snakemake-numerics-cost.log").write_text(result.stdout + result.stderr)
    if result.returncode:
        raise SystemExit(f"{mode}: snakemake failed, see {clone / 'snakemake-numerics-cost.log'}")
    stages = {}
    for path in sorted((clone / "outputs/manifests").glob("*.json")):
        stages[path.stem] = json.loads(path.read_text())["run"]["wall_seconds"]
    return {"seconds": seconds, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", type=Path, required=True, help="an empty folder")
    parser.add_argument("--profile", default="configs/default.yaml")
    parser.add_argument("--cores", default="all")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    args.scratch.mkdir(parents=True, exist_ok=True)
    timed = {}
    for mode in MODES:
        clone = args.scratch / mode
        if clone.exists():
            raise SystemExit(f"{clone} exists: give an empty --scratch")
        subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)
        timed[mode] = run(clone, args.profile, mode, args.cores)
        print(f"{mode}: {timed[mode]['seconds']:.0f} s of Snakemake", flush=True)
    native, portable = timed["native"]["stages"], timed["portable"]["stages"]
    for stage in sorted(native, key=native.get, reverse=True):
        if stage in portable and native[stage] > 0:
            print(f"{stage:32s} {native[stage]:8.1f} s {portable[stage]:8.1f} s "
                  f"{portable[stage] / native[stage]:6.2f}x")
    print(json.dumps({
        "commit": commit, "cpu": cpu(), "profile": args.profile, "cores": args.cores,
        "native_s": round(timed["native"]["seconds"], 1),
        "portable_s": round(timed["portable"]["seconds"], 1),
        "stage_sum_native_s": round(sum(native.values()), 1),
        "stage_sum_portable_s": round(sum(portable.values()), 1),
        "ratio_portable_over_native": round(timed["portable"]["seconds"]
                                            / timed["native"]["seconds"], 3)}))


if __name__ == "__main__":
    main()
