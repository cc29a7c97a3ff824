"""The over-optimisation curves' fixed points and the seeds target's config."""

from reprorl import config as configuration
from reprorl import seeds, snapshots


def test_snapshot_points_are_the_quarters_and_the_end():
    assert snapshots.points(100) == [25, 50, 75, 100]  # PPO's iterations
    assert snapshots.points(21) == [6, 12, 18, 21]  # each a multiple of the save interval
    assert all(p % snapshots.every(21) == 0 for p in snapshots.points(21)[:-1])
    assert snapshots.points(3) == [1, 2, 3] and snapshots.points(1) == [1]


def test_seed_49_is_the_main_run_and_others_move_only_learning_seeds():
    config = configuration.validate({})
    assert seeds.seed_config(config, 49) == config  # the defaults are seed 49's
    moved = seeds.seed_config(config, 50)
    changed = {(section, key) for section in config if isinstance(config[section], dict)
               for key in config[section] if moved[section][key] != config[section][key]}
    assert changed == {("sft", "seed"), ("sft", "sampler_seed"), ("reward", "seed"),
                       ("reward", "sampler_seed"), ("ppo", "seed"), ("ppo", "prompt_seed"),
                       ("ppo", "generation_seed"), ("grpo", "seed")}
    assert moved["ppo"]["generation_seed"] == 250 and moved["seed"] == 49  # corpus fixed


def test_seeds_from_the_snakemake_command_line_are_integers():
    # `--config seeds=[49,50,51]` reaches the config as YAML BaseLoader strings
    assert configuration.validate({"seeds": ["49", "50", "51"]})["seeds"] == [49, 50, 51]
