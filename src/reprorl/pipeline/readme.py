"""`reprorl readme-results`: the README's results block, generated from a run's outputs.

The README publishes what a run wrote, never typed figures: the block between `BEGIN` and `END`
is rebuilt from the seeds target's `outputs/seeds/summary.json` (each policy over the learning
seeds), the main seed's `outputs/results.json` (checked against its schema first) and the
run's stage manifests (when it started and ended, on which CPU, in which numerics mode), plus
the commit it ran. Nothing else in the README changes, and the file is replaced atomically.
The run's digests go to `layout.README_DIGESTS`, which a reader's `reprorl bitcheck` reads.
"""

from __future__ import annotations

import datetime
import subprocess
import textwrap
from pathlib import Path

from reprorl.core.errors import ReproError
from reprorl.core.manifest import atomic_write_text, read_json
from reprorl.core.stages import EXPORTS, GRPO_RUNS, POLICIES

from .results_markdown import interval_points, percent

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
COMMAND = "python -m reprorl readme-results"
LABELS = {
    "sft": "SFT",
    "ppo": "PPO (learned reward, sampled log-ratio penalty to SFT)",
    "grpo_verifier": "async GRPO, rubric verifier (train families)",
    "grpo_learned": "async GRPO, learned reward",
}
WIDTH = 96  # the README's prose lines stay under 100 characters


def _versus_sft(difference: dict | None) -> str:
    """A mean paired difference to SFT over the seeds, in points, with its interval."""
    if difference is None:
        return "(baseline)"
    interval = difference["interval_95"]
    noise = ", within noise" if interval and interval[0] <= 0 <= interval[1] else ""
    return f"{100 * difference['mean']:+.1f} points{interval_points(interval)}{noise}"


def load_seeds(path: Path) -> dict:
    if not path.is_file():
        raise ReproError(f"{path} is missing: the README's block reports every learning seed; "
                         "run `snakemake --cores all outputs/seeds/summary.json` first")
    summary = read_json(path)
    if "main_seed" not in summary or "interval_95" not in next(
            iter(summary["policies"].values()))["rubric_success_rate"]:
        raise ReproError(f"{path} is a summary of an older version: rebuild it with "
                         "`snakemake --cores all outputs/seeds/summary.json`")
    return summary


def load_results(path: Path) -> dict:
    from .evaluate import validate_results

    if not path.is_file():
        raise ReproError(f"{path} is missing: run `snakemake --cores all` (or its "
                         "outputs/results.json target) first")
    results = read_json(path)
    try:
        validate_results(results)
    except ReproError as error:
        raise ReproError(f"{path} is not a results file of this version ({error}): rebuild it "
                         "with `snakemake --cores all outputs/results.json`") from None
    return results


def run_facts(manifests: Path, skip: tuple[str, ...] = ()) -> dict:
    """When the run's stages started and ended, and the CPU they ran on (where recorded);
    the stages in `skip` left out."""
    spans, cpus, cores = [], set(), set()
    for path in sorted(p for p in manifests.glob("*.json") if p.stem not in skip):
        content = read_json(path)
        run = content["run"]
        start = datetime.datetime.strptime(run["started_at"], "%Y-%m-%dT%H:%M:%S%z")
        spans.append((start, start + datetime.timedelta(seconds=run["wall_seconds"])))
        # portable numerics keep the CPU type out of the hashed section (core.manifest)
        cpu = {**content.get("hashed", {}).get("cpu", {}), **run.get("cpu", {})}
        if cpu:  # manifests older than the CPU record have none
            cpus.add(f"{cpu['model_name']}, torch {cpu['torch_capability']}, "
                     f"{cpu.get('numerics', 'native')} numerics")
        if "cpus" in run:
            cores.add(run["cpus"])
    if not spans:
        return {}
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    return {"stages": len(spans), "seconds": (last - first).total_seconds(),
            "date": last.date().isoformat(), "cpus": sorted(cpus), "cores": sorted(cores)}


