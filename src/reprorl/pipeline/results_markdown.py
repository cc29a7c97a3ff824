"""outputs/results.md: the figures of results.json as Markdown tables, for a person to read.

`markdown` renders the results `evaluate` writes as results.json (policies and populations in
the order evaluated) and nothing else: every figure is one results.json holds, and the learned
score is named as results.json names it. Rates print as percentages with their 95 %
bootstrap interval, differences to SFT in points with "(within noise)" when the interval holds
0; tables are pandas' pipe tables, cells verbatim.
"""

from __future__ import annotations

from reprorl.core import layout

from . import uncertainty


def percent(value) -> str:
    """A rate as a percentage (the README's results block prints rates the same way)."""
    return "n/a" if value is None else f"{100 * value:.1f} %"


def interval_points(interval: list[float] | None) -> str:
    """A rate's 95 % interval, in percentage points, to follow `percent`."""
    return "" if interval is None else f" [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"


def _with_interval(value, interval, as_rate: bool = True) -> str:
    """A value and its 95 % interval: `60.0 % [52.8, 67.2]` or `-1.835 [-2.01, -1.66]`."""
    if value is None:
        return "n/a"
    if as_rate:
        return percent(value) + interval_points(interval)
    bounds = "" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]"
    return f"{value:.3f}{bounds}"


def _difference(d: dict, as_rate: bool) -> str:
    """A paired difference to SFT: `-33.3 points [-41.7, -24.4]`, `+0.005 [-0.39, 0.44] (within
    noise)`; within noise when 0 lies inside the interval, its bounds included."""
    if d["difference"] is None:
        return "n/a"
    scale, unit, digits = (100, " points", 1) if as_rate else (1, "", 3)
    text = f"{scale * d['difference']:+.{digits}f}{unit}"
    if d["interval_95"] is not None:
        low, high = (scale * bound for bound in d["interval_95"])
        text += f" [{low:.{min(digits, 2)}f}, {high:.{min(digits, 2)}f}]"
    return text + (" (within noise)" if d["within_noise"] else "")


def markdown_table(rows: list[dict]) -> list[str]:
    """Rows of formatted cells as one pandas table in Markdown (pipe format, cells verbatim)."""
    import pandas as pd

    return [pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True)]


def markdown(results: dict) -> str:
    """outputs/results.md: results.json's figures as tables, in the order a reader wants them."""
    score = results["learned_score_name"]
    lines = ["# reprorl results", "", results["scope"], "",
             ("Brackets: 95 % bootstrap intervals over prompts (rows that share a prompt are "
              f"drawn together; {uncertainty.RESAMPLES} resamples, seed {uncertainty.SEED})."),
             "", f"Numerics: {results.get('numerics', 'native')} "
                 "(docs/reproducibility.md: which CPU kernels the run could pick).",
             "", "## Policies", ""]
    rows = []
    for policy, result in results["policies"].items():
        for name, m in result["metrics"].items():
            ci = m["intervals_95"]
            rows.append({
                "policy": policy, "population": name, "rows": str(m["rows"]),
                "rubric success": _with_interval(m["rubric_success_rate"],
                                                 ci["rubric_success_rate"]),
                "recognized": percent(m["recognized_rate"]),
                "UNCERTIFIED": str(m["uncertified"]),
                "relevant (of recognized)": percent(m["relevant_rate_among_recognized"]),
                "unsupported certainty (of recognized)":
                    percent(m["unsupported_certainty_rate_among_recognized"]),
                "refusals": str(m["refusals"]), "without EOS": str(m["without_eos"]),
                "mean tokens": f"{m['mean_response_tokens']:.1f}",
                f"mean {score}": _with_interval(m["mean_learned_score"],
                                                     ci["mean_learned_score"], False),
                "mean log-ratio to reference": f"{m['mean_logratio_per_token']:.4f}"})
    lines += markdown_table(rows)
    lines += ["", "## Difference to SFT (paired over the same prompts)", ""]
    lines += markdown_table([
        {"policy": policy, "population": name,
         "rubric success": _difference(d["rubric_success_rate"], True),
         f"mean {score}": _difference(d["mean_learned_score"], False)}
        for policy, by_population in results["difference_to_sft"].items()
        for name, d in by_population.items()])
    test = results["reward_model_test"]
    lines += ["", "## Reward model", "",
              f"Accuracy on the 180 test pairs: {percent(test['accuracy'])} "
              f"({test['correct']} correct, {test['ties']} ties); never used for selection.",
              "", "## Resume checks", ""]
    lines += [f"- {name}: {c['status']}" for name, c in results["resume_checks"].items()]
    lines += curves_markdown(results["over_optimisation"], score)
    lines += ["", "## PPO sampled responses (temperature 1, during training)", ""]
    sampled = results["ppo_sampled_responses"]
    lines += markdown_table([
        {"window": f"{window.replace('_', ' ')} iterations",
         "rubric success": percent(sampled[window]["rubric_success_rate"]),
         "recognized": percent(sampled[window]["recognized_rate"]),
         "mean reward-model score": f"{sampled[window]['mean_reward_model_score']:.3f}"}
        for window in ("first_10", "last_10")])
    lines += ["", ("## GRPO training (sampled at temperature 1; first -> last tenth of the "
                   "training windows)"), ""]
    rows = []
    for run, summary in results["grpo_training"].items():
        first, last = summary["first_windows"], summary["last_windows"]

        def pair(key, first=first, last=last):
            values = [w.get(key) for w in (first, last)]
            return " -> ".join("n/a" if v is None else f"{v:.3g}" for v in values)

        rows.append({"run": run, "steps": str(summary["steps"]), "reward": pair("reward"),
                     "reward kept": pair("reward_kept"),
                     "frac zero std": pair("frac_reward_zero_std"),
                     "mean staleness": pair("sample/staleness_mean"),
                     "stale dropped (per window)": pair("sample/dropped_stale_count")})
    lines += markdown_table(rows)
    lines += exercise_markdown(results["exercise"])
    lines += record_markdown(results["training_record"])
    return "\n".join(lines) + "\n"


