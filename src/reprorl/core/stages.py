"""The registry of pipeline stages: one declaration per stage, which everything else reads.

A `Stage` says which module runs it, which config keys it reads, its threads, its scheduling
priority and the files it writes. The command line dispatches through it, `codehash` hashes
each stage's module closure, `config.stage_config` cuts its config subset, the manifest checks
its outputs, and each Snakemake rule takes its `output:`, `threads:` and `priority:` from it.
Paths themselves are spelled once, in `layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from . import layout

Files = dict[str, Path | list[Path]]


class Stage(NamedTuple):
    module: str  # reprorl.<module> holds `stage(name, config, run, log)`
    config_keys: tuple[str, ...]  # top-level config keys the stage reads
    outputs: Callable[[dict], Files]  # config -> the files it writes, by the names rules use
    threads: int = 1  # torch threads, and the rule's `threads:` (base_model: the config's)
    # which ready job Snakemake starts first when the cores are short (higher first), see below
    priority: int = 1


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

# Priorities: a job's rank is its longest path to the report in tens of seconds, from the stage
# times of a fresh clone's default run on 2 cores (887aed2). So each branch's interrupt ->
# resume chain, whose exports the rest waits for, goes before its straight run, which only its
# check reads; left to itself Snakemake once started the GRPO verifier chain last, which then
# ran alone for 2 min. It orders jobs only: no output depends on it (though, this module being
# in every stage's code hash, editing it re-runs them). Jobs near the end of every path keep 1.
PRIORITY = {
    "base_model": 59, "prepare": 37,
    "reward_interrupt": 37, "reward_resume": 31, "reward_continuous": 14,
    "sft_interrupt": 30, "sft_resume": 28, "sft_continuous": 6,
    "ppo_interrupt": 24, "ppo_continuous": 21, "ppo_resume": 17,
    "grpo_learned_interrupt": 22, "grpo_learned_continuous": 15, "grpo_learned_resume": 14,
    "grpo_verifier_interrupt": 18, "grpo_verifier_resume": 12, "grpo_verifier_continuous": 11,
    "generation_inputs": 7, "generate_grpo_verifier": 6, "generate_grpo_learned": 6,
    "generate_sft": 5, "generate_ppo": 5, "reward_test": 4,
    # evaluate's one input without a long path to it: ready early, it must not be left last
    "sft_validation": 4,
    # the curves of PPO and GRPO (four points, each curve about four generation jobs, measured
    # on d563025): ready when their straight run ends, they must not wait behind short jobs
    **{f"curve_{branch}": 10 for branch in CURVES},
}


def _exports(names: tuple[str, ...]) -> Files:
    """Final files of a run's exports: the first is `final`, any other `<name>_final`."""
    files = {}
    for index, name in enumerate(names):
        prefix = "" if index == 0 else f"{name}_"
        files[f"{prefix}final"] = layout.final(name)
        files[f"{prefix}final_manifest"] = layout.final_manifest(name)
        if name in POLICIES:
            files[f"{prefix}peft"] = layout.peft(name)
    return files


def _branch(branch: str, mode: str) -> Callable[[dict], Files]:
    """A training branch's files in one mode: its state and learning report; PPO's rollouts;
    a straight run's snapshots (curves); the exporting run's final exports, which are the
    policy (`exporting_mode`)."""
    files: Files = {"state": layout.state(branch, mode),
                    "report": layout.learning_report(branch, mode)}
    if branch == "ppo":
        files["rollouts"] = layout.rollouts(mode)
    if branch in CURVES and mode == "continuous":
        files["snapshots"] = layout.snapshots(branch)
    return lambda config: {**files, **(_exports(EXPORTS[branch])
                                       if mode == exporting_mode(config) else {})}


def modes(config: dict) -> tuple[str, ...]:
    """The modes every branch runs: the three, or with `resume_triples: false` (the seeds
    target's runs beside the main one, whose triples prove resumption) the straight run only."""
    return MODES if config["resume_triples"] else ("continuous",)


def runs(stage: str, config: dict) -> bool:
    """Whether a run of `config` runs `stage`: a branch's interrupted and resumed runs and its
    resume check only with the triples (`modes`), the curves only with `curves`."""
    branch_mode = resumable(stage)
    if branch_mode and branch_mode[1] != "continuous" and not config["resume_triples"]:
        return False
    return config["curves"] or not stage.startswith("curve_")


def exporting_mode(config: dict) -> str:
    """The mode whose run exports a branch's final roles: the resume, or the straight run where
    it runs alone."""
    return "resume" if config["resume_triples"] else "continuous"


