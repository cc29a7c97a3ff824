"""The stage registry: one declaration per stage, which the rules, the CLI and the manifest read.

`reprorl stages` prints each stage's declaration as a rule takes it; every declared module has
the `stage()` entry the CLI calls; the outputs follow the config; the priorities keep each
branch's interrupt -> resume chain ahead of its straight run, as their comment says.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from reprorl.core import config as configuration
from reprorl.core import layout, stages
from reprorl.core.stages import EXPORTS, MODES, STAGES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def listed() -> dict:
    result = subprocess.run([sys.executable, "-m", "reprorl", "stages", "--config",
                             "configs/ci.yaml"], cwd=ROOT, capture_output=True, text=True,
                            check=True, timeout=300)
    return json.loads(result.stdout)


def test_the_cli_lists_every_stage_it_can_run_with_its_declaration(listed):
    config = configuration.load(str(ROOT / "configs/ci.yaml"))
    assert set(listed) == set(STAGES) - {"audit"}
    for name, entry in listed.items():
        declared = stages.outputs(name, config)
        assert entry["outputs"]["manifest"] == str(layout.manifest(name))
        assert entry["outputs"].keys() == declared.keys()
        assert entry["threads"] == stages.threads(name, config)
        assert entry["priority"] == STAGES[name].priority


def test_every_declared_module_has_the_stage_entry_the_cli_calls():
    for name, stage in STAGES.items():
        module = importlib.import_module(f"reprorl.{stage.module}")
        entry = "audit_manifests" if name == "audit" else "stage"
        assert callable(getattr(module, entry)), f"{name}: reprorl.{stage.module}.{entry}"


def test_outputs_follow_the_config():
    config = configuration.load(str(ROOT / "configs/ci.yaml"))
    assert stages.outputs("base_model", config)["model"] == Path(config["model"]["path"])
    local = {**config, "model": {**config["model"], "source": "local"}}
    assert "model" not in stages.outputs("base_model", local)  # verified, never declared
    with pytest.raises(KeyError, match="no stage 'ppo_later'"):
        stages.outputs("ppo_later", config)


def test_without_triples_the_straight_run_exports_the_policy():
    triples = configuration.validate({})
    alone = configuration.validate({"resume_triples": False})
    assert stages.modes(triples) == MODES and stages.modes(alone) == ("continuous",)
    for branch, names in EXPORTS.items():
        final = layout.final(names[0])
        assert final in stages.outputs(f"{branch}_resume", triples).values()
        assert final not in stages.outputs(f"{branch}_continuous", triples).values()
        assert final in stages.outputs(f"{branch}_continuous", alone).values()


def test_each_interrupt_resume_chain_starts_before_its_straight_run():
    for branch in EXPORTS:
        chain, straight = (STAGES[f"{branch}_{mode}"].priority
                           for mode in ("interrupt", "continuous"))
        assert chain > straight, branch
    assert all(f"{branch}_{mode}" in STAGES for branch in EXPORTS for mode in MODES)


def test_a_config_runs_the_triples_and_curves_it_asks_for():
    main = {"resume_triples": True, "curves": True}
    seed = {"resume_triples": False, "curves": False}
    assert all(stages.runs(name, main) for name in stages.STAGES)
    skipped = {name for name in stages.STAGES if not stages.runs(name, seed)}
    assert skipped == {f"{branch}_{mode}" for branch in stages.EXPORTS
                       for mode in ("interrupt", "resume", "resume_check")} | {
        f"curve_{branch}" for branch in stages.CURVES}
