"""The over-optimisation curves' fixed points and the seeds target's config."""

import pytest

from reprorl.core import config as configuration
from reprorl.core import layout
from reprorl.core.manifest import read_json, write_json
from reprorl.core.stages import POLICIES
from reprorl.pipeline import seeds, snapshots


def test_snapshot_points_are_the_quarters_and_the_end():
    assert snapshots.points(100) == [25, 50, 75, 100]  # PPO's iterations
    assert snapshots.points(21) == [6, 12, 18, 21]  # each a multiple of the save interval
    assert all(p % snapshots.every(21) == 0 for p in snapshots.points(21)[:-1])
    assert snapshots.points(3) == [1, 2, 3] and snapshots.points(1) == [1]


def test_snapshots_are_found_in_step_order(tmp_path):
    for step in (12000, 9999, 7):  # by name, step-12000 would come before step-9999
        (tmp_path / snapshots.snapshot_name(step)).mkdir()
    (tmp_path / snapshots.PLAN).write_text("{}")  # beside them, not one of them
    (tmp_path / "step-0007-old").mkdir()  # a copy: not one either
    assert [snapshots.step_of(p) for p in snapshots.found(tmp_path)] == [7, 9999, 12000]


def test_seed_49_is_the_main_run_and_others_move_only_learning_seeds():
    config = configuration.validate({})
    assert seeds.main_seed(config) == 49  # the defaults are seed 49's
    assert seeds.results_path(49, config) == layout.RESULTS  # so its results are the main run's
    assert seeds.results_path(50, config) == layout.seed_dir(50) / layout.RESULTS
    assert seeds.seed_config(config, 49) == {**config, "resume_triples": False, "curves": False}
    moved = seeds.seed_config(config, 50)
    changed = {(section, key) for section in config if isinstance(config[section], dict)
               for key in config[section] if moved[section][key] != config[section][key]}
    assert changed == {("sft", "seed"), ("sft", "sampler_seed"), ("reward", "seed"),
                       ("reward", "sampler_seed"), ("ppo", "seed"), ("ppo", "prompt_seed"),
                       ("ppo", "generation_seed"), ("grpo", "seed")}
    assert moved["ppo"]["generation_seed"] == 250 and moved["seed"] == 49  # corpus fixed
    assert not moved["resume_triples"]  # the main run's triples prove resumption
    assert not moved["curves"]  # the summary reads the held-out rates alone
    uneven = configuration.validate({"ppo": {"prompt_seed": 7}})
    assert seeds.main_seed(uneven) is None  # no seed's run is the main run's


def test_seeds_from_the_snakemake_command_line_are_integers():
    # `--config seeds=[49,50,51]` reaches the config as YAML BaseLoader strings
    assert configuration.validate({"seeds": ["49", "50", "51"]})["seeds"] == [49, 50, 51]


def test_the_seeds_summary_gives_each_policy_its_spread(in_tmp):
    config = configuration.validate({"seeds": [49, 50, 51]})
    for seed, successes in zip(config["seeds"], (5, 6, 7)):
        folder = layout.seed_dir(str(seed)) if seed != 49 else layout.RESULTS.parents[1]
        rows = [{"prompt": f"p{i}", "split": "test", "rubric_success": i < successes,
                 "recognized": True, "relevant": True, "unsupported_certainty": False,
                 "learned_score": -successes / 10, "logratio_per_token": 0.0}
                for i in range(10)]
        rate = {"test_rows": {"rubric_success_rate": successes / 10}}
        write_json(folder / layout.RESULTS, {
            "policies": {p: {"rows": rows, "metrics": rate} for p in POLICIES},
            "exercise": {"polite_wrong_outranks_plain_correct": 14, "contexts": 20},
            "reward_model_test": {"accuracy": 0.95},
            "ppo_sampled_responses": {"first_10": {"mean_reward_model_score": 0.1},
                                      "last_10": {"mean_reward_model_score": seed / 100}},
            "grpo_training": {"learned": {"first_windows": {"reward": 1.0},
                                          "last_windows": {"reward": 0.5}}},
            "difference_to_sft": {"ppo": {"test_rows": {"mean_learned_score": {
                "interval_95": [-0.1, 0.1]}}}}})
        for stage, start, wall in (("prepare", "2026-12-01T09:00:00+0000", 1.0),  # copied
                                   ("sft_continuous", "2026-12-02T10:00:00+0000", 30.0),
                                   ("evaluate", "2026-12-02T10:05:00+0000", 2.5)):
            write_json(folder / layout.manifest(stage), {"run": {"started_at": start,
                                                                  "wall_seconds": wall}})
    result = seeds.summary(config, log=lambda _: None)
    assert result["policies"]["ppo"]["rubric_success_rate"]["mean"] == pytest.approx(0.6)
    written = read_json(layout.SEEDS_SUMMARY)
    spread = written["policies"]["ppo"]["rubric_success_rate"]
    assert spread["values"] == spread["per_seed"] == [0.5, 0.6, 0.7] and spread["min"] == 0.5
    assert spread["sd"] == pytest.approx(0.1)
    low, high = spread["interval_95"]
    assert low < 0.5 < 0.7 < high  # over seeds and the 10 prompts
    assert spread["difference_to_sft"]["per_seed"] == [0.0, 0.0, 0.0]  # ppo's rows are SFT's
    assert written["main_seed"] == 49
    claims = {c["claim"]: c["seeds"] for c in written["claims"]}
    assert claims == {"ppo_proxy_up_gold_down": [], "grpo_learned_proxy_up_gold_down": [],
                      "grpo_verifier_gold_up": [], "ppo_greedy_score_flat": [49, 50, 51],
                      "accurate_yet_shortcut": [49, 50, 51]}
    assert written["seconds_per_seed"] == {"49": 302.5, "50": 302.5, "51": 302.5}
    assert written["learning_seeds"]["51"]["ppo"] == {"seed": 51, "prompt_seed": 151,
                                                     "generation_seed": 251}
