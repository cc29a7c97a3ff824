#!/usr/bin/env bash
# The GPU check of the device layer, in one run of under 10 minutes on one GPU:
#  1. the CI profile end to end on the GPU (model.device cuda, BF16 base; the embedded server
#     of both GRPO runs on the GPU too), in a scratch copy of this checkout, and every resume
#     check must PASS;
#  2. every stage's wall time and peak GPU memory, from the manifests (`reprorl costs`);
#  3. one PPO iteration and one GRPO step of a random model at the 0.5B dimensions
#     (benchmarks/gpu_dims.py), with their times and peak GPU memory, its JSON line last.
# It needs reprorl's dependencies beside a CUDA build of torch: `pip install -e .` of this
# checkout, or, where nothing can be downloaded, the wheels benchmarks/gpu_wheels.sh saved in
# .whl/ (installed here into a scratch folder, with src/ on the path). Usage, from the root:
#   benchmarks/gpu_check.sh [device] [dtype] [layers]  # defaults: cuda bfloat16 24
#   benchmarks/gpu_check.sh cpu float32 2             # the same steps on a CPU (a dry run)
set -euo pipefail
device=${1:-cuda}
dtype=${2:-bfloat16}
layers=${3:-24}
root=$(pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
python=${PYTHON:-python3}
# the rules run `python -m reprorl`: make `python` this interpreter (a wrapper, not a link,
# which would lose a virtual environment's packages)
mkdir -p "$work.bin"
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$python")" > "$work.bin/python"
chmod +x "$work.bin/python"
export PATH="$work.bin:$PATH"
if [ -d .whl ]; then
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --no-cache-dir --target "$work.site" .whl/*
    export PYTHONPATH="$work.site:$root/src${PYTHONPATH:+:$PYTHONPATH}"
fi

"$python" - "$device" <<'EOF'
import sys

import torch

from reprorl.core import devices

device = devices.prepare(sys.argv[1])  # refuses a missing or BF16-less GPU, with the fix
name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
print(f"gpu_check: torch {torch.__version__} on {device} ({name})", flush=True)
EOF

# a copy of the checkout without what a run writes: the check writes assets/ and outputs/ of
# its own (the tracked files where git can list them)
if git rev-parse --git-dir > /dev/null 2>&1; then
    git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$work"
else
    tar --exclude=./.git --exclude=./.whl --exclude=./assets --exclude=./outputs --exclude=./data \
        --exclude=./logs --exclude=./.snakemake -cf - . | tar -xf - -C "$work"
fi
cd "$work"
started=$(date +%s)
"$python" -m snakemake --cores all outputs/results.json --configfile configs/ci.yaml \
    --config model="{device: $device, dtype: $dtype}" > snakemake.log 2>&1 ||
    { tail -40 snakemake.log; echo "gpu_check: the CI profile failed (log: $work)"; exit 1; }
echo "gpu_check: CI profile on $device in $(( $(date +%s) - started )) s"

"$python" - <<'EOF'
import json
from pathlib import Path

from reprorl.pipeline.evaluate import costs

checks = sorted(Path("outputs/learning").glob("*/resume-check.json"))
statuses = {path.parent.name: json.loads(path.read_text())["status"] for path in checks}
print("gpu_check: resume checks", statuses)
stages = costs()
print(f"{'stage':32} {'wall s':>8} {'GPU alloc MB':>13} {'GPU resv MB':>12}")
for stage, run in stages.items():
    print(f"{stage:32} {run['wall_seconds']:8.1f} {run.get('gpu_peak_allocated_mb', '-'):>13}"
          f" {run.get('gpu_peak_reserved_mb', '-'):>12}")
if len(statuses) != 5 or set(statuses.values()) != {"PASS"}:
    raise SystemExit(f"gpu_check: not every resume check PASSed: {statuses}")
EOF

echo "gpu_check: scratch copy in $work; the 0.5B dimensions next, their JSON line last"
"$python" "$root/benchmarks/gpu_dims.py" --device "$device" --layers "$layers"
