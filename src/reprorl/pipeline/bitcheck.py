"""Digests of a run, and the check that tells a reader whether their run has the same bits.

A run's digests (`reprorl digests --write FILE`) hold every tensor of every file under `assets/`
(model, checkpoints, snapshots, resume states, each tensor with its dtype and shape), the bytes
of `outputs/results-rows.csv`, and each stage's manifest seen without the commit: its hashed
section minus the code hash, every input and output by its content (tensor files by their
tensors, JSON without code hashes and other files' hashes, rendered pages by what they
render), so two commits that compute the same bits give the same digests. They also name the
machine, the numerics mode and the libraries.

`reprorl bitcheck [FILE or RUN ...]` compares this folder's run with each: "same bits", or the
first stage (in the DAG's order) whose outputs differ, its first differing file and tensor, and
whether the kernel settings explain it (native numerics on another CPU type, other libraries).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import subprocess
from pathlib import Path

from reprorl.core import layout
from reprorl.core.errors import ReproError
from reprorl.core.manifest import canonical_json, read_json, sha256_file, write_json

FORMAT = 1
TENSOR_SUFFIXES = (".safetensors", ".pt.gz")


def _tensors(value, prefix: str = ""):
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}/{index}")


def tensor_digest(tensor) -> str:
    import torch

    flat = tensor.detach().contiguous().view(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)}\0".encode() + data).hexdigest()


def file_tensors(path: Path) -> dict[str, str]:
    """{tensor path: digest} of a safetensors file or a resume state (`*.pt.gz`); a state is
    read tensor by tensor, since its bytes also hold the code's hash."""
    import torch
    from safetensors.torch import load_file

    if path.name.endswith(".pt.gz"):
        with gzip.open(path, "rb") as file:
            state = torch.load(io.BytesIO(file.read()), map_location="cpu", weights_only=False)
    else:
        state = load_file(path)
    return {key: tensor_digest(tensor) for key, tensor in _tensors(state)}


HEX64 = re.compile(r"[0-9a-f]{64}")


def _without_code(value):
    """JSON `value` as two commits computing the same bits write it: without the code hashes,
    and without the sha256 and byte sizes of other files (a resume state's bytes hold the code
    hash and config; each file is compared by its own content instead)."""
    if isinstance(value, dict):
        return {k: _without_code(v) for k, v in value.items()
                if k != "code_sha256" and not k.endswith("_bytes")
                and not (isinstance(v, str) and HEX64.fullmatch(v))}
    if isinstance(value, list):
        return [_without_code(v) for v in value if not (isinstance(v, str) and HEX64.fullmatch(v))]
    return value


def content_digest(path: Path, tensors: dict | None = None) -> str:
    """A file's digest by its content: tensors for tensor files, JSON without code hashes."""
    if path.name.endswith(TENSOR_SUFFIXES):
        digests = tensors if tensors is not None else file_tensors(path)
        return hashlib.sha256(canonical_json(digests).encode()).hexdigest()
    if path.suffix in (".md", ".html"):
        # pages rendered from the JSON and figures compared beside them (results.md, the
        # report); they also print the gzip sizes of resume states, which hold the code hash
        return "a rendering"
    if path.suffix == ".json":
        try:
            value = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return sha256_file(path)
        return hashlib.sha256(canonical_json(_without_code(value)).encode()).hexdigest()
    return sha256_file(path)


