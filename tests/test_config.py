"""Schema validation: defaults, clear errors, every shipped profile valid."""

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow, snakemake

from reprorl.core import config as configuration
from reprorl.core.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def layers(profile: Path) -> list[Path]:
    """A profile's files in Snakemake's merge order: `smollm2-135m-cpu.yaml` is a cut that
    layers over `smollm2-135m.yaml` (`--configfile` both), any other stands alone."""
    base = profile.with_name(profile.stem.rpartition("-")[0] + ".yaml")
    return [base, profile] if profile.stem.rpartition("-")[0] and base.is_file() else [profile]


def merged(*files: Path) -> dict:
    from snakemake.utils import update_config

    raw = {}
    for file in files:
        update_config(raw, yaml.safe_load(file.read_text()))
    return raw


@pytest.mark.parametrize("profile", sorted((ROOT / "configs").glob("*.yaml")), ids=str)
def test_shipped_profiles_validate(profile):
    # Snakemake loads configs/default.yaml first and merges the profile over it; each profile
    # must also be valid on its own (over the profile it cuts, for a cut).
    result = configuration.validate(merged(*layers(profile)))
    # the smoke budget shortens responses (the corpus's longest answer still fits)
    limit = 32 if profile.stem.endswith("-smoke") else 64
    assert result["seed"] == 49 and result["limits"]["response_tokens"] == limit


@pytest.mark.parametrize("profile", sorted((ROOT / "configs").glob("*.yaml")), ids=str)
def test_a_profile_reads_the_same_from_the_command_line_as_under_snakemake(profile):
    """`reprorl <stage> --config PROFILE` fills what the profile leaves out from the schema;
    Snakemake from configs/default.yaml, which it loads first and merges the profile over.
    So every value default.yaml sets other than the schema's default must be set again by
    each profile, or the two ways of running it would train different things."""
    under_snakemake = merged(ROOT / "configs/default.yaml", *layers(profile))
    assert configuration.validate(under_snakemake) == configuration.validate(
        merged(*layers(profile)))


def test_defaults_are_filled():
    result = configuration.validate({})
    assert result["model"]["embedded"]["hidden_size"] == 256
    assert result["model"]["pretrain"]["batch_size"] == 32


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"thread": 2}, r"config key \(top level\): Additional properties .*'thread'"),
        ({"pretrain_threads": "two"},
         "config key pretrain_threads: 'two' is not of type 'integer'"),
        ({"model": {"embedded": {"hidden_size": 0}}},
         "config key model.embedded.hidden_size: 0 is less than the minimum"),
        ({"model": {"source": "hub"}}, "config key model.source: 'hub' is not one of"),
        # the engine refuses a masked-IS lower bound above 1 deep inside a GRPO stage
        ({"grpo": {"vllm_importance_sampling_clip_min": 2}},
         "config key grpo.vllm_importance_sampling_clip_min: 2 is greater than the maximum"),
    ],
)
def test_errors_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        configuration.validate(raw)


def test_command_line_mappings_get_the_types_a_config_file_gives():
    # Snakemake's own parser: a mapping after --config arrives with every scalar a string
    from snakemake.cli import parse_config

    raw = parse_config(["grpo={nproc_per_node: 2, ddp_timeout: 617, ddp_backend: null, "
                        "learning_rate: 1e-5, gradient_checkpointing: true}",
                        "limits={response_tokens: 32}", "seeds=[49,50]",
                        "model={pretrain: {steps: 10}}"])
    raw["grpo"]["num_train_epochs"] = "2"  # a number key: 2 as in a file, not 2.0
    assert raw["grpo"]["ddp_timeout"] == "617"  # what validate must undo
    result = configuration.validate(raw)
    typed = {k: result["grpo"][k] for k in raw["grpo"]}
    assert typed == {"nproc_per_node": 2, "ddp_timeout": 617, "ddp_backend": None,
                     "learning_rate": 1e-5, "gradient_checkpointing": True,
                     "num_train_epochs": 2}
    assert type(typed["num_train_epochs"]) is int
    assert result["limits"]["response_tokens"] == 32 and result["seeds"] == [49, 50]
    assert result["model"]["pretrain"]["steps"] == 10  # nested mappings too
    with pytest.raises(ConfigError, match="config key grpo.ddp_backend: 'mpi' is not one of"):
        configuration.validate(parse_config(["grpo={ddp_backend: mpi}"]))
    for text in ("soon", "--5", "²"):  # not a number: the schema names the key
        with pytest.raises(ConfigError, match="config key grpo.ddp_timeout: '.*' is not of"):
            configuration.validate(parse_config([f"grpo={{ddp_timeout: {text}}}"]))


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"sft": {"learning_rate": float("nan")}}, "sft.learning_rate: nan"),
        ({"ppo": {"gamma": float("-inf")}}, "ppo.gamma: -inf"),
        ({"grpo": {"rollout_worker_timeout": float("inf")}}, "grpo.rollout_worker_timeout: inf"),
        ({"seed": float("nan")}, "seed: nan"),  # before the schema's type error
        ({"model": {"expect": {"rope": [1.0, float("nan")]}}}, "model.expect.rope.1: nan"),
    ],
)
def test_non_finite_numbers_are_refused_by_key(raw, key):
    # validate, not only the parsers: Snakemake hands it the YAML it parsed itself
    with pytest.raises(ConfigError, match=f"config key {re.escape(key)} is not a finite number"):
        configuration.validate(raw)


