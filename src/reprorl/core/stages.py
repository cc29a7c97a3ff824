"""The registry of pipeline stages: which module runs each, and which config keys it reads.

The command line dispatches through it, `codehash` hashes each stage's module closure from it,
and `config.stage_config` cuts each stage's config subset from it. Adding a stage is one line.
The names below are the ones every rule and path is built from.
"""

from __future__ import annotations

from typing import NamedTuple


class Stage(NamedTuple):
    module: str  # reprorl.<module> holds `stage(name, config, run, log)`
    config_keys: tuple[str, ...]  # top-level config keys the stage reads
    threads: int = 1  # torch threads, and the rule's `threads:` (base_model: the config's)


# A resumable training branch runs in three modes (one rule each): `interrupt` stops early and
# saves, `resume` finishes from that state in a fresh process, `continuous` runs straight
# through; `<branch>_resume_check` then compares the resume and continuous final states.
MODES = ("interrupt", "continuous", "resume")
GRPO_RUNS = ("verifier", "learned")
# the final exports of each resumable branch (the first is the branch's own policy or model)
EXPORTS = {"sft": ("sft",), "reward": ("reward",), "ppo": ("ppo", "critic"),
           **{f"grpo_{run}": (f"grpo_{run}",) for run in GRPO_RUNS}}
# every policy judged on the held-out rows, each the name of its final actor export
POLICIES = ("sft", "ppo", *(f"grpo_{run}" for run in GRPO_RUNS))
# the branches whose straight run keeps its actor along the way (`curves`)
CURVES = POLICIES[1:]

STAGES: dict[str, Stage] = {
    "prepare": Stage("pipeline.corpus", ("seed",)),
    "base_model": Stage("pipeline.base_model", ("model", "limits")),
    **{f"{branch}_{mode}": Stage("pipeline.warmstart", ("model", "limits", branch))
       for branch in ("sft", "reward") for mode in MODES},
    **{f"{branch}_resume_check": Stage("pipeline.resumable", ()) for branch in EXPORTS},
    "sft_validation": Stage("pipeline.curves", ("model", "limits")),
    **{f"ppo_{mode}": Stage("pipeline.ppo", ("model", "limits", "ppo")) for mode in MODES},
    "ppo_report": Stage("pipeline.ppo", ()),
    # one thread: the trainer, the rollout worker and the embedded server take turns more than
    # they overlap (measured: the default verifier run uses 1.1 cores with 1 or 2 threads, 99 s
    # or 98 s alone), so two GRPO jobs, or one beside PPO, share the two cores instead
    **{f"grpo_{run}_{mode}": Stage("pipeline.grpo_run", ("model", "limits", "grpo"))
       for run in GRPO_RUNS for mode in MODES},
    **{f"curve_{branch}": Stage("pipeline.curves", ("model", "limits")) for branch in CURVES},
    "generation_inputs": Stage("pipeline.generate", ()),
    **{f"generate_{policy}": Stage("pipeline.generate", ("model", "limits"))
       for policy in POLICIES},
    "reward_test": Stage("pipeline.evaluate", ("model", "limits")),
    "evaluate": Stage("pipeline.evaluate", ()),
    "exercise": Stage("pipeline.evaluate", ("model", "limits")),
    "report": Stage("pipeline.report", ()),
    # outputs/seeds/summary.json; not in the default target
    "seeds": Stage("pipeline.seeds", ("seeds",)),
    "audit": Stage("core.manifest", ()),  # run by `reprorl audit`, hashed like any stage
}


def resumable(stage: str) -> tuple[str, str] | None:
    """(branch, mode) of a resumable branch's stage (mode `resume_check` too), else None."""
    for mode in (*MODES, "resume_check"):
        branch = stage.removesuffix(f"_{mode}")
        if branch != stage and branch in EXPORTS:
            return branch, mode
    return None


def threads(stage: str, config: dict) -> int:
    """Threads of `stage`'s job: pretraining the embedded base takes `pretrain_threads`; a
    GRPO run, its threads per trainer rank times its ranks."""
    if stage == "base_model":
        return config["pretrain_threads"]
    return STAGES[stage].threads * ranks(stage, config)


def ranks(stage: str, config: dict) -> int:
    """Trainer processes of `stage`: a GRPO run's torchrun ranks (grpo.nproc_per_node)."""
    return config["grpo"]["nproc_per_node"] if STAGES[stage].module == "pipeline.grpo_run" else 1


def gpus(stage: str, config: dict) -> int:
    """GPUs of `stage`'s job: one per trainer rank when model.device asks for a GPU (cuda,
    cuda:N) and the stage runs a model; `auto` asks for none (it takes a GPU where the job
    lands on one)."""
    on_gpu = config["model"]["device"].startswith("cuda")
    return ranks(stage, config) if on_gpu and "model" in STAGES[stage].config_keys else 0
