"""Schema validation: defaults, clear errors, every shipped profile valid."""

from pathlib import Path

import pytest
import yaml

from reprorl import config as configuration
from reprorl.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("profile", sorted((ROOT / "configs").glob("*.yaml")), ids=str)
def test_shipped_profiles_validate(profile):
    # Snakemake loads configs/default.yaml first and merges the profile over it; each profile
    # must also be valid on its own.
    result = configuration.load(profile)
    assert result["seed"] == 49 and result["limits"]["response_tokens"] == 64


def test_defaults_are_filled():
    result = configuration.validate({})
    assert result["model"]["embedded"]["hidden_size"] == 256
    assert result["model"]["pretrain"]["batch_size"] == 32


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"thread": 2}, r"config key \(top level\): Additional properties .*'thread'"),
        ({"pretrain_threads": "two"},
         "config key pretrain_threads: 'two' is not of type 'integer'"),
        ({"model": {"embedded": {"hidden_size": 0}}},
         "config key model.embedded.hidden_size: 0 is less than the minimum"),
        ({"model": {"source": "hub"}}, "config key model.source: 'hub' is not one of"),
    ],
)
def test_errors_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        configuration.validate(raw)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        configuration.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        configuration.load(bad)


def test_stage_subsets_only_hold_what_the_stage_reads():
    full = configuration.validate({})
    assert set(configuration.stage_config(full, "prepare")) == {"seed"}
    assert set(configuration.stage_config(full, "base_model")) == {"model", "limits"}


def test_workflow_schema_is_the_package_schema():
    linked = ROOT / "workflow/schemas/config.schema.yaml"
    assert linked.resolve() == configuration.SCHEMA_PATH.resolve()