def _base_model(config: dict) -> Files:
    # the embedded base is built here, a wheel's converted; a local model is only verified,
    # never declared
    model = {"model": Path(config["model"]["path"])} if (
        config["model"]["source"] != "local") else {}
    return {"summary": layout.BASE_MODEL_SUMMARY, **model}


def _fixed(**files: Path | list[Path]) -> Callable[[dict], Files]:
    return lambda config: dict(files)  # a copy: a caller may add to it


TRAINING = ("model", "limits")  # what every stage that runs a model reads
BRANCH = (*TRAINING, "resume_triples")  # a training branch: which of its modes exports

STAGES: dict[str, Stage] = {
    # the corpus folder itself is preserved, not declared
    "prepare": Stage("pipeline.prepare", ("seed",), _fixed(audit=layout.DATA_AUDIT)),
    "base_model": Stage("pipeline.base_model", TRAINING, _base_model),
    **{f"{branch}_{mode}": Stage("pipeline.warmstart", (*BRANCH, branch), _branch(branch, mode))
       for branch in ("sft", "reward") for mode in MODES},
    **{f"{branch}_resume_check": Stage("pipeline.resumable", (),
                                       _fixed(check=layout.resume_check(branch)))
       for branch in EXPORTS},
    "sft_validation": Stage("pipeline.curves", TRAINING, _fixed(report=layout.SFT_VALIDATION)),
    **{f"ppo_{mode}": Stage("pipeline.ppo", (*BRANCH, "ppo"), _branch("ppo", mode))
       for mode in MODES},
    "ppo_report": Stage("pipeline.ppo", (), _fixed(report=layout.PPO_SAMPLED)),
    # one thread: the trainer, the rollout worker and the embedded server take turns more than
    # they overlap (measured: the default verifier run uses 1.1 cores with 1 or 2 threads, 99 s
    # or 98 s alone), so two GRPO jobs, or one beside PPO, share the two cores instead
    **{f"grpo_{run}_{mode}": Stage("pipeline.grpo_run", (*BRANCH, "grpo"),
                                   _branch(f"grpo_{run}", mode))
       for run in GRPO_RUNS for mode in MODES},
    **{f"curve_{branch}": Stage("pipeline.curves", TRAINING,
                                _fixed(curve=layout.curve(branch)))
       for branch in CURVES},
    "generation_inputs": Stage("pipeline.generate", (),
                               _fixed(pages=layout.GENERATION_PAGES)),
    **{f"generate_{policy}": Stage("pipeline.generate", TRAINING,
                                   _fixed(generations=layout.generations(policy)))
       for policy in POLICIES},
    "reward_test": Stage("pipeline.evaluate", TRAINING, _fixed(test=layout.REWARD_TEST)),
    "evaluate": Stage("pipeline.evaluate", ("resume_triples", "curves"), _fixed(
        results=layout.RESULTS, table=layout.RESULTS_TABLE, rows=layout.RESULTS_ROWS)),
    "exercise": Stage("pipeline.evaluate", TRAINING, _fixed(shortcuts=layout.EXERCISE)),
    "report": Stage("pipeline.report", (), _fixed(
        figures=[layout.figure(name) for name in layout.FIGURES], page=layout.REPORT_PAGE)),
    # outputs/seeds/summary.json; not in the default target
    # the learning sections name the main seed, whose results are the main run's
    "seeds": Stage("pipeline.seeds", ("seeds", "sft", "reward", "ppo", "grpo"),
                   _fixed(summary=layout.SEEDS_SUMMARY)),
    # run by `reprorl audit`, hashed like any stage
    "audit": Stage("core.manifest", (), _fixed()),
}
STAGES = {name: stage._replace(priority=PRIORITY.get(name, 1)) for name, stage in STAGES.items()}


def outputs(stage: str, config: dict) -> Files:
    """Every file (or folder, see layout.DIRECTORIES) `stage` writes, by the names rules use,
    its manifest last."""
    if stage not in STAGES:
        raise KeyError(f"no stage {stage!r} in reprorl.core.stages")
    return STAGES[stage].outputs(config) | {"manifest": layout.manifest(stage)}


def logs(stage: str) -> dict[str, Path]:
    """A rule's log files by name: the stage's output, and a GRPO run's timed metrics."""
    branch, mode = resumable(stage) or ("", "")
    timed = branch.startswith("grpo_") and mode in MODES
    return {"main": layout.log(stage),
            **({"metrics": layout.metrics_log(stage)} if timed else {})}


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