@pytest.mark.parametrize("raw", [[1, 2], 5, "seed: 49", None])
def test_a_config_that_is_not_a_mapping_is_refused(raw):
    with pytest.raises(ConfigError, match="the config must be a mapping of keys to values"):
        configuration.validate(raw)


@pytest.mark.parametrize(
    "limits, message",
    [
        ({"context_tokens": 319}, re.escape(
            "limits.context_tokens: 319 is less than limits.prompt_tokens + "
            "limits.response_tokens = 256 + 64; raise it to at least 320")),
        ({"prompt_tokens": 300}, "limits.context_tokens: 320 is less than"),
        ({"response_tokens": 65}, "at least 321"),
    ],
)
def test_limits_must_leave_room_for_a_full_response(limits, message):
    with pytest.raises(ConfigError, match=message):
        configuration.validate({"limits": limits})


def test_a_larger_context_is_allowed():
    assert configuration.validate({"limits": {"context_tokens": 400}})["limits"] == {
        "prompt_tokens": 256, "response_tokens": 64, "context_tokens": 400}


@pytest.mark.parametrize(
    "size, message",
    [
        ({"num_attention_heads": 3}, "num_attention_heads: hidden_size 256 // 3 heads gives 85"),
        ({"hidden_size": 60, "num_attention_heads": 4},
         "num_attention_heads: hidden_size 60 // 4 heads gives 15 values per head, an odd"),
        ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide"),
    ],
)
def test_embedded_attention_shapes_that_cannot_run_are_refused(size, message):
    with pytest.raises(ConfigError, match=f"config key model.embedded.{message}"):
        configuration.validate({"model": {"embedded": size}})


def test_a_local_model_ignores_the_embedded_sizes():
    local = {"source": "local", "embedded": {"num_key_value_heads": 3}}
    assert configuration.validate({"model": local})["model"]["source"] == "local"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        configuration.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    for value, kind in (([1, 2], "a list"), (0, "a number"), ("text", "a string")):
        bad.write_text(yaml.safe_dump(value))
        message = f"must hold a mapping of keys to values, not {kind}"
        with pytest.raises(ConfigError, match=message):
            configuration.load(bad)
    bad.write_text("")
    assert configuration.load(bad) == configuration.validate({})  # empty: every default


@pytest.mark.parametrize(
    "text, where",
    [
        ("sft:\n  learning_rate: [1e-3\n", "line 3, column 1: expected ',' or ']'"),
        ("sft:\n  learning_rate: 1: 2\n", "line 2, column 19: mapping values are not allowed"),
        ("sft:\n\tseed: 1\n", "line 2, column 1: found character '\\t'"),
        ("seed: !!python/object:os.system x\n", "line 1, column 7: could not determine a "),
        ("seed: \x07\n", "unacceptable character #x0007"),
    ],
)
def test_yaml_syntax_errors_name_the_file_and_the_place(tmp_path, text, where):
    bad = tmp_path / "broken.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError) as caught:
        configuration.load(bad)
    message = str(caught.value)
    assert message.startswith(f"config file {bad} is not valid YAML (") and where in message
    assert "\n" not in message and message.endswith("fix the file (configs/default.yaml shows "
                                                     "the syntax)")


