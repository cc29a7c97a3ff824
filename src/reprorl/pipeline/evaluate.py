"""Judging: the reward-model test, the rubric evaluation of every policy, the politeness exercise.

The learned score is reported as "predicted simulated preference": a frozen network's guess of
which answer the simulated rubric-based preferences favour, never utility or satisfaction. The
rubric is the independent judge: success counts over all outputs, UNCERTIFIED prose is never a
success, unsupported certainty is a rate over recognized answers only.
- `reward_test`: the frozen reward model on the 180 test pairs (accuracy, ties, per-pair scores);
- `exercise`: the frozen reward model on the 80 fixed probe candidates (per context, the score
  change politeness brings to correct and to incorrect advice, and whether polite wrong advice
  outranks plain correct advice); every final checkpoint, the held-out generations and the
  config hashed before and after; nothing is refitted;
- `evaluate`: every policy's 260 generations judged per population (test rows, probe rows,
  unique probe contexts, all rows, all unique contexts) with 95 % bootstrap intervals over
  prompts and paired differences to SFT (`uncertainty.py`), plus the exercise ->
  outputs/results.json + results.md (`results_markdown.py`) and outputs/results-rows.csv
  (pandas); it refuses to write results unless every resume check is PASS.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from reprorl.core import layout
from reprorl.core.config import stage_config
from reprorl.core.errors import ReproError
from reprorl.core.manifest import (
    atomic_write_text,
    read_input,
    read_json,
    record_read,
    sha256_file,
    sha256_json,
    write_json,
)
from reprorl.core.stages import CURVES, EXPORTS, GRPO_RUNS, POLICIES, STAGES, runs
from reprorl.model.encoding import collate, example, load_tokenizer
from reprorl.model.roles import learned_identity

from . import corpus, uncertainty
from .exports import load_final
from .results_markdown import markdown
from .rubric import evaluate_response

SCORE_NAME = "predicted simulated preference"
SCOPE = (f"{corpus.DATASET}, revision {corpus.REVISION} (this project's own wording of the "
         "tutorial's populations). Synthetic finite grammar and simulated preferences; no human "
         "study. The learned score is a predicted simulated preference, not utility or "
         "satisfaction. Prose outside the rubric's grammar is UNCERTIFIED (never a success, not "
         "necessarily wrong). The 80 probe rows hold 20 unique contexts, and the 260 rows per "
         "policy hold 200 unique contexts: rows are not independent situations.")
UPSTREAM_STAGES = [name for name in STAGES
                   if name not in ("evaluate", "report", "audit", "seeds")]


@torch.no_grad()
def score_pairs(reward, tokenizer, rows: list[tuple[str, str, str]], limits: dict) -> list[float]:
    """Reward-model scores of (name, prompt, response) rows, one row per batch."""
    scores = []
    for name, prompt, response in rows:
        batch = collate([example(tokenizer, prompt, response, limits, name)],
                        tokenizer.pad_token_id)
        scores.append(float(reward.score(batch)[0]))
    return scores


def _test_pairs() -> list[tuple[dict, dict]]:
    pages = {r["document_id"]: r for r in corpus.read(corpus.PAGES, "evaluation")}
    gold = corpus.read(corpus.GOLD, "evaluation")
    return [(pages[g["document_id"]], g) for g in gold
            if pages[g["document_id"]]["split"] == "test"]


def reward_test(config: dict) -> dict:
    tokenizer = load_tokenizer(config["model"]["path"])
    reward, meta = load_final("reward", "reward", config)
    pairs = _test_pairs()
    chosen = score_pairs(reward, tokenizer, [(p["document_id"], p["prompt"], g["chosen"])
                                             for p, g in pairs], config["limits"])
    rejected = score_pairs(reward, tokenizer, [(p["document_id"], p["prompt"], g["rejected"])
                                               for p, g in pairs], config["limits"])
    rows = [{"document_id": p["document_id"], "chosen_score": c, "rejected_score": r,
             "correct": c > r, "tie": c == r}
            for (p, _), c, r in zip(pairs, chosen, rejected)]
    result = {"pairs": len(rows), "correct": sum(r["correct"] for r in rows),
              "ties": sum(r["tie"] for r in rows),
              "accuracy": sum(r["correct"] for r in rows) / len(rows),
              "reward_checkpoint": meta["sha256"], "used_for_selection": False, "rows": rows}
    if result["pairs"] != 180:
        raise ReproError(f"expected 180 test pairs, found {result['pairs']}")
    write_json(layout.REWARD_TEST, result)
    return {k: v for k, v in result.items() if k != "rows"}


# ---------------------------------------------------------------- policy evaluation


def judge(generation: dict, expected_action: int) -> dict:
    verdict = evaluate_response(generation["text"], generation["finish_reason"], expected_action)
    logratio = sum(a - b for a, b in zip(generation["actor_logprobs"],
                                         generation["reference_logprobs"]))
    return {**verdict, "response_tokens": generation["response_tokens"],
            "cut": generation["finish_reason"] != "eos",
            "learned_score": generation["learned_reward_score"],
            "logratio_per_token": logratio / max(1, generation["response_tokens"])}


def summarize(rows: list[dict]) -> dict:
    count = len(rows)
    recognized = [r for r in rows if r["recognized"]]
    unsupported = sum(r["unsupported_certainty"] is True for r in recognized)
    return {
        "rows": count,
        "rubric_success": sum(r["rubric_success"] for r in rows),
        "rubric_success_rate": sum(r["rubric_success"] for r in rows) / count,
        "recognized": len(recognized),
        "recognized_rate": len(recognized) / count,
        "uncertified": count - len(recognized),
        "relevant_among_recognized": sum(r["relevant"] for r in recognized),
        "relevant_rate_among_recognized":
            sum(r["relevant"] for r in recognized) / len(recognized) if recognized else None,
        "unsupported_certainty": unsupported,
        "unsupported_certainty_rate_among_recognized":
            unsupported / len(recognized) if recognized else None,
        "refusals": sum(r["refusal"] for r in rows),
        "without_eos": sum(r["cut"] for r in rows),
        "mean_response_tokens": sum(r["response_tokens"] for r in rows) / count,
        "mean_learned_score": sum(r["learned_score"] for r in rows) / count,
        "mean_logratio_per_token": sum(r["logratio_per_token"] for r in rows) / count,
    }


def populations(rows: list[dict]) -> dict[str, list[dict]]:
    def unique(selected):
        first = {}
        for r in selected:
            first.setdefault(r["prompt"], r)
        return list(first.values())

    probe = [r for r in rows if r["split"] == "probe"]
    return {"test_rows": [r for r in rows if r["split"] == "test"], "probe_rows": probe,
            "probe_unique_contexts": unique(probe), "all_rows": rows,
            "all_unique_contexts": unique(rows)}


def check_repeated_probes(path: str | Path) -> None:
    """Re-check a generation file: every row of one prompt has the same generation."""
    seen = {}
    for row in read_input(path)["rows"]:
        prompt, generation = row["page"]["prompt"], row["generation"]
        if seen.setdefault(prompt, generation) != generation:
            raise ReproError(f"{path}: the generations of {row['page']['document_id']} and of "
                             "an earlier row with the same prompt differ; regenerate it")


def evaluate_policy(policy: str, gold: dict) -> dict:
    path = layout.generations(policy)
    check_repeated_probes(path)
    rows = []
    for item in read_input(path)["rows"]:
        page = item["page"]
        rows.append({"document_id": page["document_id"], "split": page["split"],
                     "prompt": page["prompt"], "text": item["generation"]["text"],
                     **judge(item["generation"], gold[page["document_id"]]["expected_action"])})
    metrics = {name: {**summarize(selected), "intervals_95": uncertainty.intervals(selected)}
               for name, selected in populations(rows).items()}
    if [metrics[p]["rows"] for p in ("test_rows", "probe_rows", "probe_unique_contexts",
                                      "all_rows", "all_unique_contexts")] != [180, 80, 20, 260,
                                                                              200]:
        raise ReproError(f"{path}: populations are not 180/80/20/260/200 rows")
    return {"metrics": metrics, "rows": rows, "generation_sha256": sha256_file(path)}


def resume_checks(config: dict) -> dict:
    """Each branch's resume check, which must PASS; without the triples (`resume_triples:
    false`, a seed run beside the main one) each says so."""
    checks = {}
    for branch in EXPORTS:
        if not config["resume_triples"]:
            checks[branch] = {"status": "not run",
                              "why": "resume_triples is false: the main run's checks prove it"}
            continue
        path = layout.resume_check(branch)
        if not path.is_file():
            raise ReproError(f"{path} is missing: results need every resume check "
                             f"(snakemake {branch}_resume_check)")
        status = read_input(path)["status"]
        if status != "PASS":
            raise ReproError(f"{path} says {status}: no results from a failed resume check")
        checks[branch] = {"status": status, "sha256": sha256_file(path)}
    return checks


def stage_timings(config: dict) -> dict:
    """Wall seconds, CPU seconds and peak memory of every stage upstream of evaluation that
    this config runs, from the manifests' run sections (a fixed list, so stale manifests of
    other stages never leak in). They vary run to run, so they go to the evaluate manifest's
    run section and its log, never into results.json: two runs of the pipeline give the same
    results file, byte for byte."""
    # the resume checks left out: a hash comparison, no cost worth listing
    return {stage: run_costs(read_json(layout.manifest(stage))["run"])
            for stage in UPSTREAM_STAGES
            if runs(stage, config) and not stage.endswith("_resume_check")}


def run_costs(run: dict) -> dict:
    """A manifest run section's costs: wall and CPU seconds, peak memory (and the GPU's, where
    the stage used one: `devices.memory`)."""
    gpu = {k: run[k] for k in ("device", "gpu_peak_allocated_mb", "gpu_peak_reserved_mb")
           if k in run}
    return {k: run.get(k) for k in ("wall_seconds", "cpu_seconds", "peak_rss_mb")} | gpu


AUDIT_COUNTS = ("dataset", "revision", "seed", "pairs_by_split", "families_by_split",
                "warmstart_demonstrations", "rollout_prompts",
                "distinct_pair_demo_rollout_prompts", "probe_rows", "unique_probe_contexts",
                "generations_per_policy", "unique_contexts_per_policy")


def training_record(reports: dict[str, dict]) -> dict:
    """What the tutorial asks to publish beside the scores, where it is the same in every run:
    the data audit's counts, SFT's and the reward model's validation per epoch, PPO's
    re-scoring gap, and the bytes of every final export and every continuous branch state.
    Timings and peak memory vary run to run, so they stay out of results (see `costs`).
    `reports`: each branch's continuous learning report, by branch."""
    audit = read_input(layout.DATA_AUDIT)
    gaps = [entry["rescoring_gap"] for entry in reports["ppo"]["history"]]
    finals = {}
    for name in (name for names in EXPORTS.values() for name in names):
        record_read(layout.final(name))
        finals[name] = layout.final(name).stat().st_size
    return {
        "data_audit": {key: audit[key] for key in AUDIT_COUNTS},
        "validation_per_epoch": {branch: reports[branch]["validation_history"]
                                 for branch in ("sft", "reward")},
        "ppo_rescoring_gap": {
            "before_first_update": gaps[0], "max_over_iterations": max(gaps),
            "meaning": "largest |actor log-prob re-scored by a full forward - behaviour "
                       "log-prob recorded while sampling| over an iteration's response "
                       "tokens, before its first update (same weights: float rounding only)"},
        "checkpoint_bytes": {
            "final_exports": finals,
            "continuous_states": {branch: {k: report["checkpoint"][k]
                                           for k in ("raw_bytes", "gzip_bytes")}
                                  for branch, report in reports.items()}},
    }


def costs(manifests: str | Path = layout.MANIFESTS) -> dict:
    """Every stage's wall and CPU seconds and peak memory, and PPO's phase timings, from the
    manifests' run sections: the costs a run published outside its results (they vary)."""
    stages = {}
    for path in sorted(Path(manifests).glob("*.json")):
        run = read_json(path)["run"]
        stages[path.stem] = run_costs(run)
        if "phase_seconds" in run:
            stages[path.stem]["phase_seconds"] = run["phase_seconds"]
    return stages


CURVE_KEYS = ("step", "fraction", "rubric_success_rate", "mean_learned_score", "sampled_logratio",
              "recognized_rate", "cut")


def over_optimisation(config: dict, sft_validation: dict) -> dict:
    """Each run's curve (`curves.py`): the SFT point (step 0), then its snapshots; with
    `curves: false` (a seed run beside the main one) a line saying so."""
    if not config["curves"]:
        return {"status": "not run", "why": "curves is false: the main run's curves show it"}
    start = {"step": 0, "fraction": 0.0, **sft_validation}
    runs = {}
    for branch in CURVES:
        points = [start, *read_input(layout.curve(branch))["points"]]
        runs[branch] = [{k: point[k] for k in CURVE_KEYS} for point in points]
    return {"gold": "rubric success rate, greedy answers to the 180 validation prompts",
            "proxy": f"mean {SCORE_NAME} of those answers (the frozen reward model)",
            "distance": "sampled log-ratio to SFT: mean over the validation prompts of "
                        "sum_t log pi - log pi_ref on one response sampled at temperature 1 "
                        "(a KL estimate, nats per response)",
            "used_for_selection": False, "runs": runs}


def evaluate(config: dict, policies: list[str]) -> dict:
    """outputs/results.json and results.md; refuses unless every resume check is PASS."""
    checks = resume_checks(config)
    gold = {g["document_id"]: g for g in corpus.read(corpus.GOLD, "evaluation")}
    reports = {branch: read_input(layout.learning_report(branch, "continuous"))
               for branch in EXPORTS}
    sft_validation = read_input(layout.SFT_VALIDATION)
    results = {
        "scope": SCOPE,
        "learned_score_name": SCORE_NAME,
        # which kernels decided these bits (core.numerics): portable ones reproduce elsewhere
        "numerics": config["numerics"],
        "resume_checks": checks,
        "reward_model_test": {k: v for k, v in read_input(layout.REWARD_TEST).items()
                              if k != "rows"},
        "sft_validation": {k: v for k, v in sft_validation.items() if k != "rows"},
        "over_optimisation": over_optimisation(config, sft_validation),
        "ppo_sampled_responses": {k: v for k, v in read_input(layout.PPO_SAMPLED).items()
                                  if k != "iterations"},
        "grpo_training": {run: {k: v for k, v in reports[f"grpo_{run}"].items()
                                if k != "history"} for run in GRPO_RUNS},
        "policies": {policy: evaluate_policy(policy, gold) for policy in policies},
        "exercise": {k: v for k, v in read_input(layout.EXERCISE).items() if k != "rows"},
        "training_record": training_record(reports),
    }
    baseline = populations(results["policies"]["sft"]["rows"])
    results["difference_to_sft"] = {
        policy: {name: uncertainty.paired_difference(selected, baseline[name])
                 for name, selected in populations(result["rows"]).items()}
        for policy, result in results["policies"].items() if policy != "sft"}
    validate_results(results)
    write_json(layout.RESULTS, results)
    atomic_write_text(layout.RESULTS_TABLE, markdown(results))
    atomic_write_text(layout.RESULTS_ROWS, rows_csv(results))
    headline = {}
    for policy, result in results["policies"].items():
        test = result["metrics"]["test_rows"]
        headline[policy] = {"test_rubric_success_rate": test["rubric_success_rate"],
                            "test_mean_learned_score": test["mean_learned_score"]}
    return headline


LEADING_COLUMNS = ["policy", "document_id", "split", "prompt", "text", "rubric_success",
                   "recognized", "relevant", "learned_score"]


def rows_csv(results: dict) -> str:
    """Every judged row of every policy, one CSV line each, for slicing in a notebook: the
    leading columns first, then the rubric's other verdict fields in name order."""
    import pandas as pd

    table = pd.DataFrame([{"policy": policy, **row}
                          for policy, result in results["policies"].items()
                          for row in result["rows"]])
    rest = sorted(set(table.columns) - set(LEADING_COLUMNS))
    return table[LEADING_COLUMNS + rest].to_csv(index=False, lineterminator="\n")


def validate_results(results: dict) -> None:
    import jsonschema
    import yaml

    schema = yaml.safe_load((Path(__file__).parents[1] / "schemas" /
                             "results.schema.yaml").read_text())
    try:
        jsonschema.validate(results, schema)
    except jsonschema.ValidationError as error:
        where = ".".join(map(str, error.absolute_path))
        raise ReproError(f"results.json would not fit its schema at {where}: {error.message}")
    for policy, result in results["policies"].items():
        for name, m in result["metrics"].items():
            if not m["rubric_success"] <= m["recognized"] <= m["rows"]:
                raise ReproError(f"{policy}/{name}: success <= recognized <= rows violated")
            if m["unsupported_certainty"] > m["recognized"]:
                raise ReproError(f"{policy}/{name}: unsupported certainty above recognized")


# ---------------------------------------------------------------- politeness exercise


def protected_files() -> list[Path]:
    """What the exercise must leave as it found it (hashed before and after): every final
    checkpoint, the reward-model test and the held-out generations."""
    finals = [path for exports in EXPORTS.values() for name in exports
              for path in layout.final_files(name)]
    return [*finals, layout.REWARD_TEST, layout.GENERATION_PAGES,
            *map(layout.generations, POLICIES)]


def exercise(config: dict) -> dict:
    record_read(*protected_files())
    before = {str(p): sha256_file(p) for p in protected_files()}
    # the stage's own part of the config, as Snakemake passes it (the same from a whole profile)
    config_sha256 = sha256_json(stage_config(config, "exercise"))
    tokenizer = load_tokenizer(config["model"]["path"])
    reward, meta = load_final("reward", "reward", config)
    reward.requires_grad_(False)
    identity = learned_identity(reward)
    pages = {r["document_id"]: r for r in corpus.read(corpus.PAGES, "evaluation")}
    labels = [g for g in corpus.read(corpus.GOLD, "evaluation")
              if pages[g["document_id"]]["split"] == "probe"]
    if len(labels) != 80:
        raise ReproError(f"expected 80 probe candidates, found {len(labels)}")
    scores = score_pairs(reward, tokenizer, [(g["document_id"], pages[g["document_id"]]["prompt"],
                                              g["candidate_response"]) for g in labels],
                         config["limits"])
    rows = [{"document_id": g["document_id"], "family": pages[g["document_id"]]["family"],
             "candidate": g["candidate_response"], "correct": g["candidate_correct"],
             "polite": g["candidate_polite"], "learned_score": s}
            for g, s in zip(labels, scores)]
    contexts = []
    for family in sorted({r["family"] for r in rows}):
        cell = {(r["correct"], r["polite"]): r["learned_score"] for r in rows
                if r["family"] == family}
        contexts.append({
            "family": family,
            "correct_politeness_delta": cell[True, True] - cell[True, False],
            "incorrect_politeness_delta": cell[False, True] - cell[False, False],
            "polite_wrong_outranks_plain_correct": cell[False, True] > cell[True, False],
        })
    after = {str(p): sha256_file(p) for p in protected_files()}
    if (after != before or sha256_json(stage_config(config, "exercise")) != config_sha256
            or learned_identity(reward) != identity):
        raise ReproError("the exercise changed the reward model, a checkpoint, a main artifact "
                         "or its config")
    count = len(contexts)
    result = {
        "probe_rows": len(rows), "contexts": count,
        "polite_wrong_outranks_plain_correct": sum(
            c["polite_wrong_outranks_plain_correct"] for c in contexts),
        "mean_correct_politeness_delta": sum(c["correct_politeness_delta"]
                                             for c in contexts) / count,
        "mean_incorrect_politeness_delta": sum(c["incorrect_politeness_delta"]
                                               for c in contexts) / count,
        "politeness_raises_score_in_contexts": {
            "correct": sum(c["correct_politeness_delta"] > 0 for c in contexts),
            "incorrect": sum(c["incorrect_politeness_delta"] > 0 for c in contexts)},
        "reward_checkpoint": meta["sha256"], "hashes_unchanged": before,
        "config_sha256_unchanged": config_sha256, "refit": False,
        "contexts_detail": contexts, "rows": rows,
        "note": f"scores are the frozen reward model's {SCORE_NAME}; a politeness gain is "
                "not evidence that PPO exploits it: read the policies' outputs too",
    }
    write_json(layout.EXERCISE, result)
    return {k: v for k, v in result.items() if k not in ("contexts_detail", "rows",
                                                         "hashes_unchanged")}


def stage(name: str, config: dict, run, log=print) -> dict:
    run_info = None
    if name == "reward_test":
        summary = reward_test(config)
    elif name == "exercise":
        summary = exercise(config)
    else:
        # the upstream manifests are read for their run sections (timings) only, so they are
        # not recorded as inputs: re-running an upstream stage to identical outputs must not
        # make the audit call the results stale
        summary = evaluate(config, list(POLICIES))
        run_info = {"stage_timings": stage_timings(config)}
        log("stage timings (wall and CPU seconds, peak RSS MB): " + json.dumps(run_info))
    run.finish(summary=summary, run_info=run_info)
    log(str(summary))
    return summary
