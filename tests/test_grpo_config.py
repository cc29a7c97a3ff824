"""The pipeline's GRPO defaults (the `grpo` block of the config schema) against
`AsyncGRPOConfig`'s, which stay the seed's (TRL's): every difference is deliberate and said."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import reprorl
from reprorl.grpo import AsyncGRPOConfig
from reprorl.pipeline.grpo_run import PIPELINE_KEYS

SCHEMA = Path(reprorl.__file__).parent / "schemas" / "config.schema.yaml"

# Field -> why the pipeline's default differs from AsyncGRPOConfig's. The schema's description
# of the field repeats the why, so a reader of either file finds it.
PIPELINE_DIFFERENCES = {
    # the pipeline trains on CPUs within a time budget (configs/default.yaml says how long)
    "num_train_epochs": "one pass over the 672 rollout prompts; the seed's 3 do not fit a CPU "
                        "run's time budget",
    "num_generations": "groups of 4, half the seed's 8, for a CPU run's time budget",
    "groups_per_step": "four prompts a step, the 16 samples of a step before tree packing, "
                       "which 8 rows of max_model_len hold in one micro-batch",
    "gradient_checkpointing": "the tiny model needs no memory and CPU time is the budget",
    "max_concurrent_rollouts": "the embedded server decodes 64 sequences at once "
                               "(embedded_server_max_num_seqs); more would only wait in its "
                               "queue",
    "logging_steps": "the means of one step's 16 samples are noisy, five steps make a window",
    "save_steps": "a pipeline run is a few hundred steps at most, so 500 would checkpoint only "
                  "at its end",
    "seed": "the project's seed, 49, as every stage's",
    "schedule_lag": "the pipeline's GRPO runs are resumable branches whose resume checks must "
                    "pass, as every other stage's",
    # grpo_run.py maps null to embedded_server=True
    "vllm_server_base_url": "a pipeline run needs no server started beforehand",
}


def grpo_block() -> dict:
    return yaml.safe_load(SCHEMA.read_text())["properties"]["grpo"]["properties"]


def test_pipeline_defaults_differ_from_the_configs_only_where_said():
    properties = grpo_block()
    defaults = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    shared = properties.keys() & defaults.keys()
    assert len(shared) >= 20, sorted(shared)  # the block is the one meant, not an empty one
    # a key without a default here (report_to) is left to AsyncGRPOConfig's
    differ = {name for name in shared
              if properties[name].get("default", defaults[name]) != defaults[name]}
    unexplained = {name: (properties[name]["default"], defaults[name])
                   for name in differ - PIPELINE_DIFFERENCES.keys()}
    assert not unexplained, f"schema vs AsyncGRPOConfig defaults: {unexplained}"
    assert differ == PIPELINE_DIFFERENCES.keys(), "a listed difference is no longer one"
    for name, why in PIPELINE_DIFFERENCES.items():
        description = properties[name]["description"]
        assert why in description, f"the schema's {name} lacks its why"
        # and the default it names as the one it replaces is AsyncGRPOConfig's
        claim = re.search(r"Not AsyncGRPOConfig's (.+?)(?::\s| \()", description)
        assert claim and yaml.safe_load(claim.group(1)) == defaults[name], (name, description)


def test_pipeline_defaults_are_valid_settings():
    settings = {name: spec["default"] for name, spec in grpo_block().items()
                if name not in PIPELINE_KEYS and spec.get("default") is not None}
    config = AsyncGRPOConfig(output_dir="out", **settings)
    assert config.groups_per_step == 4 and not config.gradient_checkpointing


# Fields whose default here is not TRL 1.16's, each a departure docs/grpo.md names: the seed's
# values (it documents them) where TRL 1.16 later changed them, and one TRL default that would
# claim a behaviour this trainer does not have.
DEFAULT_DEPARTURES = {
    "vllm_server_timeout": "the seed's 1800 s (TRL 1.16: 240 s)",
    "logging_nan_inf_filter": "None: a non-finite loss stops the run, neither filtered nor "
                              "logged",
}


def _trl_fields() -> dict[str, object]:
    """TRL 1.16's AsyncGRPOConfig fields and their defaults, from the installed TRL."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLConfig

    def default(spec):
        if spec.default_factory is not dataclasses.MISSING:
            return spec.default_factory()
        return spec.default
    return {spec.name: default(spec) for spec in dataclasses.fields(TRLConfig)}


