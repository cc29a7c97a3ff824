"""Evaluation pieces on hand-made inputs: denominators, probe identity, refusals."""

from pathlib import Path

import pytest

from reprorl import evaluate, generate
from reprorl.corpus import HeldOutError
from reprorl.manifest import ReproError, write_json


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


def test_evaluation_refuses_missing_or_failed_resume_checks(in_tmp):
    with pytest.raises(ReproError, match="sft/resume-check.json is missing"):
        evaluate.resume_checks()
    branches = ("sft", "reward", "ppo", "grpo_verifier", "grpo_learned")
    for branch in branches:
        write_json(f"outputs/learning/{branch}/resume-check.json", {"status": "PASS"})
    assert set(evaluate.resume_checks()) == set(branches)
    for branch in ("reward", "grpo_learned"):  # GRPO is held to the same gate as the rest
        write_json(f"outputs/learning/{branch}/resume-check.json", {"status": "FAIL"})
        with pytest.raises(ReproError, match=f"{branch}/resume-check.json says FAIL"):
            evaluate.resume_checks()
        write_json(f"outputs/learning/{branch}/resume-check.json", {"status": "PASS"})


def test_generation_refuses_when_labels_are_visible(in_tmp):
    generate.assert_isolated()  # an empty folder is fine
    Path("data/generated/labels").mkdir(parents=True)
    with pytest.raises(HeldOutError, match="generation can see .*data/generated/labels"):
        generate.assert_isolated()


def test_results_schema_rejects_a_wrong_score_name():
    with pytest.raises(ReproError, match="schema"):
        evaluate.validate_results({"learned_score_name": "utility"})


def test_markdown_names_the_score_and_the_scope(tmp_path):
    metrics = evaluate.summarize([row(True, True, False), row(False, False)])
    results = {
        "scope": evaluate.SCOPE,
        "policies": {"sft": {"metrics": {"test_rows": metrics}}},
        "reward_model_test": {"accuracy": 0.9, "correct": 162, "ties": 0},
        "resume_checks": {"sft": {"status": "PASS"}},
        "ppo_sampled_responses": {w: {"rubric_success_rate": 0.5, "recognized_rate": 1.0,
                                      "mean_reward_model_score": 0.2}
                                  for w in ("first_10", "last_10")},
        "grpo_training": {"verifier": {
            "steps": 3, "first_windows": {"reward": 0.25, "sample/staleness_mean": 1.0},
            "last_windows": {"reward": 0.75, "sample/staleness_mean": None}}},
    }
    text = evaluate.markdown(results)
    assert "predicted simulated preference" in text and "no human study" in text
    assert "| sft | test_rows | 2 | 50.0 % |" in text
    assert "| verifier | 3 | 0.25 -> 0.75 | n/a -> n/a | n/a -> n/a | 1 -> n/a |" in text