def commit_of(results: Path, readme: Path) -> str:
    """The commit of the checkout holding the run's `results`, marked when tracked files other
    than the README (which this tool rewrites) differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(results.resolve().parent), *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        top = Path(git("rev-parse", "--show-toplevel"))
        spare = readme.resolve()
        spare = [f":(top,exclude){spare.relative_to(top)}"] if spare.is_relative_to(top) else []
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ":/", *spare)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    return f"{commit} with uncommitted changes" if dirty else commit


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _ordered(mapping: dict, order) -> list:
    """results.json sorts its keys; the README lists them in the pipeline's order."""
    return [(k, mapping[k]) for k in [*[k for k in order if k in mapping],
                                      *sorted(set(mapping) - set(order))]]


def _curves(curves: dict | None) -> str:
    """Each run's over-optimisation curve, start to end (an older results.json has none)."""
    if not curves or "runs" not in curves:
        return ""
    parts = []
    for run, points in _ordered(curves["runs"], POLICIES):
        first, last = points[0], points[-1]
        parts.append(f"{LABELS.get(run, run).split(' (')[0]} from "
                     f"{percent(first['rubric_success_rate'])} to "
                     f"{percent(last['rubric_success_rate'])} rubric success, learned score "
                     f"{first['mean_learned_score']:.2f} to {last['mean_learned_score']:.2f}, "
                     f"at a sampled log-ratio of {last['sampled_logratio']:.2f} nats")
    return ("Over-optimisation curves (greedy answers to the 180 validation prompts, from SFT "
            f"to each run's end; every quarter in `outputs/results.md`): {'; '.join(parts)}. ")


def _seeds_table(seeds: dict) -> list[str]:
    names = ", ".join(str(s) for s in seeds["seeds"])
    rows = [f"| | rubric success, 180 held-out test prompts (greedy): mean of "
            f"{len(seeds['seeds'])} seeds [95 % interval over seeds and prompts] | each seed "
            f"({names}) | vs SFT, paired within seeds | mean predicted simulated preference, "
            "each seed |", "|---|---|---|---|---|"]
    for policy, result in _ordered(seeds["policies"], POLICIES):
        rate, score = result["rubric_success_rate"], result["mean_learned_score"]
        each = ", ".join(f"{100 * v:.1f}" for v in rate["per_seed"])
        scores = ", ".join(f"{v:.2f}" for v in score["per_seed"])
        rows.append(f"| {LABELS.get(policy, policy)} | {percent(rate['mean'])}"
                    f"{interval_points(rate['interval_95'])} | {each} | "
                    f"{_versus_sft(rate.get('difference_to_sft'))} | {scores} |")
    return rows