def test_every_field_of_trls_config_is_honoured_or_refused_by_name():
    from reprorl.grpo import trl_fields

    trl = _trl_fields()
    ours = {spec.name: spec for spec in dataclasses.fields(AsyncGRPOConfig)}
    honoured = {name for name in trl if name in ours and name not in trl_fields.NAMES}
    renamed = {name for name in trl if name in trl_fields.RENAMED}
    unread = {name for name in trl if name in trl_fields.UNREAD}
    answered = honoured | renamed | unread
    assert set(trl) - answered == set(), "fields of TRL's config with no answer here"
    assert set(trl_fields.NAMES) - set(trl) == set(), "answers for fields TRL does not have"
    assert len(trl) == 142 and (len(honoured), len(renamed), len(unread)) == (55, 3, 84)
    for name in trl:  # TRL's declared defaults, but where a departure says why
        spec = ours[name]
        value = spec.default_factory() if spec.default_factory is not dataclasses.MISSING \
            else spec.default
        if name not in DEFAULT_DEPARTURES:
            assert value == trl[name], f"{name}: {value!r} here, {trl[name]!r} in TRL"
    for name, (_, accepted, _) in trl_fields.UNREAD.items():
        if accepted == trl_fields.ANY:
            AsyncGRPOConfig(**{name: object()})  # read by scripts, never by the trainer
            continue
        other = "a value no field takes"
        with pytest.raises(ValueError, match=rf"^AsyncGRPOConfig: {name}='a value no field "
                                             rf"takes' is refused: \w"):
            AsyncGRPOConfig(**{name: other})
        for value in accepted:
            AsyncGRPOConfig(**{name: value})


def test_trls_new_names_set_the_seeds_fields():
    config = AsyncGRPOConfig(heartbeat_stale_after_s=12.5, request_timeout=30,
                             max_inflight_tasks=16)
    assert (config.rollout_worker_timeout, config.vllm_request_timeout,
            config.max_concurrent_rollouts) == (12.5, 30, 16)
    assert "request_timeout" not in config.to_dict()  # a resume compares the seed's names
    with pytest.raises(ValueError, match="request_timeout .* and vllm_request_timeout differ"):
        AsyncGRPOConfig(request_timeout=30, vllm_request_timeout=40)
    with pytest.raises(ValueError, match="trackio_space_id='me/space' is refused: no model hub"):
        AsyncGRPOConfig(trackio_space_id="me/space")
    with pytest.raises(ValueError, match=r"report_to \['tensorbored'\] is not an integration"):
        AsyncGRPOConfig(report_to=["tensorboard", "tensorbored"])


@pytest.mark.parametrize(("name", "kwargs"), [
    ("constant", None), ("constant_with_warmup", None), ("linear", None),
    ("cosine", {"num_cycles": 0.25}), ("cosine_with_restarts", {"num_cycles": 2}),
    ("polynomial", {"power": 2.0, "lr_end": 1e-7}), ("inverse_sqrt", None),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 3})])
def test_every_schedule_gives_the_rates_transformers_steps_through(name, kwargs):
    """The trainer's rate at each step is what transformers' scheduler gives an optimizer the
    Trainer steps, bit for bit (`schedule.py`); kwargs may come as JSON, as in TRL."""
    import json

    import torch
    from transformers import get_scheduler

    from reprorl.grpo import schedule

    args = AsyncGRPOConfig(output_dir="out", learning_rate=1e-3, max_steps=10, warmup_steps=0.2,
                           lr_scheduler_type=name,
                           lr_scheduler_kwargs=json.dumps(kwargs) if kwargs else None)
    ours = [schedule.rate(args, schedule.multiplier(args), step) for step in range(10)]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=2, num_training_steps=10,
                              scheduler_specific_kwargs=kwargs)
    theirs = []
    for _ in range(10):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert ours == theirs


def test_schedules_that_cannot_run_here_are_refused_by_name():
    for settings, words in (
            ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "follows an evaluation metric"),
            ({"lr_scheduler_type": "cosine"}, "'cosine' needs max_steps > 0"),
            ({"lr_scheduler_type": "cosine", "max_steps": 5, "lr_scheduler_kwargs": {"power": 2}},
             "lr_scheduler_kwargs do not fit 'cosine'"),
            ({"lr_scheduler_type": "sawtooth"}, "lr_scheduler_type must be one of")):
        with pytest.raises(ValueError, match=words):
            AsyncGRPOConfig(output_dir="out", **settings)


def test_optimizers_by_trls_names_with_their_optim_args():
    import torch

    from reprorl.grpo import optimizers

    def built(**settings):
        args = AsyncGRPOConfig(output_dir="out", learning_rate=0.01, weight_decay=0.1,
                               **settings)
        return optimizers.build([torch.nn.Parameter(torch.zeros(2))], args)

    fused = built()
    assert type(fused) is torch.optim.AdamW and fused.defaults["fused"]
    sgd = built(optim="sgd", optim_args="momentum=0.9, nesterov=true")
    assert type(sgd) is torch.optim.SGD and (sgd.defaults["momentum"], sgd.defaults["nesterov"],
                                             sgd.defaults["weight_decay"]) == (0.9, True, 0.1)
    rms = built(optim="rmsprop", optim_args="alpha=0.9,centered=1")
    assert type(rms) is torch.optim.RMSprop and rms.defaults["centered"]
    assert type(built(optim="adagrad", optim_args="lr_decay=0.5")) is torch.optim.Adagrad
    for settings, words in (({"optim": "lion"}, "optim must be one of"),
                            ({"optim": "sgd", "optim_args": "betas=1"}, r"\['betas'\] are not"),
                            ({"optim_args": "momentum=0.9"}, "adamw_torch_fused, which reads"),
                            ({"optim": "sgd", "optim_args": "momentum"}, "must read")):
        with pytest.raises(ValueError, match=words):
            AsyncGRPOConfig(output_dir="out", **settings)
