"""Evaluation pieces on hand-made inputs: denominators, probe identity, refusals."""

import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from reprorl.core.manifest import ReproError, write_json
from reprorl.pipeline import evaluate, generate, results_markdown, uncertainty
from reprorl.pipeline.corpus import HeldOutError


def row(success, recognized, unsupported=None, refusal=False, cut=False, tokens=5, score=1.0):
    return {"rubric_success": success, "recognized": recognized, "relevant": success,
            "unsupported_certainty": unsupported, "refusal": refusal, "cut": cut,
            "response_tokens": tokens, "learned_score": score, "logratio_per_token": 0.1}


def test_denominators():
    rows = [row(True, True, False), row(False, True, True), row(False, False),
            row(False, False, cut=True), row(False, True, None, refusal=True)]
    m = evaluate.summarize(rows)
    assert m["rows"] == 5 and m["rubric_success_rate"] == pytest.approx(1 / 5)  # all outputs
    assert m["recognized"] == 3 and m["uncertified"] == 2
    # unsupported certainty over recognized answers only; a refusal has None there
    assert m["unsupported_certainty"] == 1
    assert m["unsupported_certainty_rate_among_recognized"] == pytest.approx(1 / 3)
    assert m["refusals"] == 1 and m["without_eos"] == 1


def test_nothing_recognized_gives_no_rate():
    m = evaluate.summarize([row(False, False)])
    assert m["relevant_rate_among_recognized"] is None
    assert m["unsupported_certainty_rate_among_recognized"] is None


def _generations(path: Path, texts: list[str]) -> None:
    rows = [{"page": {"prompt": "same prompt", "document_id": f"P-{i}"},
             "generation": {"text": t, "response_ids": [1]}} for i, t in enumerate(texts)]
    write_json(path, {"rows": rows})


def test_repeated_probe_identity_check_fails_on_a_tampered_file(tmp_path):
    path = tmp_path / "ppo.json"
    _generations(path, ["Next step: re-enable Wi-Fi."] * 4)
    evaluate.check_repeated_probes(path)
    _generations(path, ["Next step: re-enable Wi-Fi."] * 3 + ["Next step: save it."])
    with pytest.raises(ReproError, match="P-3 and of an earlier row with the same prompt"):
        evaluate.check_repeated_probes(path)


TRIPLES = {"resume_triples": True}


def test_evaluation_refuses_missing_or_failed_resume_checks(in_tmp):
    with pytest.raises(ReproError, match="sft/resume-check.json is missing"):
        evaluate.resume_checks(TRIPLES)
    branches = ("sft", "reward", "ppo", "grpo_verifier", "grpo_learned")
    for branch in branches:
        write_json(f"outputs/learning/{branch}/resume-check.json", {"status": "PASS"})
    assert set(evaluate.resume_checks(TRIPLES)) == set(branches)
    for branch in ("reward", "grpo_learned"):  # GRPO is held to the same gate as the rest
        write_json(f"outputs/learning/{branch}/resume-check.json", {"status": "FAIL"})
        with pytest.raises(ReproError, match=f"{branch}/resume-check.json says FAIL"):
            evaluate.resume_checks(TRIPLES)
        write_json(f"outputs/learning/{branch}/resume-check.json", {"status": "PASS"})
    # a seed run without triples reads none and says why
    alone = evaluate.resume_checks({"resume_triples": False})
    assert {c["status"] for c in alone.values()} == {"not run"}


def test_generation_refuses_when_labels_are_visible(in_tmp):
    generate.assert_isolated()  # an empty folder is fine
    Path("data/generated/labels").mkdir(parents=True)
    with pytest.raises(HeldOutError, match="generation can see .*data/generated/labels"):
        generate.assert_isolated()


def test_results_schema_rejects_a_wrong_score_name():
    with pytest.raises(ReproError, match="schema"):
        evaluate.validate_results({"learned_score_name": "utility"})


EXERCISE = {"contexts": 20, "probe_rows": 80, "polite_wrong_outranks_plain_correct": 14,
            "mean_correct_politeness_delta": 0.33, "mean_incorrect_politeness_delta": 0.8,
            "politeness_raises_score_in_contexts": {"correct": 17, "incorrect": 13},
            "contexts_detail": [{"family": f"f{i}", "correct_politeness_delta": 0.5,
                                 "incorrect_politeness_delta": -0.25,
                                 "polite_wrong_outranks_plain_correct": i < 14}
                                for i in range(20)],
            "hashes_unchanged": {}, "refit": False}