def curves_markdown(curves: dict, score: str) -> list[str]:
    lines = ["", "## Over-optimisation (180 validation prompts; never used for selection)", ""]
    if "runs" not in curves:
        return [*lines, f"Not run: {curves['why']}."]
    lines += [(f"Gold: {curves['gold']}. Proxy: {curves['proxy']}. Distance: "
               f"{curves['distance']}. Step 0 is the SFT actor every run starts from."), ""]
    return lines + markdown_table([
        {"run": run, "step": f"{p['step']} ({p['fraction']:.0%})",
         "distance (nats)": f"{p['sampled_logratio']:.3f}",
         "gold: rubric success": percent(p["rubric_success_rate"]),
         f"proxy: mean {score}": f"{p['mean_learned_score']:.3f}",
         "recognized": percent(p["recognized_rate"]), "without EOS": str(p["cut"])}
        for run, points in curves["runs"].items() for p in points])


def record_markdown(record: dict) -> list[str]:
    audit, gap = record["data_audit"], record["ppo_rescoring_gap"]
    sizes = record["checkpoint_bytes"]
    lines = ["", "## Training record", "",
             (f"Data: {audit['dataset']} revision {audit['revision']}, seed {audit['seed']}; "
              f"pairs by split {audit['pairs_by_split']}, families by split "
              f"{audit['families_by_split']}; {audit['warmstart_demonstrations']} SFT "
              f"demonstrations, {audit['rollout_prompts']} rollout prompts, "
              f"{audit['distinct_pair_demo_rollout_prompts']} distinct pair/demo/rollout "
              f"prompts, {audit['probe_rows']} probe rows in {audit['unique_probe_contexts']} "
              "contexts."), "",
             (f"PPO re-scoring gap (|re-scored - behaviour log-prob|, same weights): "
              f"{gap['before_first_update']:.3g} before the first update, at most "
              f"{gap['max_over_iterations']:.3g} over the 100 iterations."), "",
             "Validation per epoch (never used for selection):", ""]
    lines += markdown_table([
        {"model": branch, "epoch": str(v["epoch"]), "loss": f"{v['loss']:.4f}",
         "accuracy": percent(v.get("accuracy"))}
        for branch, history in record["validation_per_epoch"].items() for v in history])
    lines += ["", "Checkpoint sizes (bytes):", ""]
    lines += markdown_table(
        [{"file": layout.final(name).name, "bytes": str(size)}
         for name, size in sizes["final_exports"].items()]
        + [{"file": f"{layout.state(branch, 'continuous').name} (raw)",
            "bytes": f"{state['gzip_bytes']} ({state['raw_bytes']})"}
           for branch, state in sizes["continuous_states"].items()])
    return lines + ["", ("Stage timings, CPU seconds, peak memory and PPO's phase timings vary "
                         "run to run, so this file leaves them out: `python -m reprorl costs` "
                         "prints them from the run's manifests.")]


def exercise_markdown(ex: dict) -> list[str]:
    lines = ["", "## Politeness exercise (the frozen reward model on the 80 probe candidates)", "",
             (f"Polite wrong advice outranks plain correct advice in "
              f"{ex['polite_wrong_outranks_plain_correct']} of {ex['contexts']} contexts. Mean "
              f"score change from politeness: {ex['mean_correct_politeness_delta']:+.3f} on "
              f"correct advice (raised in {ex['politeness_raises_score_in_contexts']['correct']}"
              f" contexts), {ex['mean_incorrect_politeness_delta']:+.3f} on wrong advice (raised"
              f" in {ex['politeness_raises_score_in_contexts']['incorrect']}). Every final "
              "checkpoint, the held-out generations and the config hashed the same before and "
              "after; nothing refitted."), ""]
    return lines + markdown_table([
        {"context": c["family"],
         "politeness change, correct advice": f"{c['correct_politeness_delta']:+.3f}",
         "politeness change, wrong advice": f"{c['incorrect_politeness_delta']:+.3f}",
         "polite wrong outranks plain correct":
             "yes" if c["polite_wrong_outranks_plain_correct"] else "no"}
        for c in ex["contexts_detail"]])
