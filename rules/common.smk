# Shared helpers: config validation, every path from reprorl.core.layout, each stage's outputs,
# threads and priority from its declaration in reprorl.core.stages, and the params each rule
# carries. `python -m reprorl stages` lists what each rule declares, its files by name.
#
# Snakemake re-runs a job when its params change (rerun trigger "params"). Each rule therefore
# passes (stage_params) `code`, the hash of the reprorl modules it runs, and `config`, the
# part of the configuration it reads: editing src/reprorl/pipeline/base_model.py or model.*
# re-runs base_model and its dependents only.
import json
import os

from reprorl.core import layout
from reprorl.core.codehash import code_hash
from reprorl.core.config import CHECKPOINT_EVERY_ENV, stage_config_json, validate
from reprorl.core.errors import ConfigError
from reprorl.core.stages import (
    CURVES,
    EXPORTS,
    GRPO_RUNS,
    POLICIES,
    STAGES,
    gpus,
    logs,
    modes,
    threads,
)
from reprorl.core.stages import outputs as stage_outputs
from reprorl.core.stages import ranks as stage_ranks
from reprorl.core.stages import runs as stage_runs
from snakemake.exceptions import WorkflowError

# Snakemake parses --configfile itself (YAML .nan included): validate sees every value. A
# WorkflowError prints the message without the validator's own frames.
try:
    config.update(validate(config))
except ConfigError as error:
    raise WorkflowError(str(error)) from None
# every job inherits it
os.environ[CHECKPOINT_EVERY_ENV] = str(config["checkpoint_every"])


onsuccess:
    # a run ended well: the in-rule checkpoints of every complete stage go (core/preempt.py,
    # imported here: it brings in torch, which parsing the workflow does without)
    from reprorl.core.preempt import clear

    for done in layout.MANIFESTS.glob("*.json"):
        clear(done.stem)


# What `snakemake --report report.html` shows: (stage, output name) -> (caption, category).
# Captions live in workflow/report/; each figure has its own, named after it.
REPORTED = {
    ("evaluate", "table"): ("results.rst", "5. Results"),
    ("evaluate", "rows"): ("rows.rst", "5. Results"),
    ("exercise", "shortcuts"): ("exercise.rst", "6. Politeness exercise"),
    **{
        (f"{branch}_resume_check", "check"): ("resume-check.rst", "7. Reproducibility")
        for branch in EXPORTS
    },
}
FIGURE_CATEGORIES = {
    "pretraining": "1. Base model",
    "warmstart": "2. SFT and reward model",
    "ppo": "3. PPO",
    "grpo": "4. Async GRPO",
    "policies": "5. Results",
    "curves": "5. Results",
    "probes": "6. Politeness exercise",
}


def captioned(path, caption, category):
    """`path` flagged for Snakemake's report (captions are relative to this folder)."""
    return report(str(path), caption=f"../workflow/report/{caption}", category=category)


def stage_output(stage):
    """A stage's outputs as its registry entry declares them; folders with directory(), the files
    of REPORTED and the figures flagged for `snakemake --report`."""
    outputs = {}
    for name, path in stage_outputs(stage, config).items():
        if name in layout.DIRECTORIES:
            path = directory(str(path))
        elif (stage, name) in REPORTED:
            path = captioned(path, *REPORTED[stage, name])
        elif stage == "report" and name == "figures":
            path = [
                captioned(
                    figure, f"figure-{figure.stem}.rst", FIGURE_CATEGORIES[figure.stem]
                )
                for figure in path
            ]
        outputs[name] = path
    return outputs


def stage_threads(stage):
    """The rule's threads, which its command hands to torch."""
    return threads(stage, config)


def stage_resources(stage, **resources):
    """The rule's resources, plus `gpu` (one per trainer rank) when model.device asks for a
    GPU: the SLURM executor submits it as --gpus; `--resources gpu=N` caps a local run.
    """
    count = gpus(stage, config)
    return {**resources, **({"gpu": count} if count else {})}


def stage_priority(stage):
    """The rule's `priority:` (reprorl.core.stages.PRIORITY says why each)."""
    return STAGES[stage].priority


def stage_params(stage):
    """The stage a rule runs, how it is launched, its code hash and its config subset (see the
    top)."""
    return {
        "stage": stage,
        "launcher": stage_launcher(stage),
        "code": code_hash(stage),
        "config": stage_config_json(config, stage),
    }


def stage_launcher(stage):
    """`python`, or for a GRPO run of several trainer ranks (grpo.nproc_per_node) torchrun:
    rank 0 serves, generates and writes; each rank takes an equal share of the rule's threads.
    A param, not a shell string built per rule: a rule's shell is formatted when its job runs,
    after the loops that define the rules have moved on."""
    ranks = stage_ranks(stage, config)
    if ranks == 1:
        return "python"
    return f"python -m torch.distributed.run --standalone --nproc-per-node {ranks}"


# The shell command of every stage rule; the config subset travels as params.config.
# The first log is the stage's own output (a GRPO run's second holds its timed metrics).
STAGE_COMMAND = (
    "{params.launcher} -m reprorl {params.stage} --config-json {params.config:q}"
    " --threads {threads} > {log[0]} 2>&1"
)


def final_files(*names):
    """The final exports of roles (each safetensors and its JSON manifest), each once."""
    return [
        str(path) for name in sorted(set(names)) for path in layout.final_files(name)
    ]


def training_inputs(branch, mode):
    """What a branch starts from beyond the corpus and the base: PPO from the SFT actor and the
    reward model, GRPO from the SFT actor (the learned run also scores with the reward model);
    a resume from its own interrupt state. The verifier reads the rollout prompts'
    situations from the corpus."""
    inputs = {}
    if branch in ("ppo", "grpo_learned"):
        inputs |= {"sft": final_files("sft"), "reward": final_files("reward")}
    elif branch == "grpo_verifier":
        inputs["sft"] = final_files("sft")
    if mode == "resume":
        inputs["interrupted"] = str(layout.state(branch, "interrupt"))
    return inputs


def nested_cores(wildcards, threads):
    """Cores of a seed's nested run: every core Snakemake has where it runs the jobs itself;
    under a cluster executor (no --cores) the job's own threads."""
    try:
        return max(threads, workflow.cores)
    except WorkflowError:
        return threads
