"""Hashes, atomic writes, stage manifests, the preserved-artifact guard and the audit.

Every artifact is written to a temporary name in its final directory, fsynced, moved into place
with `os.replace`, and its directory fsynced: a reader, a crash or a power cut never leaves a
partial file under its final name, and a finished write stays finished.

A stage manifest (`outputs/manifests/<stage>.json`) has two parts:
- `hashed`: what must be identical when the stage is rebuilt from the same inputs (sha256 of every
  input and output file, the code hash, the config subset, library versions, and the CPU as the
  numeric libraries see it: the same versions round differently on another instruction set);
  the inputs are the files the stage actually opened: every reader of an input (`corpus.read`,
  the final-export and resume-state loaders, the tokenizer and model loaders, `read_input`)
  records its path with `record_read`; the outputs are the stage's entry in `stages.outputs`;
- `run`: what legitimately varies between runs (wall time, peak memory, host, cores, start time).
`audit_manifests` re-hashes every file named in `hashed` and stops at the first difference.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from . import layout, numerics, stages
from .errors import AuditError, PreservedArtifactError, ReproError

# the distributions whose version can change a number, a figure's bytes or the DAG
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "snakemake",
             "matplotlib", "jsonschema", "pyyaml")
# /proc/cpuinfo flags that change which kernels ATen, MKL or oneDNN dispatch to
KERNEL_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw",
                "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")
# environment variables that override that choice (when set, they decide the numbers too)
KERNEL_ENVIRONMENT = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
                      "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE",
                      "NPY_ENABLE_CPU_FEATURES", "NPY_DISABLE_CPU_FEATURES",
                      "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS")
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: mkstemp/mkdtemp create private files; finals get normal modes


def refuse_to_overwrite(path: str | os.PathLike) -> None:
    """Training checkpoints are preserved: a stage run by hand never replaces them."""
    if Path(path).exists():
        raise PreservedArtifactError(
            f"{path} exists and checkpoints are preserved; delete it to retrain (Snakemake "
            "does so itself when the rule must rerun)")


# ---------------------------------------------------------------- hashing


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def canonical_json(value: Any) -> str:
    """The one serialisation that is hashed: sorted keys, no spaces, exact floats."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_json(value: Any) -> str:
    return sha256_bytes(canonical_json(value).encode())