TRAINING_RECORD = {
    "data_audit": {"dataset": "OfficeHelpPrefs-v1", "revision": "reprorl-r1", "seed": 49,
                   "pairs_by_split": {"train": 840}, "families_by_split": {"train": 168},
                   "warmstart_demonstrations": 168, "rollout_prompts": 672,
                   "distinct_pair_demo_rollout_prompts": 2040, "probe_rows": 80,
                   "unique_probe_contexts": 20},
    "validation_per_epoch": {"sft": [{"epoch": 1, "loss": 0.5}],
                             "reward": [{"epoch": 1, "loss": 0.25, "accuracy": 0.75}]},
    "ppo_rescoring_gap": {"before_first_update": 0.0, "max_over_iterations": 2e-6},
    "checkpoint_bytes": {"final_exports": {"ppo": 943240},
                         "continuous_states": {"ppo": {"raw_bytes": 9, "gzip_bytes": 8}}},
}

OVER_OPTIMISATION = {
    "gold": "rubric", "proxy": "score", "distance": "log-ratio", "used_for_selection": False,
    "runs": {run: [{"step": step, "fraction": step / 100, "rubric_success_rate": 0.5,
                    "mean_learned_score": step / 100, "sampled_logratio": step / 50,
                    "recognized_rate": 1.0, "cut": 0} for step in (0, 50, 100)]
             for run in ("ppo", "grpo_verifier", "grpo_learned")},
}


def prompted(rows: list[dict]) -> list[dict]:
    """Judged rows with a prompt each (rows of one prompt are drawn together)."""
    return [{**r, "prompt": f"p{i}"} for i, r in enumerate(rows)]


def test_intervals_hold_the_estimate_and_replay():
    rows = prompted([row(i % 3 == 0, True, False, score=i / 10) for i in range(60)])
    first, again = uncertainty.intervals(rows), uncertainty.intervals(rows)
    assert first == again  # a seeded generator: the same bits every time
    metrics = evaluate.summarize(rows)
    for name, (low, high) in first.items():
        assert low - 1e-12 <= metrics[name] <= high + 1e-12, name  # sums in another order
    low, high = first["rubric_success_rate"]
    assert 0.15 < low < 1 / 3 < high < 0.5  # 20 of 60


def test_rows_of_one_prompt_are_drawn_together():
    """Four copies of each of 20 answers: the interval of 20 contexts, not of 80 rows."""
    contexts = prompted([row(i % 2 == 0, True, False) for i in range(20)])
    copies = [r for r in contexts for _ in range(4)]
    alone = uncertainty.intervals(contexts)["rubric_success_rate"]
    assert uncertainty.intervals(copies)["rubric_success_rate"] == pytest.approx(alone)
    independent = prompted(copies)  # the same 80 rows, wrongly taken as 80 situations
    narrow = uncertainty.intervals(independent)["rubric_success_rate"]
    assert narrow[1] - narrow[0] < 0.75 * (alone[1] - alone[0])


def test_paired_differences_say_when_they_are_within_noise():
    base = prompted([row(i % 2 == 0, True, False, score=0.0) for i in range(100)])
    same = uncertainty.paired_difference(base, base)
    assert same["rubric_success_rate"] == {"difference": 0.0, "interval_95": [0.0, 0.0],
                                           "within_noise": True}
    better = prompted([row(i % 10 != 0, True, False, score=1.0) for i in range(100)])
    gain = uncertainty.paired_difference(better, base)["rubric_success_rate"]
    assert gain["difference"] == pytest.approx(0.4) and not gain["within_noise"]
    assert 0.25 < gain["interval_95"][0] < 0.4 < gain["interval_95"][1] < 0.55
    none = uncertainty.paired_difference(prompted([row(False, False)] * 3),
                                         prompted([row(False, False)] * 3))
    assert none["relevant_rate_among_recognized"]["within_noise"] is None  # nothing recognized
    with pytest.raises(ValueError, match="same prompts"):
        uncertainty.paired_difference(base[:3], base[3:6])


