"""Compare two runs of the pipeline bit for bit: every tensor of every checkpoint, snapshot and
resume state under `assets/` (the base model's weights too), and `outputs/results-rows.csv`.

    python benchmarks/compare_runs.py RUN_A RUN_B          # two working directories
    python benchmarks/compare_runs.py RUN --write FILE     # a run's digests, to compare later
    python benchmarks/compare_runs.py RUN FILE             # a run against digests written so

A run is a working directory in which a target ran (the CI profile, say). Each tensor is
digested with its dtype and shape; resume states (`*.pt.gz`) are compared tensor by tensor, not
byte by byte, since they also hold the code's hash, which differs between commits by design. A
digest file lets two machines be compared (bits depend on the CPU's kernels). Prints what
differs, and last one JSON line.
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


def digest(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().view(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    header = f"{tensor.dtype} {tuple(tensor.shape)}\0".encode()
    return hashlib.sha256(header + data).hexdigest()


def digests(run: Path) -> dict:
    """{"tensors": {file: {tensor path: sha256}}, "results_rows": sha256} of a run."""
    files = {}
    for path in sorted(p for p in (run / "assets").rglob("*") if p.is_file()):
        state = load(path)
        if state is not None:
            files[path.relative_to(run).as_posix()] = {key: digest(tensor)
                                                       for key, tensor in tensors(state)}
    rows = hashlib.sha256((run / "outputs/results-rows.csv").read_bytes()).hexdigest()
    return {"tensors": files, "results_rows": rows}


def differences(a: dict, b: dict) -> list[str]:
    found = [f"{name}: in one run only"
             for name in sorted(a["tensors"].keys() ^ b["tensors"].keys())]
    for name in sorted(a["tensors"].keys() & b["tensors"].keys()):
        ours, theirs = a["tensors"][name], b["tensors"][name]
        found += [f"{name}{key}" for key in sorted(ours.keys() | theirs.keys())
                  if ours.get(key) != theirs.get(key)]
    if a["results_rows"] != b["results_rows"]:
        found.append("outputs/results-rows.csv")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("other", type=Path, nargs="?",
                        help="a second run's folder, or a digest file written by --write")
    parser.add_argument("--write", type=Path, help="write the run's digests to this file")
    args = parser.parse_args()
    ours = digests(args.run)
    if args.write:
        args.write.write_text(json.dumps(ours, indent=1, sort_keys=True) + "\n")
    if args.other is None:
        if not args.write:
            parser.error("give a second run, a digest file, or --write FILE")
        return
    theirs = (json.loads(args.other.read_text()) if args.other.is_file()
              else digests(args.other))
    different = differences(ours, theirs)
    for line in different:
        print("differs:", line)
    print(json.dumps({"files_with_tensors": len(ours["tensors"]),
                      "tensors": sum(len(t) for t in ours["tensors"].values()),
                      "different": len(different),
                      "results_rows_identical": ours["results_rows"] == theirs["results_rows"],
                      "results_rows_sha256": ours["results_rows"]}))


if __name__ == "__main__":
    main()