def _commit(root: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def digests(root: Path = Path(".")) -> dict:
    """The digests of the run in `root` (see the top)."""
    manifests = sorted((root / layout.MANIFESTS).glob("*.json"))
    if not manifests:
        raise ReproError(f"{root / layout.MANIFESTS} holds no stage manifest: run the workflow "
                         "there first (`snakemake --cores all`)")
    tensors = {path.relative_to(root).as_posix(): file_tensors(path)
               for path in sorted((root / "assets").rglob("*"))
               if path.is_file() and path.name.endswith(TENSOR_SUFFIXES)}
    cache: dict[str, str] = {}

    def content(name: str) -> str:
        if name not in cache:
            path = root / name
            cache[name] = content_digest(path, tensors.get(name)) if path.is_file() else "absent"
        return cache[name]

    stages, machine = {}, {}
    for path in manifests:
        manifest = read_json(path)
        hashed = dict(manifest["hashed"])
        hashed.pop("code_sha256", None)
        seen = {side: {name: content(name) for name in hashed.pop(side, {})}
                for side in ("inputs", "outputs")}
        view = _without_code(hashed)
        stages[path.stem] = {"view": hashlib.sha256(canonical_json(view).encode()).hexdigest(),
                             "kernels": view.get("cpu", {}), "libraries": view.get("libraries"),
                             "config": view.get("config", {}), **seen}
        machine = machine or {**hashed.get("cpu", {}), **manifest["run"].get("cpu", {})}
    rows = root / layout.RESULTS_ROWS
    return {"format": FORMAT, "commit": _commit(root),
            "machine": {k: machine.get(k) for k in ("vendor", "model_name", "family_model",
                                                    "flags", "torch_capability")},
            "numerics": machine.get("numerics", "native"),
            "stages": stages, "tensors": tensors,
            "results_rows": sha256_file(rows) if rows.is_file() else None}


def load(source: Path) -> dict:
    """Digests from a file written by `--write`, or computed from a run's folder."""
    if source.is_dir():
        return digests(source)
    if not source.is_file():
        raise ReproError(f"{source} is neither a digest file nor a run's folder: give one "
                         f"(the README's block was made from {layout.README_DIGESTS})")
    content = read_json(source)
    if content.get("format") != FORMAT:
        raise ReproError(f"{source} is not a digest file of format {FORMAT}: write it again "
                         "with `reprorl digests --write`")
    return content


def dag_order(stages: dict) -> list[str]:
    """Stage names so that each comes after every stage whose outputs it read."""
    made = {path: name for name, stage in stages.items() for path in stage["outputs"]}
    after = {name: {made[p] for p in stage["inputs"] if p in made} - {name}
             for name, stage in stages.items()}
    order: list[str] = []
    while len(order) < len(after):
        ready = sorted(n for n, deps in after.items() if n not in order and deps <= set(order))
        order.append(ready[0] if ready else sorted(set(after) - set(order))[0])
    return order


def explanation(ours: dict, theirs: dict, stage: str | None) -> str:
    """Whether the kernel settings or the libraries account for a difference."""
    a = ours["stages"].get(stage, {}) if stage else {}
    b = theirs["stages"].get(stage, {}) if stage else {}
    if a.get("config") != b.get("config"):
        keys = sorted(k for k in {**a.get("config", {}), **b.get("config", {})}
                      if a.get("config", {}).get(k) != b.get("config", {}).get(k))
        return (f"explained: the stage ran with another config ({', '.join(keys)} differ); "
                "compare runs of the same profile and commit")
    if a.get("libraries") != b.get("libraries"):
        diff = sorted(k for k in {**(a.get("libraries") or {}), **(b.get("libraries") or {})}
                      if (a.get("libraries") or {}).get(k) != (b.get("libraries") or {}).get(k))
        return (f"explained: other library versions ({', '.join(diff)}); install with "
                "`-c constraints/cpu.txt`")
    if "native" in (ours["numerics"], theirs["numerics"]) and ours["machine"] != theirs["machine"]:
        return (f"explained: native numerics on another CPU type ({_cpu(ours)} here, "
                f"{_cpu(theirs)} there); compare runs made with `numerics: portable`")
    kernels = sorted(k for k in {**a.get("kernels", {}), **b.get("kernels", {})}
                     if a.get("kernels", {}).get(k) != b.get("kernels", {}).get(k))
    if kernels:
        return f"explained: other kernel settings ({', '.join(kernels)})"
    here, there = ours.get("commit"), theirs.get("commit")
    if here and there and here != there:  # the code hashes are left out of the comparison
        return (f"perhaps explained: other code (commit {here} here, {there} there), which the "
                "check does not compare; a change between them may have moved the numbers on "
                "purpose: compare runs of one commit")
    return ("not explained by the kernel settings or the libraries (the same on both sides): "
            "a kernel that is not portable yet; please report it with both digest files")


def _cpu(digest: dict) -> str:
    machine = digest["machine"]
    return (f"{machine.get('model_name')} {machine.get('family_model')}, "
            f"{machine.get('torch_capability')}, {digest['numerics']}")


def compare(ours: dict, theirs: dict) -> dict:
    """Same bits, or the first stage in the DAG's order that differs, and why."""
    first = None
    for stage in dag_order(ours["stages"]):
        mine, other = ours["stages"][stage], theirs["stages"].get(stage)
        if other is None:
            continue  # a stage the other run did not run (another target)
        files = [p for p in mine["outputs"] if mine["outputs"][p] != other["outputs"].get(p)]
        if files or mine["view"] != other["view"]:
            inputs_same = all(other["inputs"].get(p) == d for p, d in mine["inputs"].items())
            first = {"stage": stage, "files": files, "inputs_same": inputs_same,
                     "tensors": [f"{files[0]}{key}" for key in _tensor_differences(
                         ours, theirs, files[0])] if files else []}
            break
    tensors = sum(1 for f in ours["tensors"] for key in _tensor_differences(ours, theirs, f))
    rows_same = ours["results_rows"] == theirs["results_rows"]
    same = first is None and not tensors and rows_same
    return {"same_bits": same, "first_stage": first, "tensors_differing": tensors,
            "tensors": sum(len(t) for t in ours["tensors"].values()),
            "results_rows_same": rows_same, "here": _cpu(ours), "there": _cpu(theirs),
            "there_commit": theirs.get("commit"),
            "explanation": None if same else explanation(
                ours, theirs, first and first["stage"])}


def _tensor_differences(ours: dict, theirs: dict, name: str) -> list[str]:
    mine, other = ours["tensors"].get(name), theirs["tensors"].get(name)
    if mine is None:
        return []
    if other is None:
        return ["(whole file: absent there)"]
    return sorted(k for k in mine.keys() | other.keys() if mine.get(k) != other.get(k))


def verdict(report: dict, source: str) -> str:
    """One paragraph a reader acts on."""
    if report["same_bits"]:
        return (f"same bits as {source} ({report['tensors']} tensors, results rows, every "
                f"stage): here {report['here']}; there {report['there']}")
    first = report["first_stage"]
    where = "no stage differs, but the tensors or results rows do"
    if first:
        why = ("its outputs are the same, its manifest is not" if not first["files"] else
               "its inputs are the same, so it is where the bits part" if first["inputs_same"]
               else "its inputs already differ")
        where = f"first stage that differs: {first['stage']} ({why})"
        if first["tensors"]:
            where += f"; first tensor: {first['tensors'][0]}"
        elif first["files"]:
            where += f"; first file: {first['files'][0]}"
    return (f"other bits than {source}: {where}; {report['tensors_differing']} of "
            f"{report['tensors']} tensors differ. {report['explanation']}")


def write(path: Path, root: Path = Path(".")) -> dict:
    content = digests(root)
    write_json(path, content)
    return {"digests": str(path), "stages": len(content["stages"]),
            "tensors": sum(len(t) for t in content["tensors"].values())}


def check(sources: list[Path], root: Path = Path(".")) -> tuple[dict, bool]:
    """Compare the run in `root` with every source; (reports, all the same)."""
    ours = digests(root)
    reports = {}
    for source in sources or [layout.README_DIGESTS]:
        report = compare(ours, load(source))
        report["verdict"] = verdict(report, str(source))
        print(report["verdict"], flush=True)
        reports[str(source)] = report
    return reports, all(r["same_bits"] for r in reports.values())
