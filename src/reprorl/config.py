"""Configuration: one JSON schema (with every default), one validator, per-stage subsets.

The schema lives in the package (`schemas/config.schema.yaml`) and is linked from
`workflow/schemas/` where Snakemake users look for it. The Snakefile and the command line both
call `validate`, so a run started either way sees the same defaults and the same errors.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import jsonschema
import yaml

from .errors import ConfigError
from .stages import STAGES

SCHEMA_PATH = Path(__file__).with_name("schemas") / "config.schema.yaml"



@cache
def schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _with_defaults(validator_class):
    """A validator that fills each missing property with its schema default."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def fill(validator, properties, instance, subschema):
        if isinstance(instance, dict):
            for name, spec in properties.items():
                if "default" in spec and name not in instance:
                    instance[name] = copy.deepcopy(spec["default"])
        yield from validate_properties(validator, properties, instance, subschema)

    return jsonschema.validators.extend(validator_class, {"properties": fill})


def validate(config: dict) -> dict:
    """Return a validated copy of `config` with every default filled in.

    Raises ConfigError naming the first offending key and what the schema expects.
    """
    config = copy.deepcopy(dict(config))
    validator = _with_defaults(jsonschema.Draft202012Validator)(schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(config))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        hint = "see workflow/schemas/config.schema.yaml for every key, its type and its default"
        if error.validator == "additionalProperties":
            raise ConfigError(f"config key {where}: {error.message}; {hint}")
        raise ConfigError(f"config key {where}: {error.message} ({hint})")
    return config


def load(path: str | Path) -> dict:
    """Read a YAML profile and validate it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (profiles live in configs/)")
    with path.open() as handle:
        raw = yaml.safe_load(handle) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(raw).__name__}")
    return validate(raw)


def stage_config(config: dict, stage: str) -> dict:
    """The subset of a validated config that `stage` reads. A stage's manifest and its
    Snakemake params carry only these keys, so changing one stage's settings re-runs that stage
    and its dependents, nothing else."""
    return {key: config[key] for key in STAGES[stage].config_keys}


def stage_config_json(config: dict, stage: str) -> str:
    return json.dumps(stage_config(config, stage), sort_keys=True, separators=(",", ":"))
