"""`reprorl readme-results`: the README's results block rebuilt from a run's outputs."""

import pytest
from test_evaluate import (  # the tests folder is on sys.path
    EXERCISE,
    OVER_OPTIMISATION,
    TRAINING_RECORD,
    prompted,
    row,
)

from reprorl import cli
from reprorl.core.manifest import write_json
from reprorl.core.stages import EXPORTS
from reprorl.pipeline import evaluate, readme, uncertainty

README = ("# title\n\ntyped prose stays\n\n" + readme.BEGIN + "\nold table\n" + readme.END
          + "\n\nmore typed prose\n")


def _rows(successes: int, score: float) -> list[dict]:
    return prompted([row(True, True, False, score=score)] * successes
                    + [row(False, True, False, score=score)] * (5 - successes))


def _metrics(successes: int, score: float) -> dict:
    rows = _rows(successes, score)
    return {**evaluate.summarize(rows), "intervals_95": uncertainty.intervals(rows)}


def _results() -> dict:
    """A results.json that passes its schema: SFT 3 of 5, PPO 2 of 5, the GRPO runs 4 and 1."""
    policies = {}
    for policy, successes, score in (("sft", 3, -1.84), ("ppo", 2, -1.15),
                                     ("grpo_verifier", 4, -0.86), ("grpo_learned", 1, -0.69)):
        metrics = _metrics(successes, score)
        populations = ("test_rows", "probe_rows", "probe_unique_contexts", "all_rows",
                       "all_unique_contexts")
        policies[policy] = {"metrics": dict.fromkeys(populations, metrics),
                            "rows": [{}] * 260, "generation_sha256": "0" * 64}
    windows = {"reward": 0.5}
    return {
        "scope": evaluate.SCOPE, "learned_score_name": evaluate.SCORE_NAME, "numerics": "portable",
        "resume_checks": {b: {"status": "PASS", "sha256": "0" * 64}
                          for b in EXPORTS},
        "reward_model_test": {"pairs": 180, "correct": 180, "ties": 0, "accuracy": 1.0,
                              "used_for_selection": False},
        "sft_validation": {},
        "over_optimisation": OVER_OPTIMISATION,
        "ppo_sampled_responses": {w: {"rubric_success_rate": 0.275, "recognized_rate": 1.0,
                                      "mean_reward_model_score": 0.01}
                                  for w in ("first_10", "last_10")},
        "grpo_training": {run: {"run": run, "steps": 3, "first_windows": windows,
                                "last_windows": {"reward": 2.0}, "settings": {}}
                          for run in ("verifier", "learned")},
        "policies": policies,
        "difference_to_sft": {policy: dict.fromkeys(populations, uncertainty.paired_difference(
            _rows(successes, 0.0), _rows(3, 0.0))) for policy, successes in (
                ("ppo", 2), ("grpo_verifier", 4), ("grpo_learned", 1))},
        "exercise": EXERCISE,
        "training_record": TRAINING_RECORD,
    }


def _seeds() -> dict:
    """A seeds summary of two seeds: SFT 3 and 3 of 5, PPO 2 and 1, the GRPO runs 4, 5 and 1,
    0, learned scores as in `_results`."""
    per_seed = {"sft": (3, 3, -1.84), "ppo": (2, 1, -1.15), "grpo_verifier": (4, 5, -0.86),
                "grpo_learned": (1, 0, -0.69)}
    rows = {policy: [_rows(a, score), _rows(b, score)]
            for policy, (a, b, score) in per_seed.items()}
    policies = {}
    for policy in per_seed:
        over = uncertainty.over_seeds(rows[policy])
        versus = uncertainty.over_seeds(rows[policy], rows["sft"]) if policy != "sft" else None
        policies[policy] = {name: {**over[name], **({"difference_to_sft": versus[name]}
                                                    if versus else {})}
                            for name in ("rubric_success_rate", "mean_learned_score")}
    return {"seeds": [49, 50], "main_seed": 49, "policies": policies,
            "seconds_per_seed": {"49": 1092.0, "50": 400.0},
            "exercise_polite_wrong_outranks_plain_correct": {"values": [14, 12]},
            "claims": [{"claim": "a", "text": "the first claim holds", "seeds": [49, 50]},
                       {"claim": "b", "text": "the second one", "seeds": [50]}]}


