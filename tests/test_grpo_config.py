"""The pipeline's GRPO defaults (the `grpo` block of the config schema) against
`AsyncGRPOConfig`'s, which stay the seed's (TRL's): every difference is deliberate and said."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

import reprorl
from reprorl.grpo import AsyncGRPOConfig
from reprorl.pipeline.grpo_run import PIPELINE_KEYS

SCHEMA = Path(reprorl.__file__).parent / "schemas" / "config.schema.yaml"

# Field -> why the pipeline's default differs from AsyncGRPOConfig's. The schema's description
# of the field repeats the why, so a reader of either file finds it.
PIPELINE_DIFFERENCES = {
    # the pipeline trains on CPUs within a time budget (configs/default.yaml says how long)
    "num_train_epochs": "one pass over the 672 rollout prompts; the seed's 3 do not fit a CPU "
                        "run's time budget",
    "num_generations": "groups of 4, half the seed's 8, for a CPU run's time budget",
    "groups_per_step": "four prompts a step, the 16 samples of a step before tree packing, "
                       "which 8 rows of max_model_len hold in one micro-batch",
    "gradient_checkpointing": "the tiny model needs no memory and CPU time is the budget",
    "max_concurrent_rollouts": "the embedded server decodes 64 sequences at once "
                               "(embedded_server_max_num_seqs); more would only wait in its "
                               "queue",
    "logging_steps": "the means of one step's 16 samples are noisy, five steps make a window",
    "save_steps": "a pipeline run is a few hundred steps at most, so 500 would checkpoint only "
                  "at its end",
    "seed": "the project's seed, 49, as every stage's",
    "schedule_lag": "the pipeline's GRPO runs are resumable branches whose resume checks must "
                    "pass, as every other stage's",
    # grpo_run.py maps null to embedded_server=True
    "vllm_server_base_url": "a pipeline run needs no server started beforehand",
}


def grpo_block() -> dict:
    return yaml.safe_load(SCHEMA.read_text())["properties"]["grpo"]["properties"]


def test_pipeline_defaults_differ_from_the_configs_only_where_said():
    properties = grpo_block()
    defaults = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    shared = properties.keys() & defaults.keys()
    assert len(shared) >= 20, sorted(shared)  # the block is the one meant, not an empty one
    differ = {name for name in shared if properties[name]["default"] != defaults[name]}
    unexplained = {name: (properties[name]["default"], defaults[name])
                   for name in differ - PIPELINE_DIFFERENCES.keys()}
    assert not unexplained, f"schema vs AsyncGRPOConfig defaults: {unexplained}"
    assert differ == PIPELINE_DIFFERENCES.keys(), "a listed difference is no longer one"
    for name, why in PIPELINE_DIFFERENCES.items():
        description = properties[name]["description"]
        assert why in description, f"the schema's {name} lacks its why"
        # and the default it names as the one it replaces is AsyncGRPOConfig's
        claim = re.search(r"Not AsyncGRPOConfig's (.+?)(?::\s| \()", description)
        assert claim and yaml.safe_load(claim.group(1)) == defaults[name], (name, description)


def test_pipeline_defaults_are_valid_settings():
    settings = {name: spec["default"] for name, spec in grpo_block().items()
                if name not in PIPELINE_KEYS and spec["default"] is not None}
    config = AsyncGRPOConfig(output_dir="out", **settings)
    assert config.groups_per_step == 4 and not config.gradient_checkpointing
