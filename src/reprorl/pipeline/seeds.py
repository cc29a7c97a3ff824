"""The seeds target: every learning stage again under other seeds, the corpus and base fixed.

`snakemake --cores all outputs/seeds/summary.json` (seeds: the config's `seeds`, five by
default) takes the main run's results for the main seed and builds, for each other seed, the
same results in its own working directory, outputs/seeds/<seed>/, with a nested Snakemake on
the same Snakefile and config (`reprorl seed-run`), without resume triples (the main run's
checks prove resumption). Only the learning stages' seeds move: seed s sets `seed` of sft,
reward, ppo and grpo to s, their sampler or prompt seed to s + 100 and PPO's generation seed to
s + 200, so the defaults are s = 49, the main seed. The corpus and the base model are copied in
from the main run (the same bytes for every seed; the nested run finds them built). The `seeds`
stage then reports, per policy, the mean over the seeds of the held-out rates, each seed's own,
and an interval over seeds and prompts (`uncertainty.over_seeds`). Not in the default target.
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

from . import uncertainty
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
    """`config` with every learning stage's seeds moved to `seed`, without resume triples or
    curves (see the top)."""
    moved = copy.deepcopy(config)
    for section, values in learning_seeds(seed).items():
        moved[section] |= values
    moved["resume_triples"] = False
    moved["curves"] = False
    return moved


def main_seed(config: dict) -> int | None:
    """The seed whose learning seeds are the config's own: the main run is that seed's run
    (None where the config's seeds follow no single s)."""
    seed = config["sft"]["seed"]
    matches = all(config[section][key] == value
                  for section, values in learning_seeds(seed).items()
                  for key, value in values.items())
    return seed if matches else None


def results_path(seed: int, config: dict) -> Path:
    """Where the seed's results are: the main run's for the main seed."""
    return layout.RESULTS if seed == main_seed(config) else layout.seed_dir(seed) / layout.RESULTS


def manifests_path(seed: int, config: dict) -> Path:
    return (layout.MANIFESTS if seed == main_seed(config)
            else layout.seed_dir(seed) / layout.MANIFESTS)


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


def _rate(results: dict, policy: str) -> float:
    return results["policies"][policy]["metrics"]["test_rows"]["rubric_success_rate"]


def _rose(windows: dict) -> bool:
    first, last = windows["first_windows"].get("reward"), windows["last_windows"].get("reward")
    return first is not None and last is not None and last > first


# The README's reading of the results, one claim each, and what in one seed's results shows it;
# the summary counts the seeds that do (the block prints the count beside the claim).
CLAIMS = {
    "ppo_proxy_up_gold_down": (
        "PPO raised the reward model's score of the responses it sampled in training, while its "
        "greedy test answers fell below SFT's rubric success",
        lambda r: (r["ppo_sampled_responses"]["last_10"]["mean_reward_model_score"]
                   > r["ppo_sampled_responses"]["first_10"]["mean_reward_model_score"])
        and _rate(r, "ppo") < _rate(r, "sft")),
    "grpo_learned_proxy_up_gold_down": (
        "GRPO on the learned reward raised its sampled reward, while its greedy test answers "
        "fell below SFT's rubric success",
        lambda r: _rose(r["grpo_training"]["learned"])
        and _rate(r, "grpo_learned") < _rate(r, "sft")),
    "grpo_verifier_gold_up": (
        "GRPO on the rubric itself raised the greedy test answers' rubric success above SFT's",
        lambda r: _rate(r, "grpo_verifier") > _rate(r, "sft")),
    "ppo_greedy_score_flat": (
        "what PPO raised is the score of its sampled training responses, not the learned score "
        "of its greedy answers, which the paired interval does not put above SFT's",
        lambda r: r["difference_to_sft"]["ppo"]["test_rows"]["mean_learned_score"][
            "interval_95"][0] <= 0),
    "accurate_yet_shortcut": (
        "the reward model ranks at least 90 % of the held-out test pairs right, yet on more than "
        "half of the probe contexts it ranks polite wrong advice above plain correct advice",
        lambda r: r["reward_model_test"]["accuracy"] >= 0.9
        and r["exercise"]["polite_wrong_outranks_plain_correct"] > r["exercise"]["contexts"] / 2),
}


def _spread(values: list[float]) -> dict:
    return {"values": values, "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


def summary(config: dict, log=print) -> dict:
    seeds = config["seeds"]
    results = {seed: read_input(results_path(seed, config)) for seed in seeds}
    test = {policy: [[r for r in results[s]["policies"][policy]["rows"] if r["split"] == "test"]
                     for s in seeds] for policy in POLICIES}
    policies = {}
    for policy in POLICIES:
        over = uncertainty.over_seeds(test[policy])
        versus = uncertainty.over_seeds(test[policy], test["sft"]) if policy != "sft" else None
        policies[policy] = {name: {**over[name], **_spread(over[name]["per_seed"]),
                                   **({"difference_to_sft": versus[name]} if versus else {})}
                            for name in MEASURES}
    shortcut = [results[s]["exercise"]["polite_wrong_outranks_plain_correct"] for s in seeds]
    content = {
        "seeds": seeds, "main_seed": main_seed(config),
        "population": "test_rows (180 held-out prompts), greedy",
        "learning_seeds": {str(s): learning_seeds(s) for s in seeds},
        "policies": policies,
        "exercise_polite_wrong_outranks_plain_correct": {
            **_spread(shortcut), "contexts": results[seeds[0]]["exercise"]["contexts"]},
        # first stage start to last stage end; the stages copied from the main run left out
        "seconds_per_seed": {str(s): run_facts(manifests_path(s, config),
                                               skip=COPIED_STAGES).get("seconds") for s in seeds},
        "claims": [{"claim": name, "text": text, "seeds": [s for s in seeds
                                                            if shows(results[s])]}
                   for name, (text, shows) in CLAIMS.items()],  # the README's order
        "interval": "95 %, bootstrap over the seeds, then over the prompts within each drawn "
                    "seed (uncertainty.over_seeds); difference_to_sft is paired within seeds",
        "note": "sd: sample standard deviation over the seeds; the corpus and the base model "
                "are the same in every seed, so the spread is the learning stages' alone; the "
                "main seed's run has its resume triples, the others do not",
    }
    write_json(layout.SEEDS_SUMMARY, content)
    log(f"seeds {seeds}: " + ", ".join(
        f"{p} {v['rubric_success_rate']['mean']:.3f} {v['rubric_success_rate']['interval_95']}"
        for p, v in policies.items()))
    return {"seeds": seeds, "policies": {p: {m: {k: v[m][k] for k in ("mean", "interval_95")}
                                             for m in MEASURES} for p, v in policies.items()}}


def stage(name: str, config: dict, run_, log=print) -> dict:
    result = summary(config, log)
    run_.finish(summary=result)
    return result