def test_yaml_non_finite_numbers_are_refused_by_key(tmp_path):
    profile = tmp_path / "nan.yaml"
    for value, shown in ((".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf")):
        profile.write_text(f"sft:\n  learning_rate: {value}\n")
        with pytest.raises(ConfigError, match=f"config key sft.learning_rate: {shown} is not a "):
            configuration.load(profile)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"seed": 49', ("--config-json is not valid JSON (Expecting ',' delimiter at line 1, "
                         "column 12); pass one JSON object")),
        ("", "--config-json is not valid JSON (Expecting value at line 1, column 1)"),
        ("{'seed': 49}", "not valid JSON (Expecting property name enclosed in double quotes"),
        ("[1, 2]", "--config-json must be a JSON object ({...}), not a list"),
        ("5", "--config-json must be a JSON object ({...}), not a number"),
        ("null", "--config-json must be a JSON object ({...}), not null"),
        ('{"sft": {"learning_rate": NaN}}', "config key sft.learning_rate: nan is not a finite"),
        ('{"ppo": {"lam": Infinity}}', "config key ppo.lam: inf is not a finite number"),
        ('{"ppo": {"lam": -Infinity}}', "config key ppo.lam: -inf is not a finite number"),
    ],
)
def test_config_json_errors(text, message):
    with pytest.raises(ConfigError) as caught:
        configuration.load_json(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_config_json_is_what_the_rules_pass():
    full = configuration.validate({})
    subset = configuration.stage_config_json(full, "base_model")
    assert configuration.load_json(subset)["model"] == full["model"]


def test_stage_subsets_only_hold_what_the_stage_reads():
    full = configuration.validate({})
    # numerics decides every stage's bits, so every stage carries it
    assert set(configuration.stage_config(full, "prepare")) == {"numerics", "seed"}
    assert set(configuration.stage_config(full, "base_model")) == {"numerics", "model", "limits"}


def test_workflow_schema_is_the_package_schema():
    linked = ROOT / "workflow/schemas/config.schema.yaml"
    assert linked.resolve() == configuration.SCHEMA_PATH.resolve()


# What the seed fixes for its Qwen2.5-0.5B-Instruct run (the tutorial's numbers; GRPO: the
# async trainer's documented defaults, groups of 8), checked where the stages receive them.
SEED_QWEN = {
    "model.dtype": "bfloat16", "model.attn_implementation": "eager",
    "limits.prompt_tokens": 256, "limits.response_tokens": 64, "limits.context_tokens": 320,
    **{f"{branch}.{key}": value for branch in ("sft", "reward") for key, value in {
        "learning_rate": 2e-5, "weight_decay": 0.01, "warmup_ratio": 0.1,
        "final_lr_ratio": 0.1, "max_grad_norm": 1.0, "sampler_seed": 149}.items()},
    "ppo.actor_learning_rate": 5e-6, "ppo.critic_learning_rate": 1e-5, "ppo.weight_decay": 0.01,
    "ppo.warmup_ratio": 0.1, "ppo.final_lr_ratio": 0.1, "ppo.max_grad_norm": 1.0,
    "ppo.kl_coef": 0.02, "ppo.cut_penalty": 1.0, "ppo.gamma": 1.0, "ppo.lam": 0.95,
    "ppo.clip_epsilon": 0.2,
    "grpo.num_generations": 8, "grpo.learning_rate": 1e-6, "grpo.gradient_checkpointing": True,
    "grpo.temperature": 1.0, "grpo.epsilon": 0.2, "grpo.score_centering": True,
    "grpo.vllm_importance_sampling_clip_min": 0.5, "grpo.vllm_importance_sampling_clip_max": 5.0,
    "grpo.max_staleness": 4, "grpo.weight_sync_steps": 1, "grpo.num_sampler_logprobs": 8,
    "grpo.weight_decay": 0.0, "grpo.max_grad_norm": 1.0,
}


def test_qwen_profile_keeps_the_seed_values_as_snakemake_merges_it(tmp_path):
    """Snakemake loads configs/default.yaml (the Snakefile's `configfile:`) and merges
    `--configfile configs/qwen2.5-0.5b.yaml` over it; a key the profile leaves out takes the
    tiny base's value. Read what each stage's command receives from Snakemake's own dry run."""
    workdir = copy_workflow(tmp_path / "wf")
    (workdir / "assets/qwen2.5-0.5b-instruct").mkdir(parents=True)  # a dry run needs it only
    result = snakemake(workdir, "--dry-run", "--printshellcmds", "--forceall",
                       "--configfile", "configs/qwen2.5-0.5b.yaml")
    commands = re.findall(r"python -m reprorl (\S+) --config-json '(\{.*?\})'", result.stdout)
    received = {stage: json.loads(text) for stage, text in commands}
    assert {"sft_continuous", "reward_continuous", "ppo_continuous",
            "grpo_learned_continuous"} <= set(received)
    for path, value in SEED_QWEN.items():
        section, key = path.split(".")
        stages = [stage for stage, config in received.items() if section in config]
        assert stages, path
        found = {stage: received[stage][section][key] for stage in stages}
        assert set(found.values()) == {value}, f"{path}: {found}, the seed's is {value!r}"