def _run(in_tmp, results: dict, text: str = README) -> int:
    write_json("outputs/results.json", results)
    write_json("outputs/seeds/summary.json", _seeds())
    # the seeds stage, after the other seeds: in the whole span, not in the main run's; the
    # report, run after them, in neither
    for stage, started, seconds in (("prepare", "2026-12-01T14:42:31+0000", 3.5),
                                    ("evaluate", "2026-12-01T15:00:40+0000", 2.75),
                                    ("seeds", "2026-12-01T15:20:29+0000", 1.5),
                                    ("report", "2026-12-01T15:30:00+0000", 1.0)):
        write_json(f"outputs/manifests/{stage}.json", {
            "hashed": {"cpu": {"model_name": "Some CPU", "torch_capability": "AVX2"}},
            "run": {"started_at": started, "wall_seconds": seconds, "cpus": 2}})
    (in_tmp / "README.md").write_text(text)
    return cli.main(["readme-results", "--commit", "abc1234", "--digests", ""])


def test_it_rewrites_only_the_block_between_the_markers(in_tmp):
    assert _run(in_tmp, _results()) == 0
    text = (in_tmp / "README.md").read_text()
    before, after = README.split(readme.BEGIN)[0], README.split(readme.END)[1]
    assert text.startswith(before + readme.BEGIN) and text.endswith(readme.END + after)
    assert "old table" not in text
    rows = text.split(readme.BEGIN)[1].split(readme.END)[0]
    table = [line for line in rows.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| | rubric success, 180 held-out test prompts (greedy): mean "
                               "of 2 seeds [95 % interval over seeds and prompts] | each seed "
                               "(49, 50) |")
    assert table[1].startswith("| SFT | 60.0 % [")
    assert table[1].endswith("| 60.0, 60.0 | (baseline) | -1.84, -1.84 |")
    assert "| 30.0 % [" in table[2] and "| 40.0, 20.0 | -30.0 points [" in table[2]
    assert "| 90.0 % [" in table[3] and "| 80.0, 100.0 | +30.0 points [" in table[3]
    flat = " ".join(rows.split())
    assert ("polite wrong advice outranks plain correct advice in 14, 12 of the 20 probe "
            "contexts (one figure per seed") in flat
    assert ("commit abc1234; the main run up to its results: 2 stages in 18 min 12 s from the "
            "first one's start to the last one's end, finished 2026-12-01; each other seed's "
            "run 6 min 40 s; all 2 seeds 38 min 0 s from the main run's first stage to the "
            "summary; 2 cores; Some CPU, torch AVX2, native numerics") in flat
    assert "trained under 2 learning seeds (the main run's, 49, and 50)" in flat
    assert "`python -m reprorl bitcheck`" in flat
    assert "- The first claim holds (2 of 2 seeds)." in rows
    assert "- The second one (1 of 2 seeds: 50)." in rows
    assert "100.0 % accurate on the 180 test pairs" in flat
    assert "verifier from 0.50 to 2.00, learned from 0.50 to 2.00" in flat
    assert ("PPO from 50.0 % to 50.0 % rubric success, learned score 0.00 to 1.00, at a "
            "sampled log-ratio of 2.00 nats; async GRPO, rubric verifier from") in flat
    assert _run(in_tmp, _results(), text) == 0  # a second run regenerates the same block
    assert (in_tmp / "README.md").read_text() == text


@pytest.mark.parametrize("text", ["# no markers\n", README.replace(readme.END, ""),
                                  README + readme.BEGIN + "\n"],
                         ids=["none", "no end", "two begins"])
def test_a_readme_without_one_pair_of_markers_is_refused(in_tmp, capsys, text):
    assert _run(in_tmp, _results(), text) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and readme.BEGIN in error and "put them there" in error
    assert (in_tmp / "README.md").read_text() == text


def test_results_that_fail_their_schema_are_refused(in_tmp, capsys):
    results = _results()
    del results["reward_model_test"]
    assert _run(in_tmp, results) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "schema" in error
    assert "rebuild it with `snakemake --cores all outputs/results.json`" in error
    assert (in_tmp / "README.md").read_text() == README


def test_a_block_without_the_seeds_summary_is_refused(in_tmp, capsys):
    write_json("outputs/results.json", _results())
    (in_tmp / "README.md").write_text(README)
    assert cli.main(["readme-results", "--commit", "abc1234", "--digests", ""]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "outputs/seeds/summary.json" in error
    assert (in_tmp / "README.md").read_text() == README
