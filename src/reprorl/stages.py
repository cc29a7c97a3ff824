"""The registry of pipeline stages: which module runs each, and which config keys it reads.

The command line dispatches through it, `codehash` hashes each stage's module closure from it,
and `config.stage_config` cuts each stage's config subset from it. Adding a stage is one line.
"""

from __future__ import annotations

from typing import NamedTuple


class Stage(NamedTuple):
    module: str  # reprorl.<module> holds `stage(name, config, run, log)`
    config_keys: tuple[str, ...]  # top-level config keys the stage reads


MODES = ("interrupt", "continuous", "resume")

STAGES: dict[str, Stage] = {
    "prepare": Stage("corpus", ("seed",)),
    "base_model": Stage("base_model", ("model", "limits")),
    **{f"{branch}_{mode}": Stage("warmstart", ("model", "limits", branch))
       for branch in ("sft", "reward") for mode in MODES},
    "sft_resume_check": Stage("warmstart", ()),
    "reward_resume_check": Stage("warmstart", ()),
    "sft_validation": Stage("warmstart", ("model", "limits")),
    **{f"ppo_{mode}": Stage("ppo", ("model", "limits", "ppo")) for mode in MODES},
    "ppo_resume_check": Stage("ppo", ()),
    "ppo_report": Stage("ppo", ()),
    **{f"grpo_{run}": Stage("grpo_run", ("model", "limits", "grpo"))
       for run in ("verifier", "learned")},
    "generation_inputs": Stage("generate", ()),
    **{f"generate_{policy}": Stage("generate", ("model", "limits"))
       for policy in ("sft", "ppo", "grpo_verifier", "grpo_learned")},
    "reward_test": Stage("evaluate", ("model", "limits")),
    "evaluate": Stage("evaluate", ()),
    "exercise": Stage("evaluate", ("model", "limits")),
    "report": Stage("report", ()),
    "audit": Stage("manifest", ()),  # run by `reprorl audit`, hashed like any stage
}
