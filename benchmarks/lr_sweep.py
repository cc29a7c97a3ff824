"""A short learning-rate sweep of SFT, measured on SFT's validation split only.

    python benchmarks/lr_sweep.py --scratch /tmp/sweep --rates 2e-5 1e-4 5e-4 2e-3 \
        --configfile configs/smollm2-135m.yaml configs/smollm2-135m-cpu.yaml

For each rate, a copy of this checkout runs `snakemake <sft_continuous's report>` with the
profile and `--config sft='{learning_rate: R}'` (Snakemake merges it over the profile), so the
straight SFT run is the pipeline's own at that rate. The validation loss after each epoch is
the token loss of the 180 validation pairs' chosen answers (or the profile's cut of them): the
only figure read, never a test or probe row. Prints one line per rate, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("Snakefile", "rules", "workflow", "configs", "src")
REPORT = "outputs/learning/sft/continuous.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--rates", type=float, nargs="+", required=True)
    parser.add_argument("--configfile", nargs="+", required=True)
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for rate in args.rates:
        folder = args.scratch / f"lr-{rate:g}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for part in PARTS:
            source = ROOT / part
            if source.is_dir():
                shutil.copytree(source, folder / part, symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, folder / part)
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "snakemake", "--cores", str(args.cores), REPORT,
             "--configfile", *args.configfile, "--config", f"sft={{learning_rate: {rate}}}"],
            cwd=folder, check=True, env={**os.environ, "PYTHONPATH": str(folder / "src")},
            stdout=subprocess.DEVNULL)
        report = json.loads((folder / REPORT).read_text())
        losses = [round(entry["loss"], 4) for entry in report["validation_history"]]
        rows.append({"learning_rate": rate, "validation_loss_by_epoch": losses,
                     "last_train_loss": round(report["history"][-1]["loss"], 4),
                     "seconds": round(time.perf_counter() - started, 1)})
        print(f"lr {rate:g}: validation loss by epoch {losses}, "
              f"{rows[-1]['seconds']} s (base model conversion included)", flush=True)
        shutil.rmtree(folder / "assets")  # 0.5 GB of weights each
    best = min(rows, key=lambda row: row["validation_loss_by_epoch"][-1])
    print(json.dumps({"profile": args.configfile, "rates": rows,
                      "lowest_validation_loss_at": best["learning_rate"]}))


if __name__ == "__main__":
    main()