def test_markdown_names_the_score_and_the_scope(tmp_path):
    judged = prompted([row(True, True, False), row(False, False)])
    metrics = {**evaluate.summarize(judged), "intervals_95": uncertainty.intervals(judged)}
    results = {
        "scope": evaluate.SCOPE, "learned_score_name": evaluate.SCORE_NAME, "numerics": "portable",
        "policies": {"sft": {"metrics": {"test_rows": metrics}}},
        "reward_model_test": {"accuracy": 0.9, "correct": 162, "ties": 0},
        "resume_checks": {"sft": {"status": "PASS"}},
        "ppo_sampled_responses": {w: {"rubric_success_rate": 0.5, "recognized_rate": 1.0,
                                      "mean_reward_model_score": 0.2}
                                  for w in ("first_10", "last_10")},
        "grpo_training": {"verifier": {
            "steps": 3, "first_windows": {"reward": 0.25, "sample/staleness_mean": 1.0},
            "last_windows": {"reward": 0.75, "sample/staleness_mean": None}}},
        "difference_to_sft": {"ppo": {"test_rows": uncertainty.paired_difference(
            prompted([row(False, True, False), row(False, False)]), judged)}},
        "exercise": EXERCISE,
        "training_record": TRAINING_RECORD,
        "over_optimisation": OVER_OPTIMISATION,
    }
    markdown = results_markdown.markdown(results)
    assert "| policy | population | rows | rubric success |" in re.sub(r" {2,}", " ", markdown)
    assert re.search(r"^\|:?-+\|:?-+\|", markdown, flags=re.MULTILINE)  # pandas' pipe tables
    text = re.sub(r" {2,}", " ", markdown)  # the cells without the columns' padding
    assert "predicted simulated preference" in text and "no human study" in text
    assert "| sft | test_rows | 2 | 50.0 % [0.0, 100.0] |" in text
    assert "| ppo | test_rows | -50.0 points [-100.0, 0.0] (within noise) | +0.000 [0.00, 0.00]" \
           " (within noise) |" in text
    assert "outranks plain correct advice in 14 of 20 contexts" in text
    assert "| reward | 1 | 0.2500 | 75.0 % |" in text and "| sft | 1 | 0.5000 | n/a |" in text
    assert "| ppo-final.safetensors | 943240 |" in text and "at most 2e-06" in text
    assert "| f0 | +0.500 | -0.250 | yes |" in text and "| f19 | +0.500 | -0.250 | no |" in text
    assert "| verifier | 3 | 0.25 -> 0.75 | n/a -> n/a | n/a -> n/a | 1 -> n/a |" in text
    assert "| grpo_learned | 50 (50%) | 1.000 | 50.0 % | 0.500 | 100.0 % | 0 |" in text


def test_a_run_without_curves_says_so_in_its_results():
    """`curves: false` (a seed run beside the main one): no curve is read, the results say why,
    the schema takes that and no other shape, and the page prints the reason."""
    skipped = evaluate.over_optimisation({"curves": False}, sft_validation={})
    assert skipped == {"status": "not run",
                       "why": "curves is false: the main run's curves show it"}
    schema = yaml.safe_load((Path(evaluate.__file__).parents[1] / "schemas" /
                             "results.schema.yaml").read_text())["properties"]["over_optimisation"]
    jsonschema.validate(skipped, schema)
    jsonschema.validate(OVER_OPTIMISATION, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"status": "not run"}, schema)  # no reason given
    page = "\n".join(results_markdown.curves_markdown(skipped, evaluate.SCORE_NAME))
    assert page.endswith("Not run: curves is false: the main run's curves show it.")


@pytest.mark.parametrize(("triples", "curves"), [(True, True), (False, False)])
def test_stage_timings_read_the_manifests_of_the_stages_the_config_runs(in_tmp, triples,
                                                                         curves):
    """A seed run beside the main one (no triples, no curves) has no manifest of those
    stages: the timings read exactly the stages that ran (a missing one is an error)."""
    from reprorl.core import layout
    from reprorl.core.stages import CURVES, EXPORTS

    config = {"resume_triples": triples, "curves": curves}
    # the resume checks' seconds are no cost worth listing (a hash comparison)
    absent = {f"{branch}_{mode}" for branch in EXPORTS for mode in (
        ("resume_check",) if triples else ("interrupt", "resume", "resume_check"))}
    absent |= set() if curves else {f"curve_{branch}" for branch in CURVES}
    ran = [stage for stage in evaluate.UPSTREAM_STAGES if stage not in absent]
    for stage in ran:
        write_json(layout.manifest(stage), {"run": {"wall_seconds": 1.0, "cpu_seconds": 2.0,
                                                    "peak_rss_mb": 3.0}})
    assert sorted(evaluate.stage_timings(config)) == sorted(ran)
    Path(layout.manifest(ran[-1])).unlink()
    with pytest.raises(FileNotFoundError):
        evaluate.stage_timings(config)
