"""The seeds target: every learning stage again under other seeds, the corpus and base fixed.

`snakemake --cores all outputs/seeds/summary.json --config seeds=[49,50,51]` builds, per seed,
the main run's results (each learning branch with its resume triple, generation, judging) in
its own working directory, outputs/seeds/<seed>/, with a nested Snakemake on the same Snakefile
and config (`reprorl seed-run`). Only the learning stages' seeds move: seed s sets `seed` of
sft, reward, ppo and grpo to s, their sampler or prompt seed to s + 100 and PPO's generation
seed to s + 200, so the defaults are s = 49 and seed 49 replays the main run. The corpus and
the base model are copied in from the main run (the same bytes for every seed; the nested run
finds them built and does not rebuild them). The `seeds` stage then reports, per policy, the
mean and spread over the seeds of the held-out rates. Not part of the default target.
"""

from __future__ import annotations

import copy
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from reprorl.core import layout
from reprorl.core.manifest import atomic_write_text, read_input, write_json
from reprorl.core.stages import POLICIES

from .readme import run_facts

# offsets from the seed of each learning stage's seeds (the defaults at seed 49)
LEARNING_SEEDS = {
    "sft": {"seed": 0, "sampler_seed": 100},
    "reward": {"seed": 0, "sampler_seed": 100},
    "ppo": {"seed": 0, "prompt_seed": 100, "generation_seed": 200},
    "grpo": {"seed": 0},
}
# what a seed's run copies from the main run: the corpus and the base, with their manifests
COPIED_STAGES = ("prepare", "base_model")
SHARED = (layout.CORPUS, layout.CORPUS_MANIFEST, layout.DATA_AUDIT, layout.BASE_MODEL_SUMMARY,
          *(layout.manifest(stage) for stage in COPIED_STAGES))
MEASURES = ("rubric_success_rate", "mean_learned_score")


def learning_seeds(seed: int) -> dict:
    return {section: {key: seed + offset for key, offset in offsets.items()}
            for section, offsets in LEARNING_SEEDS.items()}


def seed_config(config: dict, seed: int) -> dict:
    """`config` with every learning stage's seeds moved to `seed` (see the top)."""
    moved = copy.deepcopy(config)
    for section, values in learning_seeds(seed).items():
        moved[section] |= values
    return moved


def run(seed: int, config: dict, cores: int, dry_run: bool = False) -> int:
    """The main run's results under `seed`, built by a nested Snakemake in its own folder
    (`dry_run`: only list the jobs it would run)."""
    root, work = Path.cwd(), layout.seed_dir(seed)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(config["model"]["path"])
    shared = [*SHARED, *([model] if not model.is_absolute() else [])]
    for path in shared:
        if not (work / path).exists():  # a folder arrives whole (copied aside, then renamed)
            (work / path).parent.mkdir(parents=True, exist_ok=True)
            scratch = work / path.parent / f".{path.name}.copy"
            shutil.rmtree(scratch, ignore_errors=True)
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, scratch)
            scratch.replace(work / path)
    if not (work / "configs").exists():  # the Snakefile's configfile: is read from workdir
        (work / "configs").symlink_to(root / "configs")
    settings = work / "seed-config.json"
    atomic_write_text(settings, json.dumps(seed_config(config, seed), indent=1))
    # the target first: --configfile takes every value after it
    command = [sys.executable, "-m", "snakemake", str(layout.RESULTS), "--snakefile",
               str(root / "Snakefile"), "--directory", str(work), "--cores", str(cores),
               *(["-n"] if dry_run else []), "--configfile", str(settings.resolve())]
    print(" ".join(command), flush=True)
    return subprocess.run(command, check=False).returncode


def _spread(values: list[float]) -> dict:
    return {"values": values, "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


def summary(config: dict, log=print) -> dict:
    seeds = config["seeds"]
    results = {seed: read_input(layout.seed_dir(seed) / layout.RESULTS) for seed in seeds}
    policies = {}
    for policy in POLICIES:
        test = [results[s]["policies"][policy]["metrics"]["test_rows"] for s in seeds]
        policies[policy] = {name: _spread([m[name] for m in test]) for name in MEASURES}
    shortcut = [results[s]["exercise"]["polite_wrong_outranks_plain_correct"] for s in seeds]
    content = {
        "seeds": seeds, "population": "test_rows (180 held-out prompts), greedy",
        "learning_seeds": {str(s): learning_seeds(s) for s in seeds},
        "policies": policies,
        "exercise_polite_wrong_outranks_plain_correct": _spread(shortcut),
        # the stages the nested runs share (corpus, base) ran once, in the main run
        # first stage start to last stage end, the stages copied from the main run left out
        "seconds_per_seed": {str(s): run_facts(layout.seed_dir(s) / layout.MANIFESTS,
                                               skip=COPIED_STAGES)["seconds"] for s in seeds},
        "note": "sd: sample standard deviation over the seeds; the corpus and the base model "
                "are the same in every seed, so the spread is the learning stages' alone",
    }
    write_json(layout.SEEDS_SUMMARY, content)
    log(f"seeds {seeds}: " + ", ".join(
        f"{p} {v['rubric_success_rate']['mean']:.3f} (sd {v['rubric_success_rate']['sd']})"
        for p, v in policies.items()))
    return {"seeds": seeds, "policies": policies}


def stage(name: str, config: dict, run_, log=print) -> dict:
    result = summary(config, log)
    run_.finish(summary=result)
    return result