def block(results: dict, facts: dict, commit: str, seeds: dict, total: float | None = None,
          ) -> str:
    """The generated block, markers included: the seeds' table, then the main seed's run
    (`total`: seconds from the main run's first stage to the seeds' summary, where known)."""
    where = [f"commit {commit}"]
    if facts:
        where.append(f"the main run up to its results: {facts['stages']} stages in "
                     f"{_duration(facts['seconds'])} from the first one's start to the last "
                     f"one's end, finished {facts['date']}")
    others = [v for s, v in seeds["seconds_per_seed"].items()
              if int(s) != seeds["main_seed"] and v is not None]
    if others:
        span = {_duration(min(others)), _duration(max(others))}
        where.append(f"each other seed's run {' to '.join(sorted(span, key=len))}")
    if total:
        where.append(f"all {len(seeds['seeds'])} seeds {_duration(total)} from the main run's "
                     "first stage to the summary")
    where += [f"{n} cores" for n in facts.get("cores", [])]
    where += facts.get("cpus", [])
    main = seeds["main_seed"]
    intro = (f"What the embedded default showed when last run ({'; '.join(where)}), reported as "
             f"it came out. Every policy was trained under {len(seeds['seeds'])} learning seeds "
             f"(the main run's, {main}, and "
             f"{', '.join(str(s) for s in seeds['seeds'] if s != main)}), the corpus and the "
             "base model fixed:")
    ex = results["exercise"]
    rm, sampled = results["reward_model_test"], results["ppo_sampled_responses"]
    first, last = sampled["first_10"], sampled["last_10"]
    grpo = ", ".join(
        f"{run} from {s['first_windows']['reward']:.2f} to {s['last_windows']['reward']:.2f}"
        for run, s in _ordered(results["grpo_training"], GRPO_RUNS)
        if s["first_windows"].get("reward") is not None
        and s["last_windows"].get("reward") is not None)
    checks = ", ".join(f"{name} {c['status']}"
                       for name, c in _ordered(results["resume_checks"], EXPORTS))
    shortcut = seeds["exercise_polite_wrong_outranks_plain_correct"]
    figures = (
        f"Politeness exercise: polite wrong advice outranks plain correct advice in "
        f"{', '.join(str(v) for v in shortcut['values'])} of the {ex['contexts']} probe "
        f"contexts (one figure per seed, in the order above). The main seed's run alone: "
        f"reward model {percent(rm['accuracy'])} accurate on the {rm['pairs']} test pairs "
        f"({rm['ties']} ties). PPO's sampled responses, first vs last 10 iterations: "
        f"reward-model score from {first['mean_reward_model_score']:.2f} to "
        f"{last['mean_reward_model_score']:.2f}, rubric success from "
        f"{percent(first['rubric_success_rate'])} to {percent(last['rubric_success_rate'])}. "
        + (f"GRPO's sampled reward, first vs last tenth of the training windows: {grpo}. "
           if grpo else "")
        + _curves(results.get("over_optimisation"))
        + f"Resume checks: {checks}. Intervals: a bootstrap over the seeds, then over the "
          "prompts within each drawn seed, paired within seeds for the difference to SFT "
          "(`outputs/seeds/summary.json`; every population of the main seed in "
          "`outputs/results.md`). Same bits on your machine? `python -m reprorl bitcheck` "
          "compares your run with this one's digests.")
    return "\n".join([BEGIN, *textwrap.wrap(intro, WIDTH), "", *_seeds_table(seeds), "",
                      *textwrap.wrap(figures, WIDTH), "", *_claims(seeds), END])


def _claims(seeds: dict) -> list[str]:
    """The reading of the results, each claim with the seeds whose results show it."""
    lines = ["How to read it, each claim with the seeds whose results show it:", ""]
    total = len(seeds["seeds"])
    for claim in seeds.get("claims", []):
        shown = claim["seeds"]
        which = f": {', '.join(str(s) for s in shown)}" if shown and len(shown) < total else ""
        bullet = f"- {claim['text'][0].upper()}{claim['text'][1:]} ({len(shown)} of {total} " \
                 f"seeds{which})."
        lines += textwrap.wrap(bullet, WIDTH, subsequent_indent="  ")
    return lines


def rewrite(readme: str, generated: str) -> str:
    """`readme` with the text from BEGIN to END (markers included) replaced by `generated`."""
    starts, ends = readme.count(BEGIN), readme.count(END)
    start, end = readme.find(BEGIN), readme.find(END)
    if starts != 1 or ends != 1 or end < start:
        raise ReproError(f"the README needs exactly one `{BEGIN}` line followed by one `{END}` "
                         f"line around its results block (found {starts} and {ends}): put them "
                         f"there, then run `{COMMAND}` again")
    return readme[:start] + generated + readme[end + len(END):]


def main(results_path: str, readme_path: str, manifests: str, commit: str | None,
         seeds_path: str, digests: str | None) -> dict:
    results = load_results(Path(results_path))
    seeds = load_seeds(Path(seeds_path))
    readme = Path(readme_path)
    if not readme.is_file():
        raise ReproError(f"{readme} is missing: name the README with --readme")
    # the main run's span up to its results: the seeds stage, which waits for the other
    # seeds, and the report, which may run after them, left out; the whole span ends with the
    # seeds' summary
    text = rewrite(readme.read_text(), block(
        results, run_facts(Path(manifests), skip=("seeds", "report", "audit")),
        commit or commit_of(Path(results_path), readme), seeds,
        total=run_facts(Path(manifests), skip=("report", "audit")).get("seconds")))
    if digests:  # first: a block is never published without the digests it came from
        from .bitcheck import write

        write(Path(digests), Path(results_path).resolve().parent.parent)
    atomic_write_text(readme, text)
    return {"readme": str(readme), "results": results_path, "status": "rewritten",
            "digests": digests}
