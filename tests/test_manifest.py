"""Atomic writes, manifests and the audit."""

import errno
import json
import os
import re
import stat
from pathlib import Path

import pytest

from reprorl.core.manifest import (
    AuditError,
    StageRun,
    atomic_directory,
    audit_manifests,
    read_json,
    sha256_json,
    write_json,
)


def test_atomic_write_leaves_no_temporary_and_normal_mode(in_tmp):
    write_json("out/a.json", {"b": 1, "a": [1.5]})
    assert os.listdir("out") == ["a.json"]
    assert read_json("out/a.json") == {"a": [1.5], "b": 1}
    assert oct(os.stat("out/a.json").st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _record_fsyncs(monkeypatch) -> list[tuple[Path, list[str] | None]]:
    """Each fsync's target, and a folder's entries at that moment (Linux: /proc names fds)."""
    synced, fsync = [], os.fsync

    def recording(handle):
        target = Path(os.readlink(f"/proc/self/fd/{handle}"))
        synced.append((target, sorted(os.listdir(target)) if target.is_dir() else None))
        fsync(handle)

    monkeypatch.setattr(os, "fsync", recording)
    return synced


linux_only = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")


@linux_only
def test_atomic_write_fsyncs_the_file_then_its_folder_after_the_rename(in_tmp, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    write_json("out/a.json", {"a": 1})
    (file, _), (folder, entries) = synced
    assert file.parent == folder == in_tmp / "out" and file.name.startswith(".a.json.")
    assert entries == ["a.json"]  # synced after the rename: the new name is what lasts


@linux_only
def test_atomic_directory_fsyncs_what_libraries_wrote_and_the_rename(in_tmp, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    with atomic_directory("model") as scratch:
        (scratch / "sub").mkdir()
        (scratch / "sub/w.bin").write_bytes(b"y")  # as save_pretrained writes: no fsync
    names = [path.name for path, _ in synced]
    assert names[:3] == ["w.bin", "sub", scratch.name]  # contents first, then the folders
    assert synced[-1] == (in_tmp, ["model"])


@pytest.mark.parametrize("refusal", ["open", "fsync"])
def test_writes_stand_where_a_folder_cannot_be_fsynced(in_tmp, monkeypatch, refusal):
    """Windows opens no folder; some filesystems refuse a folder's fsync (EINVAL)."""
    real_open, real_fsync = os.open, os.fsync

    def opening(path, flags, *args, **kwargs):
        if refusal == "open" and os.path.isdir(path):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    def fsyncing(handle):
        if refusal == "fsync" and stat.S_ISDIR(os.fstat(handle).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(handle)

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "fsync", fsyncing)
    write_json("out/a.json", {"a": 1})
    with atomic_directory("model") as scratch:
        (scratch / "w.bin").write_bytes(b"y")
    assert read_json("out/a.json") == {"a": 1} and Path("model/w.bin").read_bytes() == b"y"


def test_atomic_directory_is_all_or_nothing(in_tmp):
    with pytest.raises(RuntimeError):
        with atomic_directory("model") as scratch:
            (scratch / "half.bin").write_bytes(b"x")
            raise RuntimeError("crash while building")
    assert not Path("model").exists() and os.listdir(".") == []
    Path("model/sub").mkdir(parents=True)  # empty tree, as Snakemake leaves it
    with atomic_directory("model") as scratch:
        (scratch / "w.bin").write_bytes(b"y")
    assert Path("model/w.bin").read_bytes() == b"y"


def _stage(name, outputs, inputs=()):
    with StageRun(name, config={"k": 1}, code_hash="abc") as run:
        for path, text in outputs.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return run.finish(inputs=list(inputs), outputs=list(outputs))


def test_manifest_separates_hashed_state_from_run_facts(in_tmp):
    manifest = _stage("one", {"data/x.txt": "x"})
    assert set(manifest["run"]) >= {"wall_seconds", "peak_rss_mb"}
    assert "wall_seconds" not in json.dumps(manifest["hashed"])
    assert manifest["hashed_sha256"] == sha256_json(manifest["hashed"])
    again = _stage("one", {"data/x.txt": "x"})
    assert again["hashed_sha256"] == manifest["hashed_sha256"]  # timings do not enter it
    assert manifest["run"]["cpus"] >= 1


def test_manifest_records_the_cpu_the_numbers_depend_on(in_tmp, monkeypatch):
    import torch

    monkeypatch.setenv("MKL_CBWR", "AVX2")  # an override of MKL's kernel choice counts too
    cpu = _stage("one", {"data/x.txt": "x"})["hashed"]["cpu"]
    assert cpu["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert cpu["torch_threads"] == torch.get_num_threads()
    assert cpu["environment"]["MKL_CBWR"] == "AVX2"
    # what varies on one machine stays out of the hashed section
    assert not re.search(r"mhz|bogomips|cores|siblings", json.dumps(cpu), re.IGNORECASE)


def test_audit_passes_then_names_the_tampered_file(in_tmp):
    _stage("one", {"data/x.txt": "x", "data/y.txt": "y"})
    _stage("two", {"out/z.txt": "z"}, inputs=["data/y.txt"])
    assert audit_manifests()["files_checked"] == 4
    Path("data/y.txt").write_text("tampered")
    with pytest.raises(AuditError, match="data/y.txt differs .*stage one"):
        audit_manifests()


def test_audit_detects_an_edited_manifest_and_a_missing_file(in_tmp):
    _stage("one", {"data/x.txt": "x"})
    path = Path("outputs/manifests/one.json")
    content = read_json(path)
    content["hashed"]["outputs"]["data/x.txt"] = "0" * 64
    write_json(path, content)
    with pytest.raises(AuditError, match="was edited"):
        audit_manifests()
    _stage("one", {"data/x.txt": "x"})
    Path("data/x.txt").unlink()
    with pytest.raises(AuditError, match="data/x.txt .* is missing"):
        audit_manifests()


def test_stage_without_manifest_is_an_error(in_tmp):
    with pytest.raises(RuntimeError, match="without writing its manifest"):
        with StageRun("x", config={}, code_hash="h"):
            pass


def test_atomic_directory_clears_scratch_left_by_a_killed_run(in_tmp):
    Path(".model.abc123.tmp").mkdir()
    (Path(".model.abc123.tmp") / "half.bin").write_bytes(b"x")
    with atomic_directory("model") as scratch:
        (scratch / "w.bin").write_bytes(b"y")
    assert sorted(os.listdir(".")) == ["model"]
