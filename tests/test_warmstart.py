"""SFT and reward-model losses by hand, and exact interrupt/resume on the CI profile."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from reprorl.core import config as configuration
from reprorl.core.errors import ReproError
from reprorl.core.manifest import read_json
from reprorl.core.state import load_state, save_state
from reprorl.pipeline import corpus, exports, prepare, resumable, warmstart


class _Run:
    def finish(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model):
    """A project folder with the corpus, the CI base and SFT interrupt + continuous runs."""
    root = tmp_path_factory.mktemp("project")
    previous = os.getcwd()
    os.chdir(root)
    try:
        config = configuration.load(ROOT / "configs/ci.yaml")
        prepare.stage("prepare", config, _Run(), log=lambda m: None)
        shutil.copytree(tiny_model, "assets/model")
        for mode in ("interrupt", "continuous"):
            warmstart.train(config, "sft", mode, log=lambda m: None)
        yield root, config
    finally:
        os.chdir(previous)


@pytest.fixture
def in_project(project, monkeypatch):
    root, config = project
    monkeypatch.chdir(root)
    for leftover in ("sft-resume.pt.gz", "sft-final.safetensors", "sft-final.json"):
        Path("assets/checkpoints", leftover).unlink(missing_ok=True)
    shutil.rmtree("assets/checkpoints/sft-peft", ignore_errors=True)
    return config


def test_interrupt_stops_after_one_epoch(in_project):
    interrupted = load_state("assets/checkpoints/sft-interrupt.pt.gz")
    assert interrupted["progress"]["epoch"] == 1 and interrupted["updates"] == 21
    continuous = load_state("assets/checkpoints/sft-continuous.pt.gz")
    validation = continuous["progress"]["validation_history"]
    assert continuous["updates"] == 63 and len(validation) == 3
    assert all(v["used_for_selection"] is False for v in validation)


def test_resume_equals_continuous_bitwise(in_project):
    warmstart.train(in_project, "sft", "resume", log=lambda m: None)
    result = resumable.resume_check("sft")
    assert result["status"] == "PASS"
    # the final adapters reload from safetensors and from the PEFT export
    assert read_json("assets/checkpoints/sft-final.json")["kind"] == "actor"
    actor, _ = exports.load_final("sft", "actor", in_project)
    assert (Path("assets/checkpoints/sft-peft") / "adapter_config.json").is_file()
    assert actor.kind == "actor"


def test_resume_without_restored_rng_fails_the_check(in_project):
    path = Path("assets/checkpoints/sft-interrupt.pt.gz")
    original = path.read_bytes()
    try:
        state = load_state(path)
        # the data-order generator, as if it were not restored
        state["generators"]["sampler"] = torch.Generator().manual_seed(0).get_state()
        save_state(path, state)
        warmstart.train(in_project, "sft", "resume", log=lambda m: None)
        with pytest.raises(ReproError, match="resume check FAILED"):
            resumable.resume_check("sft")
        assert read_json("outputs/learning/sft/resume-check.json")["status"] == "FAIL"
    finally:
        path.write_bytes(original)


def test_resume_refuses_a_different_identity(in_project):
    changed = {**in_project, "sft": {**in_project["sft"], "learning_rate": 0.001}}
    with pytest.raises(ReproError, match="cannot be resumed by this run .*learning_rate"):
        warmstart.train(changed, "sft", "resume", log=lambda m: None)


def test_corrupted_state_is_a_clear_error(in_project, tmp_path):
    broken = tmp_path / "broken.pt.gz"
    broken.write_bytes(Path("assets/checkpoints/sft-interrupt.pt.gz").read_bytes()[:1000])
    with pytest.raises(ReproError, match="is corrupted"):
        load_state(broken)


def test_learning_stage_cannot_read_gold_labels(in_project):
    with pytest.raises(corpus.HeldOutError, match="may not read data/generated/labels/gold"):
        corpus.read("labels/gold.json", "learning")
