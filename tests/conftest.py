"""Shared fixtures: a scratch copy of the workflow, and a way to run Snakemake on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRASH_REPORT: dict[str, dict] = {}  # test_crash.py: the kill points of each stage
PREEMPT_REPORT: dict[str, dict] = {}  # test_crash.py: each stage's stops and work
WORKFLOW_PARTS = ("Snakefile", "rules", "workflow", "configs", "src")


def copy_workflow(destination: Path, origin: Path = ROOT, extra: tuple[str, ...] = ()) -> Path:
    """A runnable copy of the workflow *and* the package, so tests may edit modules; from
    another copy (`origin`), with `extra` of its folders too (those it has)."""
    destination.mkdir(parents=True, exist_ok=True)
    for part in (*WORKFLOW_PARTS, *extra):
        source = origin / part
        if source.is_dir():
            shutil.copytree(source, destination / part, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif source.exists():
            shutil.copy2(source, destination / part)
    return destination


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: int = 900):
    """Run Snakemake in `workdir` against that copy's own `src/` (PYTHONPATH first)."""
    env = dict(os.environ, PYTHONPATH=str(workdir / "src"), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def reprorl(workdir: Path, *args: str, check: bool = False):
    env = dict(os.environ, PYTHONPATH=str(workdir / "src"), PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run([sys.executable, "-m", "reprorl", *args], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    if check and result.returncode != 0:
        raise AssertionError(result.stdout + result.stderr)
    return result


@pytest.fixture
def workflow_copy(tmp_path: Path) -> Path:
    return copy_workflow(tmp_path / "wf")


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch) -> Path:
    """Run a test with the current directory in a fresh temporary folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def threads(request):
    """`request.param` torch threads for the test (parametrize it with indirect=True; 1 by
    default, the embedded server's), restored after."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(getattr(request, "param", 1))
    yield torch.get_num_threads()
    torch.set_num_threads(previous)


@pytest.fixture
def one_thread(threads):
    """One torch thread for the test (the embedded server's default), restored after."""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The CI-size embedded base (2 layers, width 64), built once per test session."""
    from reprorl.core import config as configuration
    from reprorl.pipeline import base_model

    config = configuration.load(ROOT / "configs/ci.yaml")
    config["model"]["path"] = str(tmp_path_factory.mktemp("tiny") / "model")
    base_model.build_embedded(config, log=lambda message: None)
    return Path(config["model"]["path"])


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The tiny model in transformers and its tokenizer: what a served answer is checked
    against (a direct forward)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True,
                                                 dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)


def tiny_config(model_path: Path) -> dict:
    from reprorl.core import config as configuration

    config = configuration.load(ROOT / "configs/ci.yaml")
    config["model"]["path"] = str(model_path)
    return config


def pytest_terminal_summary(terminalreporter):
    """The crash test's record, shown on success too: kill points per stage."""
    if CRASH_REPORT:
        terminalreporter.section("crash test: SIGKILL points per stage")
        for stage, record in CRASH_REPORT.items():
            terminalreporter.write_line(
                f"{stage}: {record['kill_points']} kill points landed mid-job at "
                f"{record['seconds_into_job']} s (reference job {record['reference_job_s']:g}"
                f" s; {record['misses_redrawn']} misses drawn again)")
    if PREEMPT_REPORT:
        terminalreporter.section("in-rule checkpoints: stops per stage (signal, step)")
        for stage, record in PREEMPT_REPORT.items():
            terminalreporter.write_line(
                f"{stage}: {record['stops']}; {record['steps_computed']} steps computed for "
                f"{record['steps']}")
