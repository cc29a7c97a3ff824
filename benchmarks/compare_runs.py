"""Compare two runs of the pipeline bit for bit: every tensor of every checkpoint, snapshot and
resume state under `assets/` (the base model's weights too), and `outputs/results-rows.csv`.

    python benchmarks/compare_runs.py RUN_A RUN_B

RUN_A and RUN_B are two working directories in which the same target ran (for example the CI
profile from two commits, on the same machine: bits depend on the CPU). Resume states
(`*.pt.gz`) are compared tensor by tensor, not byte by byte: they also hold the code's hash,
which differs between commits by design. Prints what differs, and last one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def tensors(value, prefix: str = ""):
    """Every tensor inside `value` (nested dicts, lists and tuples), by its path."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensors(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from tensors(item, f"{prefix}/{index}")


def load(path: Path):
    if path.name.endswith(".pt.gz"):
        with gzip.open(path, "rb") as file:
            return torch.load(io.BytesIO(file.read()), map_location="cpu", weights_only=False)
    if path.suffix == ".safetensors":
        return load_file(path)
    return None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = a.contiguous().view(-1), b.contiguous().view(-1)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8)) if a.numel() else True


def files(root: Path) -> list[Path]:
    return sorted(path.relative_to(root) for path in (root / "assets").rglob("*")
                  if path.is_file() and not path.name.startswith(".snakemake"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    listed_a, listed_b = files(args.a), files(args.b)
    if listed_a != listed_b:
        raise SystemExit(f"the runs hold other files: {sorted(set(listed_a) ^ set(listed_b))}")
    compared = count = 0
    different = []
    for relative in listed_a:
        state_a, state_b = load(args.a / relative), load(args.b / relative)
        if state_a is None:
            continue
        found_a, found_b = dict(tensors(state_a)), dict(tensors(state_b))
        if found_a.keys() != found_b.keys():
            different.append(f"{relative}: other tensor names")
            continue
        compared += 1
        for key, tensor in found_a.items():
            count += 1
            if not same_bits(tensor, found_b[key]):
                different.append(f"{relative}{key}")
    rows_a = (args.a / "outputs/results-rows.csv").read_bytes()
    rows_b = (args.b / "outputs/results-rows.csv").read_bytes()
    for line in different:
        print("differs:", line)
    print(json.dumps({"files_with_tensors": compared, "tensors": count,
                      "different_tensors": len(different),
                      "results_rows_identical": rows_a == rows_b,
                      "results_rows_sha256": hashlib.sha256(rows_a).hexdigest()}))


if __name__ == "__main__":
    main()