def files_under(root: str | os.PathLike) -> list[Path]:
    """Every regular file below `root`, in a stable order."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def hash_paths(paths: Iterable[str | os.PathLike]) -> dict[str, str]:
    """sha256 of each file; a directory contributes each file under it."""
    result: dict[str, str] = {}
    for path in paths:
        path = Path(path)
        if path.is_dir():
            for file in files_under(path):
                result[file.as_posix()] = sha256_file(file)
        elif path.is_file():
            result[path.as_posix()] = sha256_file(path)
        else:
            raise ReproError(f"{path} is missing: it must exist before it can be hashed")
    return dict(sorted(result.items()))


# ---------------------------------------------------------------- atomic writes


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o666 & ~_UMASK)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    fsync_path(path.parent)  # the rename itself, not only the bytes, survives a power cut
    return path


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's bytes, or a directory's entries (a rename into it), to disk.

    Where a platform cannot (Windows opens no directory; some filesystems refuse a directory
    fsync with EINVAL), the write stays atomic and is only less durable, so that is no error.
    """
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0)
    try:
        handle = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, value: Any) -> Path:
    """Human-readable, stable JSON (sorted keys, trailing newline), written atomically."""
    return atomic_write_text(path, json.dumps(value, indent=1, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as handle:
        return json.load(handle)


# ---------------------------------------------------------------- what a stage read

_READS: set[str] = set()  # one stage per process: StageRun empties it when the stage starts


def record_read(*paths: str | os.PathLike) -> None:
    """Name files (or folders) the running stage read, for its manifest's inputs."""
    _READS.update(Path(path).as_posix() for path in paths)


def read_input(path: str | os.PathLike) -> Any:
    """A JSON input of the stage: read, and recorded for its manifest."""
    record_read(path)
    return read_json(path)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a scratch directory that becomes `path` only if the block finishes.

    The scratch directory sits beside `path` (same filesystem) so the final rename is atomic.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield scratch
        if path.exists():
            # Snakemake pre-creates the parent folders of declared outputs: an empty tree is
            # replaced, anything holding a file is not.
            if files_under(path):
                raise PreservedArtifactError(f"{path} holds files already; it was not replaced")
            shutil.rmtree(path)
        for file in files_under(scratch):  # libraries writing into scratch may use mkstemp too
            os.chmod(file, 0o666 & ~_UMASK)
            fsync_path(file)  # nor do they fsync: the folder must not arrive with empty files
        for folder in (*sorted(p for p in scratch.rglob("*") if p.is_dir()), scratch):
            fsync_path(folder)
        os.chmod(scratch, 0o777 & ~_UMASK)
        os.replace(scratch, path)
        fsync_path(path.parent)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)


# ---------------------------------------------------------------- stage manifests


def library_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def cpu_features() -> tuple[dict, dict]:
    """The CPU as the numeric libraries see it, split in what decides the bits (hashed) and what
    only describes the machine (run). Under native numerics the CPU type decides them (the same
    library versions give other bits on another instruction set: ATen's softmax and MKL's exp
    round differently under AVX2 and AVX-512), so all of it is hashed; under portable numerics
    the pinned kernels do, and the CPU type moves to `run`. No frequency and no core count:
    those vary on one machine; the torch threads are the stage's own setting."""
    import torch

    info = numerics.cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    build = torch.__config__.show()
    versions = {name: match.group(1) for name, pattern in (
        ("mkl", r"Math Kernel Library Version ([\d.]+)"), ("onednn", r"MKL-DNN (v\S+)"))
        if (match := re.search(pattern, build))}
    kernels = {
        "numerics": numerics.mode(),
        "machine": platform.machine(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "mkl": versions.get("mkl") if torch.backends.mkl.is_available() else None,
        "onednn": versions.get("onednn") if torch.backends.mkldnn.is_available() else None,
        "environment": {k: os.environ[k] for k in KERNEL_ENVIRONMENT if k in os.environ},
    }
    machine = {
        "vendor": info.get("vendor_id", ""),
        "model_name": info.get("model name", platform.processor()),
        "family_model": f"{info.get('cpu family', '')}/{info.get('model', '')}",
        "flags": [flag for flag in KERNEL_FLAGS if flag in flags],
    }
    if numerics.mode() == "portable":
        return kernels, machine
    return {**kernels, **machine}, {}


def peak_rss_mb() -> float:
    """Peak resident memory of this process and its finished children (CPU peak memory)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024.0  # ru_maxrss is in KiB on Linux


def gpu_memory() -> dict:
    """Peak GPU memory of this process (`devices.memory`); empty if it never used CUDA."""
    if "torch" not in sys.modules:  # the audit and the report never import it
        return {}
    from .devices import memory

    return memory()


def cpu_seconds() -> float:
    """User + system CPU time of this process since it started (imports included) and of its
    finished children (a GRPO run's worker and server): the work a stage cost the machine."""
    import resource

    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class StageRun:
    """Times a stage and, on success, writes its manifest last (after every output).

    Usage:
        with StageRun("sft_resume", config=subset, code_hash=h) as run:
            ...read inputs through the recording readers, write outputs...
            run.finish(summary={...}, run_info={...})

    `inputs` defaults to what the stage recorded reading, `outputs` to its `stages.outputs`.
    """

    def __init__(self, stage: str, *, config: dict, code_hash: str,
                 checkpoint_every: int | str | None = None):
        self.stage, self.config, self.code_hash = stage, config, code_hash
        self.checkpoint_every = checkpoint_every  # a training stage's (`preempt.py`)
        self.started = 0.0
        self.manifest: dict | None = None

    def __enter__(self) -> StageRun:
        _READS.clear()
        self.started = time.perf_counter()
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        return self

    def finish(
        self,
        *,
        summary: dict | None = None,
        run_info: dict | None = None,
        inputs: Iterable[str | os.PathLike] | None = None,
        outputs: Iterable[str | os.PathLike] | None = None,
    ) -> dict:
        if inputs is None:
            inputs = sorted(_READS)
        if outputs is None:
            declared = stages.outputs(self.stage, self.config)
            declared.pop("manifest")
            outputs = [p for v in declared.values() for p in (v if isinstance(v, list) else [v])]
        cpu, machine = cpu_features()
        hashed = {
            "stage": self.stage,
            "code_sha256": self.code_hash,
            "config": self.config,
            "libraries": library_versions(),
            "cpu": cpu,
            "inputs": hash_paths(inputs),
            "outputs": hash_paths(outputs),
            "summary": summary or {},
        }
        run = {
            "wall_seconds": round(time.perf_counter() - self.started, 3),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            **gpu_memory(),
            "cpu_seconds": round(cpu_seconds(), 3),
            "started_at": self.started_at,
            "host": platform.node(),
            # cores this process may use (affinity, so a SLURM job's share): not hashed, since
            # the numbers depend on the torch threads recorded in `cpu`, not on the cores
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            **({"cpu": machine} if machine else {}),
            **(run_info or {}),
        }
        self.manifest = {"hashed": hashed, "hashed_sha256": sha256_json(hashed), "run": run}
        write_json(layout.manifest(self.stage), self.manifest)
        return self.manifest

    def leave_to_another_process(self) -> None:
        """This process ran part of the stage (a torchrun rank other than 0); the process
        that writes the outputs writes the manifest."""
        self.manifest = {}

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None and self.manifest is None:
            raise ReproError(f"stage {self.stage} ended without writing its manifest")


# ---------------------------------------------------------------- audit


def audit_manifests(directory: str | os.PathLike = layout.MANIFESTS) -> dict:
    """Re-hash every input and output named by every manifest; fail at the first difference."""
    manifests = sorted(Path(directory).glob("*.json"))
    if not manifests:
        raise AuditError(f"no manifest under {directory}: run a stage first")
    checked = 0
    for manifest in manifests:
        content = read_json(manifest)
        hashed = content["hashed"]
        if sha256_json(hashed) != content["hashed_sha256"]:
            raise AuditError(f"{manifest} was edited: its hashed section no longer matches")
        for role in ("inputs", "outputs"):
            for name, expected in hashed[role].items():
                if not Path(name).is_file():
                    raise AuditError(f"{name} ({role[:-1]} of {hashed['stage']}) is missing")
                if sha256_file(name) != expected:
                    raise AuditError(
                        f"{name} differs from the sha256 recorded by {manifest} "
                        f"({role[:-1]} of stage {hashed['stage']}): restore it or rerun the stage"
                    )
                checked += 1
    return {"manifests": len(manifests), "files_checked": checked, "status": "PASS"}
